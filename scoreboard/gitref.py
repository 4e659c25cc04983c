"""Resolve a git ref on a remote without cloning (`git ls-remote`), for the pin audit and for engines.

Engines reach this through ``scoreboard.engine`` (a lent helper): it imports only gitpython, so the plugin
contract loads it without loading the audit (``scoreboard.pins``).
"""

from __future__ import annotations

import git

# Never prompt for credentials (a deleted GitHub repo asks for a username); answers must be fast.
GIT_ENV = {"GIT_TERMINAL_PROMPT": "0", "GCM_INTERACTIVE": "never"}


class GitUnavailable(Exception):
    """The remote could not be asked (unreachable, timeout, auth): an error, never drift."""


def git_error(exc: git.GitCommandError) -> str:
    """The last line git wrote about a failed command (its stderr), else its exit status."""
    text = (exc.stderr or str(exc)).strip().replace("stderr: ", "").strip("'\" \n")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else f"git exited with status {exc.status}"


def _candidates(ref: str) -> list[str]:
    """Full ref names `ref` may denote, in git's own disambiguation order."""
    return [ref] if ref.startswith("refs/") else [f"refs/{ref}", f"refs/tags/{ref}", f"refs/heads/{ref}"]


def ls_remote(url: str, ref: str, timeout: float) -> str | None:
    """The commit `ref` resolves to on the remote, or None when the remote has no such ref."""
    try:
        # `ref^{}` too: an annotated tag is listed peeled only when the pattern asks for it
        out = git.cmd.Git().ls_remote(url, ref, ref + "^{}", kill_after_timeout=timeout, env=GIT_ENV)
    except git.GitCommandError as exc:
        raise GitUnavailable(f"`git ls-remote {url} {ref}` failed: {git_error(exc)}") from exc
    found: dict[str, str] = {}
    for line in str(out).splitlines():
        sha, _, name = line.partition("\t")
        if name.endswith("^{}"):
            found[name[:-3] + "^{}"] = sha  # peeled annotated tag: the commit it points at
        else:
            found[name] = sha
    for name in _candidates(ref):
        if name + "^{}" in found:
            return found[name + "^{}"]
        if name in found:
            return found[name]
    return None
