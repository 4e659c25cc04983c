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

from scoreboard.engine import GitReference, SdistReference, UnsafeMember, extract_tar
from scoreboard.errors import EngineError, InputError, PinError, TransientError

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
    from scoreboard.engine import GitUnavailable
    from scoreboard.engine import ls_remote as resolve

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
    # is_ancestor's stubs want Commit objects; git itself takes any rev
    if not _has_commit(mirror, base) or not mirror.is_ancestor(base, pinned):  # type: ignore[arg-type]
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
            extract_tar(tf, dest, members)
        except UnsafeMember as exc:  # absolute paths, `..`, links out of the tree, device files
            raise PinError(f"references.{ref_id}: {tarball} holds an unsafe member: {exc}",
                           "do not use this file; re-pin only after review") from None
    dropped = False
    dotgit = dest / ".git"
    if dotgit.is_file() or dotgit.is_symlink():  # a gitlink to a directory that is not in the sdist
        dotgit.unlink()
        dropped = True
    return {"sdist": str(tarball), "sdist_sha256": actual, "files": len(members), "dropped_dot_git": dropped}


# ----------------------------------------------------------------------------------------------
# the source tree's content hash: what every transport must deliver

SOURCE_ENV = "SCOREBOARD_REFERENCE_SOURCE"  # a transport for the round's reference source (see ReferenceSource)


def _git_env(git_dir: Path, index: Path | None = None) -> dict[str, str]:
    """Plumbing that reads no user or system configuration (no filters, no autocrlf, no hooks)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update({"GIT_DIR": str(git_dir), "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
                "GIT_AUTHOR_NAME": "scoreboard", "GIT_AUTHOR_EMAIL": "scoreboard@localhost",
                "GIT_COMMITTER_NAME": "scoreboard", "GIT_COMMITTER_EMAIL": "scoreboard@localhost",
                "GIT_AUTHOR_DATE": "1970-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "1970-01-01T00:00:00Z"})
    if index is not None:
        env["GIT_INDEX_FILE"] = str(index)
    return env


def _plumb(args: list[str], env: dict[str, str], data: bytes | None = None) -> bytes:
    proc = subprocess.run(["git", *args], input=data, env=env, capture_output=True, check=False)
    if proc.returncode != 0:
        raise EngineError(f"git {' '.join(args[:3])} failed (exit {proc.returncode}): "
                          f"{proc.stderr.decode(errors='replace').strip()[:500]}", "check that git >= 2.20 is installed")
    return proc.stdout


def _excluded(rel: str, exclude: tuple[str, ...]) -> bool:
    return any(rel == e or rel.startswith(e.rstrip("/") + "/") for e in exclude)


def tree_entries(root: Path, exclude: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(git mode, path relative to root) for every file and symlink under root, sorted; `.git` entries and the
    root-relative paths in `exclude` are left out. Refuses what a git tree cannot hold."""
    out: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        rel_dir = here.relative_to(root).as_posix()
        keep = []
        for d in sorted(dirnames):
            rel = d if rel_dir == "." else f"{rel_dir}/{d}"
            if d == ".git" or _excluded(rel, exclude):
                continue
            if (here / d).is_symlink():
                out.append(("120000", rel))
            else:
                keep.append(d)
        dirnames[:] = keep
        for f in filenames:
            rel = f if rel_dir == "." else f"{rel_dir}/{f}"
            if f == ".git" or _excluded(rel, exclude):
                continue
            if "\n" in rel:
                raise InputError(f"{root / rel}: a file name with a newline cannot be pinned", "remove the file")
            p = here / f
            if p.is_symlink():
                out.append(("120000", rel))
            elif p.is_file():
                out.append(("100755" if p.stat().st_mode & 0o100 else "100644", rel))
            else:
                raise InputError(f"{p}: neither a regular file nor a symlink; a source tree cannot hold it",
                                 "remove it from the tree")
    return sorted(out, key=lambda e: e[1])


def tree_hash(root: Path, exclude: tuple[str, ...] = (), git_dir: Path | None = None) -> str:
    """The git tree id of the files under `root` as they are on disk: raw bytes (no filters, no .gitattributes,
    no .gitignore: every file counts), exec bit and symlinks as git records them, `.git` entries and the
    root-relative `exclude` paths left out. Empty directories are not part of a git tree.

    Computed with plumbing over a temporary index (hash-object --no-filters, update-index --index-info,
    write-tree); with `git_dir` the objects are written into that repository (the carried form), else into a
    throwaway one.
    """
    root = Path(root)
    entries = tree_entries(root, exclude)
    with tempfile.TemporaryDirectory(prefix="sb-tree-") as tmp:
        gd = Path(git_dir) if git_dir is not None else Path(tmp) / "objects.git"
        if not (gd / "objects").is_dir():
            _plumb(["init", "-q", "--bare", str(gd)], {k: v for k, v in _git_env(gd).items() if k != "GIT_DIR"})
        env = _git_env(gd, Path(tmp) / "index")
        files = [rel for mode, rel in entries if mode != "120000"]
        shas = _plumb(["hash-object", "-w", "--no-filters", "--stdin-paths"], env,
                      "".join(str(root / r) + "\n" for r in files).encode()).decode().split()
        by_path = dict(zip(files, shas))
        for mode, rel in entries:
            if mode == "120000":
                by_path[rel] = _plumb(["hash-object", "-w", "--stdin"], env,
                                      os.fsencode(os.readlink(root / rel))).decode().strip()
        info = b"".join(f"{mode} {by_path[rel]}\t".encode() + rel.encode() + b"\0" for mode, rel in entries)
        if info:
            _plumb(["update-index", "--add", "-z", "--index-info"], env, info)
        return _plumb(["write-tree"], env).decode().strip()


def drop_excluded(dest: Path, exclude: tuple[str, ...]) -> list[str]:
    """Remove the pin's declared exclusions (root-relative paths that are not build inputs) from `dest`."""
    dropped = []
    for e in exclude:
        p = dest / e
        if p.is_symlink() or p.is_file():
            p.unlink()
        elif p.is_dir():
            shutil.rmtree(p)
        else:
            continue
        dropped.append(e)
    return dropped


# ----------------------------------------------------------------------------------------------
# transports: anything that delivers exactly the pinned tree

@dataclass(frozen=True)
class ReferenceSource:
    """Where the round takes the pinned source from (``--reference-source`` or $SCOREBOARD_REFERENCE_SOURCE).

    * ``pin`` (the default): the pin's own transport: pip (or the verified download cache) for an sdist, the
      pinned repository for a git reference;
    * ``git+<url>@<rev>`` (``git+file:///srv/llama.cpp.git@<commit>``, also ``git+/path@<rev>``): a git mirror;
    * a directory: a local copy of the source tree;
    * a ``.tar.gz`` file: the sdist itself from a local path (its sha256 is checked like a download's).

    Whatever the transport, the tree delivered is hashed before the build and must equal the pin's ``tree``.
    """

    kind: str  # "pin", "git", "dir", "sdist-file"
    location: str = ""
    rev: str = ""

    @classmethod
    def parse(cls, spec: str | None) -> "ReferenceSource":
        spec = (spec if spec is not None else os.environ.get(SOURCE_ENV, "")).strip()
        if spec in ("", "pin", "pypi"):
            return cls("pin")
        if spec.startswith("git+"):
            url, at, rev = spec[4:].rpartition("@")
            if not at or not url:
                url, rev = spec[4:], ""
            return cls("git", url, rev)
        path = Path(spec).expanduser()
        if path.is_dir():
            return cls("dir", str(path.resolve()))
        if path.is_file() and path.name.endswith((".tar.gz", ".tgz")):
            return cls("sdist-file", str(path.resolve()))
        raise InputError(f"reference source {spec!r}: not 'pin', git+<url>@<rev>, a directory or a .tar.gz file",
                         f"pass --reference-source (or ${SOURCE_ENV}) as one of those")

    def describe(self) -> str:
        if self.kind == "pin":
            return "pin"
        if self.kind == "git":
            return f"git+{self.location}" + (f"@{self.rev}" if self.rev else "")
        return self.location


def _tree_pin_problem(reference: GitReference | SdistReference, ref_id: str, actual: str, how: str) -> None:
    if reference.tree and actual != reference.tree:
        raise PinError(f"references.{ref_id}: the source delivered by {how} hashes to tree {actual}, but the pin is "
                       f"tree {reference.tree} (excluding {list(reference.tree_exclude) or 'nothing'}); nothing was "
                       "built", "deliver exactly the pinned source (see docs/reference-pin.md), or re-pin "
                       f"references.{ref_id}.tree deliberately after review")


def _extract_git(url: str, rev: str, dest: Path, ref_id: str) -> str:
    """Fetch `rev` from `url` into a throwaway bare repo and write its files into `dest` (no checkout filters:
    blobs are written byte for byte from the objects); return the commit."""
    with tempfile.TemporaryDirectory(prefix="sb-srcgit-") as tmp:
        gd = Path(tmp) / "g.git"
        _plumb(["init", "-q", "--bare", str(gd)], {k: v for k, v in _git_env(gd).items() if k != "GIT_DIR"})
        env = _git_env(gd)
        want = rev or "HEAD"
        proc = subprocess.run(["git", "fetch", "-q", "--no-tags", url, f"+{want}:refs/scoreboard/src"], env=env,
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0 and len(want) == 40:  # a bare SHA: fetch everything, then look it up
            proc = subprocess.run(["git", "fetch", "-q", "--no-tags", url, "+refs/*:refs/remotes/src/*"], env=env,
                                  capture_output=True, text=True, check=False)
            if proc.returncode == 0:
                _plumb(["update-ref", "refs/scoreboard/src", want], env)
        if proc.returncode != 0:
            raise TransientError(f"references.{ref_id}: could not fetch {want} from {url}: {proc.stderr.strip()[:400]}",
                                 "check the mirror's URL/path and revision (git+<url>@<rev>)")
        commit = _plumb(["rev-parse", "refs/scoreboard/src^{commit}"], env).decode().strip()
        listing = _plumb(["ls-tree", "-r", "-z", "--full-tree", commit], env).split(b"\0")
        dest.mkdir(parents=True)
        entries = []
        for item in filter(None, listing):
            meta, path = item.split(b"\t", 1)
            mode, kind, sha = meta.decode().split()
            if kind != "blob":
                raise PinError(f"references.{ref_id}: {url}@{want} holds a {kind} at {path.decode()} (a submodule?)",
                               "carry the source as one plain tree (docs/reference-pin.md)")
            entries.append((mode, os.fsdecode(path), sha))
        blobs = _plumb(["cat-file", "--batch"], env, "".join(f"{sha}\n" for _m, _p, sha in entries).encode())
        off = 0
        for mode, rel, sha in entries:
            head_end = blobs.index(b"\n", off)
            size = int(blobs[off:head_end].split()[2])
            data = blobs[head_end + 1: head_end + 1 + size]
            off = head_end + 1 + size + 1
            target = dest / rel
            if ".." in Path(rel).parts or Path(rel).is_absolute():
                raise PinError(f"references.{ref_id}: unsafe path {rel!r} in {url}@{want}", "do not use this mirror")
            target.parent.mkdir(parents=True, exist_ok=True)
            if mode == "120000":
                os.symlink(os.fsdecode(data), target)
            else:
                target.write_bytes(data)
                if mode == "100755":
                    target.chmod(0o755)
        return commit


def _copy_dir(src: Path, dest: Path) -> None:
    shutil.copytree(src, dest, symlinks=True, ignore=shutil.ignore_patterns(".git"))


def materialize(reference: GitReference | SdistReference, cache_dir: Path, dest: Path, ref_id: str = "<id>",
                pip_args: list[str] | None = None, progress: Progress | None = None,
                source: ReferenceSource | str | None = None) -> SourceInfo:
    """Put a fresh, verified copy of the pinned source tree at `dest` (which must not exist).

    `source` is the transport (ReferenceSource or its spec; default $SCOREBOARD_REFERENCE_SOURCE, else the pin's
    own). Whatever delivered it, the pin's declared exclusions are removed and the tree is hashed: it must be the
    pin's ``tree`` (a pin without a tree can only be delivered by its own transport, verified by sha256/commit).
    """
    src = source if isinstance(source, ReferenceSource) else ReferenceSource.parse(source)
    if dest.exists():
        raise EngineError(f"{dest}: source destination already exists", "remove it and retry")
    own = src.kind == "pin" or (isinstance(reference, GitReference) and src.kind == "git") or (
        isinstance(reference, SdistReference) and src.kind == "sdist-file")  # verified by commit / sha256
    if not own and not reference.tree:
        raise PinError(f"references.{ref_id}: the reference source {src.describe()!r} can only be verified by a tree "
                       f"pin, and references.{ref_id}.tree is empty", "use the pin's own transport, or pin the tree "
                       "after review (docs/reference-pin.md says how to compute it)")
    if isinstance(reference, GitReference):
        if src.kind == "pin":
            info = checkout_git(reference, cache_dir, dest, ref_id, progress)
            detail = dict(info.detail)
        elif src.kind == "git":
            _say(progress, f"fetching {reference.commit[:12]} from {src.location}")
            commit = _extract_git(src.location, src.rev or reference.commit, dest, ref_id)
            if not reference.tree and commit != reference.commit:
                raise PinError(f"references.{ref_id}: {src.describe()} delivered commit {commit}, the pin is "
                               f"{reference.commit} (and the tree is not pinned)", "fetch the pinned commit")
            detail = {"resolved_commit": commit}
        else:
            _copy_dir(Path(src.location), dest) if src.kind == "dir" else _unsupported(src, ref_id)
            detail = {}
    elif isinstance(reference, SdistReference):
        if src.kind in ("pin", "sdist-file"):
            if src.kind == "pin":
                tarball = fetch_sdist(reference, cache_dir, ref_id, pip_args, progress)
            else:
                tarball = Path(src.location)
            _say(progress, f"extracting {reference.subdir} from {tarball.name}")
            detail = extract_sdist(reference, tarball, dest, ref_id)  # sha256-checked: the transport is the sdist
        elif src.kind == "git":
            _say(progress, f"fetching {src.rev or 'HEAD'} from {src.location}")
            detail = {"resolved_commit": _extract_git(src.location, src.rev, dest, ref_id)}
        else:
            _copy_dir(Path(src.location), dest)
            detail = {}
    else:
        raise InputError(f"references.{ref_id}: unsupported reference {type(reference).__name__}",
                         "use kind = 'git' or kind = 'pypi-sdist'")
    dropped = drop_excluded(dest, tuple(reference.tree_exclude))
    _say(progress, f"hashing the source tree delivered by {src.describe()}")
    actual = tree_hash(dest, tuple(reference.tree_exclude))
    _tree_pin_problem(reference, ref_id, actual, src.describe())
    detail.update({"transport": src.describe(), "source_tree": actual, "tree_exclude": list(reference.tree_exclude),
                   "excluded_present": dropped})
    return SourceInfo(identity=reference.identity(), build_commit=build_stamp(reference), detail=detail)


def _unsupported(src: ReferenceSource, ref_id: str) -> None:
    raise InputError(f"references.{ref_id}: a git reference cannot be delivered as {src.kind} {src.location!r}",
                     "use the pin, a git mirror (git+<url>@<commit>) or a directory with a pinned tree")


def pack_git(reference: GitReference | SdistReference, cache_dir: Path, out: Path, ref_id: str = "<id>",
             pip_args: list[str] | None = None, progress: Progress | None = None,
             source: ReferenceSource | str | None = None) -> tuple[str, str]:
    """The carried form: a bare git repository at `out` holding one commit whose tree is exactly the pinned tree
    (the exclusions left out). Returns (commit, tree); deliver it with ``git+file://<out>@<commit>``."""
    with tempfile.TemporaryDirectory(prefix="sb-pack-") as tmp:
        info = materialize(reference, cache_dir, Path(tmp) / "src", ref_id, pip_args, progress, source)
        out = Path(out)
        if out.exists():
            raise InputError(f"{out}: already exists", "pass a new path for the bare repository")
        tree = tree_hash(Path(tmp) / "src", tuple(reference.tree_exclude), git_dir=out)
        env = _git_env(out)
        msg = (f"{ref_id}: pinned reference source tree {tree}\n\nexcluding {list(reference.tree_exclude)}; "
               f"delivered by {info.detail['transport']}\n")
        commit = _plumb(["commit-tree", tree], env, msg.encode()).decode().strip()
        _plumb(["update-ref", "refs/heads/main", commit], env)
        _plumb(["symbolic-ref", "HEAD", "refs/heads/main"], env)
        _plumb(["gc", "-q", "--aggressive", "--prune=now"], env)
        return commit, tree


def verify_pin(reference: GitReference | SdistReference, cache_dir: Path, ref_id: str = "<id>",
               progress: Progress | None = None) -> dict[str, Any]:
    """The cheap re-check a warm prepare does: a git ref must still resolve to its commit (network).

    An sdist pin is a content hash: a build made from it stays valid; its download is re-hashed at its next use.
    """
    if isinstance(reference, GitReference):
        check_git_pin(reference, cache_dir, ref_id, progress)
        return {"git_ref_checked": True}
    return {"git_ref_checked": False}
