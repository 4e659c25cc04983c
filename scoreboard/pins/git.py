"""Git reference pins: the ref still exists, still resolves to the pinned commit, and has base_commit in its history.

The ref -> SHA lookup is `git ls-remote` (no clone). The ancestry check fetches the ref's commit
history (`--filter=tree:0`: commits only, no trees or blobs) into a bare cache repository under
``$SCOREBOARD_CACHE/audit/git/<sha256(url)[:16]>`` and tests membership in `git rev-list <head>`,
which never looks up an absent object (a partial clone would otherwise try to fetch it lazily).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import git

from ..cache import cache_dir
from ..gitref import GIT_ENV, GitUnavailable, git_error, ls_remote
from ..lockfile import GitReference
from . import Finding, short

__all__ = ["GitUnavailable", "check_git_reference", "fetch_history", "ls_remote"]

FETCH_TIMEOUT_FACTOR = 10  # a history fetch may take this many times the per-request timeout


def _local_ref(ref: str) -> str:
    return "refs/scoreboard/audit/" + re.sub(r"[^A-Za-z0-9._/-]", "_", ref).strip("/")


def fetch_history(url: str, ref: str, cache: Path, timeout: float) -> tuple[str, set[str]]:
    """Fetch `ref`'s commits into the cache repo; return (head commit, every commit in its history)."""
    path = cache / "audit" / "git" / hashlib.sha256(url.encode()).hexdigest()[:16]
    try:
        repo = git.Repo(path) if (path / "HEAD").is_file() else git.Repo.init(path, bare=True, mkdir=True)
        local = _local_ref(ref)
        repo.git.fetch("--no-tags", "--force", "--quiet", "--filter=tree:0", url, f"+{ref}:{local}",
                       kill_after_timeout=timeout * FETCH_TIMEOUT_FACTOR, env=GIT_ENV)
        head = repo.git.rev_parse(f"{local}^{{commit}}").strip()
        history = set(repo.git.rev_list(head).split())
    except git.GitCommandError as exc:
        raise GitUnavailable(f"`git fetch {url} {ref}` failed: {git_error(exc)}") from exc
    return head, history


def check_git_reference(ref_id: str, r: GitReference, *, timeout: float, cache: Path | None = None,
                        targets: tuple[str, ...] = ()) -> list[Finding]:
    """All findings for one `[references.<id>]` of kind git."""
    pin = f"references.{ref_id}"
    cache = cache_dir(cache)
    subject = f"ref {r.ref}"
    unreachable = ("re-run `scoreboard audit-pins`; if it persists, check the network, the URL and access "
                   f"to {r.repo} (this is not drift: nothing was observed to move)")
    try:
        now = ls_remote(r.repo, r.ref, timeout)
    except GitUnavailable as exc:
        return [Finding("error", pin, subject, f"could not resolve the ref: {exc}", unreachable, r.commit, "",
                        targets)]
    if now is None:
        return [Finding(
            "drift", pin, subject,
            f"ref {r.ref} no longer exists in {r.repo} (deleted, or the PR was closed and its ref removed)",
            f"the pinned source can no longer be fetched: choose a new pin deliberately (an upstream commit or "
            f"a tag), update {pin}.ref and .commit, rebuild and re-measure the baselines",
            r.commit, "(missing)", targets)]
    try:
        head, history = fetch_history(r.repo, r.ref, cache, timeout)
    except GitUnavailable as exc:
        head, history, fetch_error = now, set(), str(exc)
    else:
        fetch_error = ""

    findings: list[Finding] = []
    if now != r.commit:
        how = ""
        if history:
            how = (" The pinned commit is still in its history: new commits were pushed on top."
                   if r.commit in history else
                   " The pinned commit is no longer in its history: the ref was force-pushed (rewritten).")
        findings.append(Finding(
            "drift", pin, subject,
            f"ref {r.ref} moved from {short(r.commit)} to {short(now)}: a force-push or new commits.{how}",
            f"Re-pin deliberately after review and re-measure: update {pin}.commit (every number measured on "
            f"{short(r.commit)} is no longer reproducible from this ref)",
            r.commit, now, targets))
    if fetch_error:
        findings.append(Finding("error", pin, f"base_commit {short(r.base_commit)}",
                                f"could not fetch the ref's history to check base_commit: {fetch_error}",
                                unreachable, r.base_commit, "", targets))
        return findings
    if r.base_commit not in history:
        of = "the pinned commit" if head == r.commit else f"the ref's new head {short(head)}"
        fix = (f"the lock is inconsistent: set {pin}.base_commit to the upstream commit the pinned commit is "
               f"based on" if head == r.commit else
               f"the ref was rebased onto another base or rewritten: review it, then re-pin {pin}.commit and "
               f".base_commit together and re-measure")
        findings.append(Finding(
            "drift", pin, f"base_commit {short(r.base_commit)}",
            f"base_commit {short(r.base_commit)} is not an ancestor of {of} ({short(head)})",
            fix, r.base_commit, f"not in the history of {head}", targets))
    if not findings:
        findings.append(Finding("ok", pin, subject,
                                f"{r.ref} still resolves to {short(r.commit)}; base_commit {short(r.base_commit)} "
                                f"is an ancestor", "", r.commit, now, targets))
    return findings
