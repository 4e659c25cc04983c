"""Hugging Face weights pins: the revision exists, the quant's file set equals the pins, each file's size and LFS sha256.

Nothing is downloaded. Three metadata calls per weights pin, all through `huggingface_hub.HfApi`:
`model_info(revision=R)` (revision exists, resolves to R), `list_repo_tree(<quant dir>, recursive=True,
revision=R)` (the file set: extra, missing, re-split shards) and `get_paths_info(<pinned paths>,
revision=R)` (size + `lfs.sha256` per file; it silently drops missing paths, so its answer is compared
with the pinned list, not trusted as the list). The tree listing goes through the library's retrying
call (up to 5 retries with 1..8 s back-off on 429/5xx/timeouts); the other two are single requests.

The endpoint is `--hub-endpoint`, else `$SCOREBOARD_HF_ENDPOINT`, else the library's default (which
honours `HF_ENDPOINT`). Every request gets the audit's timeout through the client factory.
"""

from __future__ import annotations

import os
import posixpath
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from ..errors import InputError, PinError, ScoreboardError
from ..lockfile import Lock, Weights, update_lock
from . import Finding, human_bytes, short

_SHA1 = re.compile(r"^[0-9a-f]{40}$")
GENERATED_NOTE = "local (generated; verified by `scoreboard weights verify`)"


class HubUnavailable(Exception):
    """The Hub could not be asked or did not answer usefully (network, timeout, 5xx, 429, auth): an error."""


class HubGone(Exception):
    """The Hub answered that the repo or revision does not exist: drift."""


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int  # bytes
    sha256: str | None  # LFS sha256; None for a file not stored in LFS


@dataclass(frozen=True)
class HubManifest:
    """What the Hub says about one repo at one revision, restricted to the quant's directories."""

    repo: str
    revision: str  # the commit the revision resolved to
    dirs: tuple[str, ...]  # listed directories ("" = repo root)
    tree: dict[str, RemoteFile]  # every file under `dirs`, from the tree listing
    info: dict[str, RemoteFile]  # paths-info answer for the requested paths (missing ones are absent)


def hub_endpoint(option: str | None = None) -> str:
    if option:
        return option.rstrip("/")
    env = os.environ.get("SCOREBOARD_HF_ENDPOINT")
    if env:
        return env.rstrip("/")
    from huggingface_hub import constants

    return constants.ENDPOINT


@contextmanager
def _timeout(seconds: float) -> Iterator[None]:
    """Give every huggingface_hub request a timeout (its default client has none), then restore it."""
    import huggingface_hub
    from huggingface_hub.utils import _http

    if not hasattr(huggingface_hub, "set_client_factory"):
        raise ScoreboardError("huggingface_hub is too old for the pin audit (needs >= 1.0)",
                              "pip install -U huggingface_hub")
    default = _http.default_client_factory

    def factory():  # the library's client, with a timeout
        client = default()
        client.timeout = seconds
        return client

    huggingface_hub.set_client_factory(factory)
    try:
        yield
    finally:
        huggingface_hub.set_client_factory(default)


def _classify(exc: Exception, what: str, timeout: float) -> Exception:
    """Map a library exception to HubGone (an answer: drift) or HubUnavailable (no answer: error)."""
    from huggingface_hub.errors import (DisabledRepoError, GatedRepoError, HfHubHTTPError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    name = type(exc).__name__
    first = (str(exc).strip().splitlines() or [name])[0]
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(exc, RevisionNotFoundError):
        return HubGone(f"{what}: the Hub has no such revision (HTTP {status})")
    if isinstance(exc, GatedRepoError):
        return HubUnavailable(f"{what}: the repo is gated for this token (HTTP {status}); set HF_TOKEN")
    if isinstance(exc, RepositoryNotFoundError) and status == 404:
        return HubGone(f"{what}: repository not found (deleted, renamed or made private; HTTP 404)")
    if isinstance(exc, DisabledRepoError):
        return HubGone(f"{what}: the repository is disabled (HTTP {status})")
    if isinstance(exc, HfHubHTTPError):
        return HubUnavailable(f"{what}: HTTP {status}: {first}")
    if "Timeout" in name:
        return HubUnavailable(f"{what}: timed out after {timeout:g} s ({name})")
    return HubUnavailable(f"{what}: {name}: {first}")


def _remote(entry: Any) -> RemoteFile:
    lfs = getattr(entry, "lfs", None)
    return RemoteFile(entry.path, int(entry.size), lfs.sha256 if lfs is not None else None)


def read_manifest(repo: str, revision: str, dirs: list[str], paths: list[str] | None, *,
                  root_suffixes: tuple[str, ...] = (), endpoint: str | None = None,
                  timeout: float = 30.0) -> HubManifest:
    """Revision -> commit, the file tree under `dirs`, and paths-info for `paths` (None: every tree file).

    A quant directory is listed recursively; the repo root ("") only flat, and only files whose
    extension is in `root_suffixes` (README.md or config files next to root-level shards are not shards).
    """
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RemoteEntryNotFoundError
    from huggingface_hub.hf_api import RepoFile

    api = HfApi(endpoint=hub_endpoint(endpoint))
    with _timeout(timeout):
        try:
            info = api.model_info(repo, revision=revision, timeout=timeout)
        except Exception as exc:  # the library raises many types; _classify sorts answer from failure
            raise _classify(exc, f"{repo}@{short(revision)}", timeout) from exc
        resolved = info.sha or ""
        tree: dict[str, RemoteFile] = {}
        for d in dirs:
            try:  # the repo root is listed flat: its other quants' folders are not this pin's files
                entries = list(api.list_repo_tree(repo, d or None, recursive=bool(d), revision=revision))
            except RemoteEntryNotFoundError:
                entries = []  # the directory is gone: every pinned file under it is missing
            except Exception as exc:
                raise _classify(exc, f"tree {repo}@{short(revision)}:{d or '/'}", timeout) from exc
            tree.update({e.path: _remote(e) for e in entries if isinstance(e, RepoFile)
                         and (d or posixpath.splitext(e.path)[1] in root_suffixes)})
        want = sorted(tree) if paths is None else sorted(paths)
        try:
            got = api.get_paths_info(repo, want, revision=revision) if want else []
        except Exception as exc:
            raise _classify(exc, f"paths-info {repo}@{short(revision)}", timeout) from exc
    return HubManifest(repo, resolved, tuple(dirs), tree,
                       {e.path: _remote(e) for e in got if isinstance(e, RepoFile)})


def main_revision(repo: str, *, endpoint: str | None = None, timeout: float = 30.0) -> str:
    """The commit the repo's default branch points at now."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=hub_endpoint(endpoint))
    with _timeout(timeout):
        try:
            return api.model_info(repo, timeout=timeout).sha or ""
        except Exception as exc:
            raise _classify(exc, repo, timeout) from exc


def quant_dirs(w: Weights) -> list[str]:
    """The quant's path(s): the directories of the pinned files ("" = repo root)."""
    return sorted({posixpath.dirname(f.path) for f in w.files})


def root_suffixes(w: Weights) -> tuple[str, ...]:
    """Extensions of the pinned files at the repo root (e.g. (".gguf",)): the shard kind to compare there."""
    return tuple(sorted({posixpath.splitext(f.path)[1] for f in w.files if "/" not in f.path}))


# ------------------------------------------------------------------------------------------------
# audit

def check_weights(wid: str, w: Weights, *, endpoint: str | None = None, timeout: float = 30.0,
                  targets: tuple[str, ...] = ()) -> list[Finding]:
    """All findings for one `[weights.<id>]`."""
    pin = f"weights.{wid}"
    who = targets[0] if targets else wid
    if w.repo == "generated":
        return [Finding("ok", pin, f"generated {w.spec} seed {w.seed}", GENERATED_NOTE, "", "", "", targets)]
    if not w.fully_pinned:
        return [_unpinned(pin, who, w, endpoint, timeout, targets)]
    repin = (f"review the Hub's change, then re-pin deliberately with `scoreboard pin weights --target {who} --revision "
             f"<sha>` and re-measure every baseline on these weights")
    try:
        m = read_manifest(w.repo, w.revision, quant_dirs(w), [f.path for f in w.files],
                          root_suffixes=root_suffixes(w), endpoint=endpoint, timeout=timeout)
    except HubGone as exc:
        return [Finding("drift", pin, f"revision {short(w.revision)}", f"{exc}: the pinned weights can no longer "
                        f"be fetched at their pin", repin, w.revision, "(missing)", targets)]
    except HubUnavailable as exc:
        return [Finding("error", pin, f"{w.repo}@{short(w.revision)}", f"could not read the Hub's metadata: {exc}",
                        "re-run `scoreboard audit-pins`; if it persists check the network, the endpoint and "
                        "HF_TOKEN (this is not drift: nothing was observed to move)", w.revision, "", targets)]
    return _compare(pin, w, m, repin, targets)


def _unpinned(pin: str, who: str, w: Weights, endpoint: str | None, timeout: float,
              targets: tuple[str, ...]) -> Finding:
    n = sum(1 for f in w.files if not f.pinned)
    sha, note = w.revision, ""
    if not sha:
        try:
            sha = main_revision(w.repo, endpoint=endpoint, timeout=timeout)
            note = f" The Hub's main is at {sha}."
        except (HubGone, HubUnavailable) as exc:  # only a hint: a failed look-up does not fail the audit
            note = f" (Could not look up the Hub's main: {str(exc).rstrip('.')}.)"
    return Finding("unpinned", pin, f"{w.repo} {w.quant}".strip(),
                   f"{n} of {len(w.files)} file(s) have no size/sha256 pinned"
                   + ("" if w.revision else " and no revision") + f": the target can run but cannot seal.{note}",
                   f"review the upload, then `scoreboard pin weights --target {who} --revision {sha or '<sha>'}`",
                   w.revision, "", targets)


def _compare(pin: str, w: Weights, m: HubManifest, repin: str, targets: tuple[str, ...]) -> list[Finding]:
    out: list[Finding] = []

    def drift(subject: str, message: str, was: str, now: str, action: str = repin) -> None:
        out.append(Finding("drift", pin, subject, message, action, was, now, targets))

    if m.revision != w.revision:
        drift(f"revision {short(w.revision)}", f"revision {short(w.revision)} now resolves to {short(m.revision)}",
              w.revision, m.revision)
    pinned = {f.path: f for f in w.files}
    missing = sorted(set(pinned) - set(m.tree))
    extra = sorted(set(m.tree) - set(pinned))
    where = ", ".join(d + "/" if d else "/" for d in m.dirs)
    set_action = repin.replace("--revision <sha>`", "--revision <sha> --accept-file-set`")
    if missing and extra:
        drift(f"file set under {where}", f"the file set changed: {len(pinned)} file(s) pinned, {len(m.tree)} "
              f"on the Hub ({len(missing)} missing, {len(extra)} extra): re-split or renamed shards",
              str(len(pinned)), str(len(m.tree)), set_action)
    for p in missing:
        f = pinned[p]
        drift(p, f"pinned file is missing from {where} at {short(m.revision)}", f"{f.size} B sha256 {f.sha256}",
              "(missing)", set_action)
    for p in extra:
        t = m.tree[p]
        drift(p, f"extra file in {where} at {short(m.revision)} (an added or re-split shard)", "(not pinned)",
              f"{t.size} B sha256 {t.sha256 or '(no LFS)'}", set_action)
    for p in sorted(set(pinned) & set(m.tree)):
        f, r = pinned[p], m.info.get(p)
        if r is None:
            drift(p, "the tree lists this file but paths-info does not return it (the Hub dropped the path)",
                  f.sha256, "(missing from paths-info)")
            continue
        if r.size != f.size:
            drift(f"{p} size", f"size changed from {f.size} to {r.size} bytes", str(f.size), str(r.size))
        if r.sha256 is None:
            drift(f"{p} sha256", "the Hub reports no LFS sha256 for this file", f.sha256, "(no LFS metadata)")
        elif r.sha256 != f.sha256:
            drift(f"{p} sha256", f"sha256 changed from {short(f.sha256)} to {short(r.sha256)}: a re-uploaded shard",
                  f.sha256, r.sha256)
    if not out:
        total = sum(f.size for f in w.files)
        out.append(Finding("ok", pin, f"{w.repo}@{short(w.revision)} {where}",
                           f"{len(pinned)} file(s) ({human_bytes(total)}): file set, sizes and LFS sha256 match the pins",
                           "", w.revision, m.revision, targets))
    return out


# ------------------------------------------------------------------------------------------------
# pinning (`scoreboard pin weights`)

@dataclass(frozen=True)
class WeightsPinPlan:
    """What `pin weights` would write: the new revision and files, and each change as (what, old, new)."""

    weights_id: str
    repo: str
    revision: str
    files: tuple[RemoteFile, ...]
    changes: tuple[tuple[str, str, str], ...] = field(default=())
    only_in_lock: tuple[str, ...] = ()
    only_on_hub: tuple[str, ...] = ()


def resolve_weights_id(lock: Lock, name: str) -> tuple[str, tuple[str, ...]]:
    """A target id (or a weights id) -> (weights id, targets using it)."""
    if name in lock.targets:
        wid = lock.targets[name].weights
    elif name in lock.weights:
        wid = name
    else:
        lock.target(name)  # raises InputError with did-you-mean
        raise AssertionError("unreachable")
    return wid, tuple(t for t, tt in lock.targets.items() if tt.weights == wid)


def plan_weights_pin(lock: Lock, name: str, revision: str, *, accept_file_set: bool = False,
                     endpoint: str | None = None, timeout: float = 30.0) -> WeightsPinPlan:
    """Read the Hub's metadata at `revision` and compute the new `[weights.<id>]` pin; raise if it can't."""
    wid, _ = resolve_weights_id(lock, name)
    w = lock.weights[wid]
    if w.repo == "generated":
        raise InputError(f"weights.{wid} is generated locally, not a Hub pin",
                         "generated weights are pinned by hand from `scoreboard weights generate SPEC --out DIR` (its sha256 "
                         "column); `scoreboard weights verify --target T` then re-checks them")
    if not _SHA1.match(revision):
        raise InputError(f"--revision must be a full 40-hex Hub commit, got {revision!r}",
                         f"look it up on the Hub (https://huggingface.co/{w.repo}/commits/main) and pass the full SHA")
    try:
        m = read_manifest(w.repo, revision, quant_dirs(w), None, root_suffixes=root_suffixes(w), endpoint=endpoint,
                          timeout=timeout)
    except HubGone as exc:
        raise InputError(str(exc), f"check the revision on https://huggingface.co/{w.repo}/commits/main") from exc
    except HubUnavailable as exc:
        raise ScoreboardError(f"could not read the Hub's metadata: {exc}", "re-run the command; the lock is "
                              "untouched") from exc
    if m.revision != revision:
        raise PinError(f"the Hub resolved {revision} to {m.revision}", "pass the commit the Hub reports")
    declared = {f.path for f in w.files}
    only_lock, only_hub = sorted(declared - set(m.tree)), sorted(set(m.tree) - declared)
    if (only_lock or only_hub) and not accept_file_set:
        diff = "".join(f"\n  - {p} (in the lock, not on the Hub)" for p in only_lock)
        diff += "".join(f"\n  + {p} (on the Hub, not in the lock)" for p in only_hub)
        raise PinError(f"weights.{wid}: the Hub's file set under {', '.join(m.dirs) or '/'} at {short(revision)} "
                       f"differs from the lock's declared paths:{diff}",
                       "review the difference; to take the Hub's set, re-run with --accept-file-set")
    files = []
    for p in sorted(m.tree):
        r = m.info.get(p)
        if r is None or r.sha256 is None:
            why = "paths-info did not return it" if r is None else "it has no LFS sha256"
            raise PinError(f"cannot pin {p}: {why}", "only LFS files can be pinned without downloading them")
        files.append(r)
    return WeightsPinPlan(wid, w.repo, revision, tuple(files), _changes(w, revision, files),
                          tuple(only_lock), tuple(only_hub))


def _changes(w: Weights, revision: str, files: list[RemoteFile]) -> tuple[tuple[str, str, str], ...]:
    out = [("revision", w.revision or '""', revision)] if w.revision != revision else []
    old = {f.path: f for f in w.files}
    for r in files:
        f = old.get(r.path)
        if f is None:
            out.append((r.path, "(absent)", f"{r.size} B sha256 {r.sha256}"))
            continue
        if f.size != r.size:
            out.append((f"{r.path} size", str(f.size), str(r.size)))
        if f.sha256 != r.sha256:
            out.append((f"{r.path} sha256", f.sha256 or '""', str(r.sha256)))
    new = {r.path for r in files}
    out += [(p, f"{old[p].size} B", "(removed)") for p in sorted(set(old) - new)]
    return tuple(out)


def apply_weights_pin(lock_path: str | os.PathLike[str], plan: WeightsPinPlan) -> Lock:
    """Rewrite `[weights.<id>]` revision and files in place (comments kept, atomic, validated); slots untouched."""
    import tomlkit

    def edit(doc: Any) -> None:
        table = doc["weights"][plan.weights_id]
        table["revision"] = plan.revision
        files = table["files"]
        by_path = {r.path: r for r in plan.files}
        if sorted(str(item["path"]) for item in files) == sorted(by_path):
            for item in files:  # same set: edit each inline table in place, keeping layout and comments
                r = by_path[str(item["path"])]
                item["size"] = r.size
                item["sha256"] = r.sha256
            return
        arr = tomlkit.array()
        arr.multiline(True)
        for r in plan.files:
            t = tomlkit.inline_table()
            t.update({"path": r.path, "size": r.size, "sha256": r.sha256})
            arr.append(t)
        table["files"] = arr

    return update_lock(Path(lock_path), edit)
