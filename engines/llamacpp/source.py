"""Pinned llama.cpp source: a git ref (asserted to resolve to the pinned commit) or a PyPI sdist (sha256-checked).

Everything fails loudly: a force-pushed ref, a deleted ref, a base commit that is no longer an ancestor, a
different sdist on the index. Network failures are :class:`TransientError` (never reported as drift).

Cache layout (under the engine's cache dir)::

    downloads/pypi/<package>/<version>/<file>.tar.gz   verified sdists, re-hashed before every use
    downloads/rejected/                                 cached files whose hash no longer matched
    llamacpp/git/<sha256(repo url)[:16]>.git            bare mirror; pinned commits kept under refs/scoreboard/pins/
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import git

from scoreboard.errors import EngineError, InputError, PinError, TransientError
from scoreboard.lockfile import GitReference, SdistReference

Progress = Callable[[str, "float | None"], None]
PIP_ARGS_ENV = "SCOREBOARD_PIP_ARGS"  # extra pip arguments, e.g. "--no-index --find-links DIR" (tests, mirrors)
_HASH_CHUNK = 1 << 20


@dataclass(frozen=True)
class SourceInfo:
    """What was materialized: the pin's identity, the LLAMA_BUILD_COMMIT stamp, and how it was checked."""

    identity: dict[str, str]
    build_commit: str
    detail: dict[str, Any] = field(default_factory=dict)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def build_stamp(reference: GitReference | SdistReference) -> str:
    """The LLAMA_BUILD_COMMIT a build of this pin carries (llama-bench echoes it as `build_commit`)."""
    if isinstance(reference, GitReference):
        return reference.commit
    return f"{reference.package}-{reference.version}-{reference.sha256[:12]}"


def _say(progress: Progress | None, msg: str, frac: float | None = None) -> None:
    if progress is not None:
        progress(msg, frac)


def _repin_hint(ref_id: str, field_name: str) -> str:
    return (f"re-pin deliberately after review: update references.{ref_id}.{field_name} in reference.lock "
            f"and re-measure (`scoreboard audit-pins` shows every drifted pin)")


# ----------------------------------------------------------------------------------------------
# git

def _mirror_path(cache_dir: Path, repo_url: str) -> Path:
    return cache_dir / "llamacpp" / "git" / (hashlib.sha256(repo_url.encode()).hexdigest()[:16] + ".git")


def _git_failure(exc: git.GitCommandError, what: str, url: str, ref_id: str) -> Exception:
    text = f"{exc.stderr or ''}{exc.stdout or ''}".strip()
    gone = r"does not appear to be a git repository|repository .* not found|Repository not found"
    if re.search(gone, text, re.IGNORECASE):
        return PinError(f"references.{ref_id}: repository {url} no longer exists ({what}): {text}",
                        _repin_hint(ref_id, "repo"))
    return TransientError(f"references.{ref_id}: could not reach {url} ({what}): {text or exc}",
                          "check the network and retry; a network failure is never reported as drift")


LS_REMOTE_TIMEOUT_S = 120.0


def ls_remote(url: str, ref: str, ref_id: str = "<id>") -> str | None:
    """The SHA `ref` points at on `url`, or None when the ref does not exist there (the same resolution
    the pin audit uses: scoreboard.pins.git.ls_remote)."""
    from scoreboard.pins.git import GitUnavailable
    from scoreboard.pins.git import ls_remote as resolve

    try:
        return resolve(url, ref, LS_REMOTE_TIMEOUT_S)
    except GitUnavailable as exc:
        cause = exc.__cause__
        if isinstance(cause, git.GitCommandError):  # a deleted repository is a pin problem, not the network
            raise _git_failure(cause, f"git ls-remote {ref}", url, ref_id) from None
        raise TransientError(f"references.{ref_id}: could not reach {url}: {exc}",
                             "check the network and retry; a network failure is never reported as drift") from None


def _has_commit(repo: git.Repo, sha: str) -> bool:
    try:
        repo.git.cat_file("-e", f"{sha}^{{commit}}")
        return True
    except git.GitCommandError:
        return False


def check_git_pin(reference: GitReference, cache_dir: Path, ref_id: str = "<id>",
                  progress: Progress | None = None) -> git.Repo:
    """Assert the pinned ref still resolves to the pinned commit and the base is an ancestor; return the mirror.

    The ref is resolved with ls-remote (a PR head on a fork cannot be fetched by SHA), fetched only when the
    mirror lacks the commit, and the fetched SHA is checked again (a push between the two calls).
    """
    url, ref, pinned = reference.repo, reference.ref, reference.commit
    _say(progress, f"resolving {ref} at {url}")
    remote_sha = ls_remote(url, ref, ref_id)
    if remote_sha is None:
        raise PinError(f"references.{ref_id}: ref {ref} no longer exists at {url} (deleted or renamed); "
                       f"pinned commit {pinned}", _repin_hint(ref_id, "ref"))
    if remote_sha != pinned:
        raise PinError(f"references.{ref_id}: {ref} at {url} was force-pushed or moved: pinned (old) {pinned}, "
                       f"now (new) {remote_sha}", _repin_hint(ref_id, "commit"))
    mirror_dir = _mirror_path(cache_dir, url)
    mirror_dir.parent.mkdir(parents=True, exist_ok=True)
    mirror = git.Repo(mirror_dir) if mirror_dir.exists() else git.Repo.init(mirror_dir, bare=True)
    if not _has_commit(mirror, pinned):
        _say(progress, f"fetching {ref} from {url}")
        try:
            mirror.git.fetch(url, f"+{ref}:refs/scoreboard/fetched")
        except git.GitCommandError as exc:
            text = f"{exc.stderr or ''}"
            if "couldn't find remote ref" in text:
                raise PinError(f"references.{ref_id}: ref {ref} no longer exists at {url}", _repin_hint(ref_id, "ref"))
            raise _git_failure(exc, f"git fetch {ref}", url, ref_id) from None
        fetched = mirror.git.rev_parse("refs/scoreboard/fetched")
        if fetched != pinned:
            raise PinError(f"references.{ref_id}: {ref} at {url} was force-pushed or moved: pinned (old) {pinned}, "
                           f"fetched (new) {fetched}", _repin_hint(ref_id, "commit"))
        mirror.git.update_ref(f"refs/scoreboard/pins/{pinned}", pinned)
    base = reference.base_commit
    if not _has_commit(mirror, base) or not mirror.is_ancestor(base, pinned):
        raise PinError(f"references.{ref_id}: base_commit {base} is not an ancestor of {pinned} ({ref} at {url})",
                       _repin_hint(ref_id, "base_commit"))
    return mirror


def checkout_git(reference: GitReference, cache_dir: Path, dest: Path, ref_id: str = "<id>",
                 progress: Progress | None = None) -> SourceInfo:
    """Check the pin, then check the pinned commit out into the new, clean directory `dest`."""
    mirror = check_git_pin(reference, cache_dir, ref_id, progress)
    if dest.exists():
        raise EngineError(f"{dest}: checkout destination already exists", "remove it and retry")
    _say(progress, f"checking out {reference.commit[:12]}")
    work = git.Repo.init(dest)
    alternates = Path(work.git_dir) / "objects" / "info" / "alternates"
    alternates.write_text(str(Path(mirror.git_dir) / "objects") + "\n", encoding="utf-8")
    work.git.checkout("--detach", "--force", reference.commit)
    head = work.head.commit.hexsha
    if head != reference.commit or work.is_dirty(untracked_files=True):
        raise EngineError(f"{dest}: checkout of {reference.commit} is not clean (HEAD {head})",
                          "delete the cache directory named above and retry")
    tree = _verify_checkout(work, Path(mirror.git_dir), reference.commit, ref_id)
    return SourceInfo(identity=reference.identity(), build_commit=build_stamp(reference),
                      detail={"resolved_commit": head, "tree": tree, "mirror": str(mirror.git_dir)})


def _verify_checkout(work: git.Repo, mirror_dir: Path, commit: str, ref_id: str) -> str:
    """Re-hash what was checked out: the commit object must hash to `commit` and the files to its tree.

    Git does not re-hash objects it reads, so a tampered object in the persisted mirror would otherwise
    check out silently. Returns the verified tree id.
    """
    raw = subprocess.run(["git", f"--git-dir={mirror_dir}", "cat-file", "commit", commit], capture_output=True,
                         check=False).stdout
    if hashlib.sha1(b"commit %d\x00" % len(raw) + raw).hexdigest() != commit:
        raise PinError(f"references.{ref_id}: the cached mirror {mirror_dir} holds a corrupt commit object {commit}",
                       f"delete {mirror_dir} and run prepare again (it is fetched anew)")
    tree = raw.split(b"\n", 1)[0].split()[1].decode()
    work.git.rm("-r", "-q", "--cached", ".")
    work.git.add("-A", "-f")  # hash every checked-out file's content again (ignored ones too)
    actual = work.git.write_tree()
    if actual != tree:
        raise PinError(f"references.{ref_id}: the files checked out for {commit} hash to tree {actual}, not its "
                       f"tree {tree}: the cached mirror {mirror_dir} is corrupt or tampered with",
                       f"delete {mirror_dir} and run prepare again (it is fetched anew)")
    return tree


# ----------------------------------------------------------------------------------------------
# PyPI sdist

def _pip_args(pip_args: list[str] | None) -> list[str]:
    if pip_args is not None:
        return list(pip_args)
    return shlex.split(os.environ.get(PIP_ARGS_ENV, ""))


def _download_dir(cache_dir: Path, ref: SdistReference) -> Path:
    return cache_dir / "downloads" / "pypi" / ref.package / ref.version


def _reject(path: Path, cache_dir: Path, actual: str) -> Path:
    """Move a cached file whose hash no longer matches aside (kept for inspection, never deleted)."""
    rejected = cache_dir / "downloads" / "rejected"
    rejected.mkdir(parents=True, exist_ok=True)
    target = rejected / f"{path.name}.{actual[:16]}"
    os.replace(path, target)
    return target


def _pip_download(ref: SdistReference, out_dir: Path, pip_args: list[str], ref_id: str) -> Path:
    req = out_dir / "requirements.txt"
    req.write_text(f"{ref.package}=={ref.version} --hash=sha256:{ref.sha256}\n", encoding="utf-8")
    dl = out_dir / "dl"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--require-hashes",
           "--disable-pip-version-check", "-d", str(dl), "-r", str(req), *pip_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    out = proc.stdout + proc.stderr
    (out_dir / "pip.log").write_text(" ".join(shlex.quote(c) for c in cmd) + "\n" + out, encoding="utf-8")
    if proc.returncode != 0:
        got = re.search(r"Got\s+([0-9a-f]{64})", out)
        if got or "DO NOT MATCH THE HASHES" in out:
            actual = got.group(1) if got else "unknown"
            raise PinError(f"references.{ref_id}: {ref.package}=={ref.version} sdist sha256 mismatch: pinned "
                           f"{ref.sha256}, index serves {actual}; nothing was extracted", _repin_hint(ref_id, "sha256"))
        if "No matching distribution" in out or "Could not find a version" in out:
            raise PinError(f"references.{ref_id}: {ref.package}=={ref.version} has no sdist on the index: "
                           f"{_tail(out, 5)}", _repin_hint(ref_id, "version"))
        raise TransientError(f"references.{ref_id}: pip download of {ref.package}=={ref.version} failed "
                             f"(exit {proc.returncode}):\n{_tail(out, 15)}",
                             "check that the package index is reachable and retry")
    files = [p for p in dl.iterdir() if p.is_file()] if dl.exists() else []
    if len(files) != 1:
        raise EngineError(f"pip download of {ref.package}=={ref.version} produced {len(files)} files in {dl}",
                          "expected exactly one sdist; check SCOREBOARD_PIP_ARGS")
    return files[0]


def _tail(text: str, n: int) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


def fetch_sdist(ref: SdistReference, cache_dir: Path, ref_id: str = "<id>", pip_args: list[str] | None = None,
                progress: Progress | None = None) -> Path:
    """The pinned sdist, from the download cache (re-hashed) or downloaded with pip and verified before use."""
    dest_dir = _download_dir(cache_dir, ref)
    cached = sorted(p for p in dest_dir.glob("*") if p.is_file()) if dest_dir.exists() else []
    for path in cached:
        _say(progress, f"verifying sha256 of {path.name}")
        actual = sha256_file(path)
        if actual == ref.sha256:
            return path
        moved = _reject(path, cache_dir, actual)
        _say(progress, f"cached {path.name} has sha256 {actual[:16]}..., not the pin; moved to {moved}")
    _say(progress, f"downloading {ref.package}=={ref.version} with pip")
    (cache_dir / "downloads").mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".pip-", dir=cache_dir / "downloads"))
    try:
        got = _pip_download(ref, tmp, _pip_args(pip_args), ref_id)
        actual = sha256_file(got)
        if actual != ref.sha256:  # pip checked too; this is the harness's own check
            raise PinError(f"references.{ref_id}: {ref.package}=={ref.version} sdist sha256 mismatch: pinned "
                           f"{ref.sha256}, downloaded {actual}; nothing was extracted", _repin_hint(ref_id, "sha256"))
        dest_dir.mkdir(parents=True, exist_ok=True)
        final = dest_dir / got.name
        os.replace(got, final)
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _sdist_members(tf: tarfile.TarFile, subdir: str, tarball: Path) -> list[tarfile.TarInfo]:
    """Members under `<top>/<subdir>/`, renamed relative to the subdir."""
    members = tf.getmembers()
    tops = {m.name.split("/", 1)[0] for m in members}
    if len(tops) != 1:
        raise InputError(f"{tarball}: expected one top-level directory, found {sorted(tops)[:5]}",
                         "the pinned file is not a standard sdist")
    prefix = f"{tops.pop()}/{subdir.strip('/')}/"
    out = []
    for m in members:
        if m.name.startswith(prefix) and len(m.name) > len(prefix):
            out.append(m.replace(name=m.name[len(prefix):], deep=False))
    if not out:
        raise InputError(f"{tarball}: subdir {subdir!r} not found in the sdist",
                         "check `subdir` of the reference in reference.lock")
    return out


def extract_sdist(ref: SdistReference, tarball: Path, dest: Path, ref_id: str = "<id>") -> dict[str, Any]:
    """Re-hash `tarball`, then extract only `ref.subdir` into the new directory `dest`; drop a dangling `.git` file."""
    actual = sha256_file(tarball)
    if actual != ref.sha256:
        raise PinError(f"references.{ref_id}: {tarball} sha256 {actual} is not the pinned {ref.sha256}; "
                       f"nothing was extracted", "delete the file named above and run prepare again")
    if dest.exists():
        raise EngineError(f"{dest}: extraction destination already exists", "remove it and retry")
    with tarfile.open(tarball, "r:*") as tf:
        members = _sdist_members(tf, ref.subdir, tarball)
        dest.mkdir(parents=True)
        try:
            tf.extractall(dest, members=members, filter="data")
        except tarfile.FilterError as exc:  # absolute paths, `..`, links out of the tree, device files
            raise PinError(f"references.{ref_id}: {tarball} holds an unsafe member: {exc}",
                           "do not use this file; re-pin only after review") from None
    dropped = False
    dotgit = dest / ".git"
    if dotgit.is_file() or dotgit.is_symlink():  # a gitlink to a directory that is not in the sdist
        dotgit.unlink()
        dropped = True
    return {"sdist": str(tarball), "sdist_sha256": actual, "files": len(members), "dropped_dot_git": dropped}


# ----------------------------------------------------------------------------------------------
# entry points used by the builder

def materialize(reference: GitReference | SdistReference, cache_dir: Path, dest: Path, ref_id: str = "<id>",
                pip_args: list[str] | None = None, progress: Progress | None = None) -> SourceInfo:
    """Put a fresh, verified copy of the pinned source tree at `dest` (which must not exist)."""
    if isinstance(reference, GitReference):
        return checkout_git(reference, cache_dir, dest, ref_id, progress)
    if isinstance(reference, SdistReference):
        tarball = fetch_sdist(reference, cache_dir, ref_id, pip_args, progress)
        _say(progress, f"extracting {reference.subdir} from {tarball.name}")
        detail = extract_sdist(reference, tarball, dest, ref_id)
        return SourceInfo(identity=reference.identity(), build_commit=build_stamp(reference), detail=detail)
    raise InputError(f"references.{ref_id}: unsupported reference {type(reference).__name__}",
                     "use kind = 'git' or kind = 'pypi-sdist'")


def verify_pin(reference: GitReference | SdistReference, cache_dir: Path, ref_id: str = "<id>",
               progress: Progress | None = None) -> dict[str, Any]:
    """The cheap re-check a warm prepare does: a git ref must still resolve to its commit (network).

    An sdist pin is a content hash: a build made from it stays valid; its download is re-hashed at its next use.
    """
    if isinstance(reference, GitReference):
        check_git_pin(reference, cache_dir, ref_id, progress)
        return {"git_ref_checked": True}
    return {"git_ref_checked": False}
