"""Resolve `--candidate main|<git rev>|<path>` to the tree whose `engines/` an arm's workers import.

Every git arm (main, a PR's rev, the main arm of a PR round) runs from a clean export of its commit
(`git archive`), made into the round's private scratch root and re-verified against the commit's tree
hash before each use; no checkout is ever on a worker's import path. "main" is the checkout's HEAD and
must be on the lock's main branch. A path is a development tree: never main, never a frontier.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError

HARNESS_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class CandidateSource:
    label: str  # "main", a git rev as given, or a path
    root: Path  # tree holding engines/ (a git arm: its export; a path: that tree)
    commit: str
    dirty: bool
    is_main: bool
    kind: str = "git"  # "git": a clean export of `commit`; "path": a development tree
    engines_tree: str = ""  # git tree hash of engines/ at `commit` (what the export must hash to)

    def as_dict(self) -> dict:
        return {"label": self.label, "root": str(self.root), "commit": self.commit, "dirty": self.dirty,
                "is_main": self.is_main, "kind": self.kind, "engines_tree": self.engines_tree}


def _git(args: list[str], cwd: Path, binary: bool = False):
    out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=not binary)
    if out.returncode != 0:
        err = out.stderr.decode(errors="replace") if binary else out.stderr
        raise InputError(f"git {' '.join(args)} failed in {cwd}: {err.strip()}")
    return out.stdout if binary else out.stdout.strip()


# What a candidate *runs*: its engines and the packaging that registers them (all an export holds).
CANDIDATE_CODE = ("engines", "pyproject.toml")
# The harness's own records in the checkout: every sealed round writes them (slots of the lock, receipts
# and the ledger), so they never make a tree dirty. Everything else, untracked files included (an
# untracked sitecustomize.py at the root runs in any Python started there), does.
HARNESS_RECORDS = ("rounds", "reference.lock")


def require_engine(source: CandidateSource, engine: str) -> None:
    """A development tree (`--candidate PATH`) must hold the module the engine's entry point names (an empty or
    unrelated engines/ is a mistyped path: refused before any receipt exists). A git arm's engines/ is that
    commit's code: what it holds or lacks is the candidate's, recorded by the round."""
    from .. import registry

    if source.kind != "path":
        return
    try:
        module = registry.entry_point(engine).partition(":")[0]
    except InputError:
        return  # an engine injected as a factory (tests): no module to look for; the round reports it
    rel = Path(*module.split("."))
    if (source.root / rel).with_suffix(".py").is_file() or (source.root / rel / "__init__.py").is_file():
        return
    raise InputError(f"--candidate {source.label}: {source.root / 'engines'} holds no {engine} engine (its entry "
                     f"point {module} is neither {rel}.py nor {rel}/__init__.py there)",
                     "point --candidate at a checkout of this repository (its engines/ holds the engine), or at "
                     "main or a commit: --candidate main")


def dirty_paths(root: Path) -> list[str]:
    """Uncommitted changes under `root`: modified, staged, deleted and untracked non-ignored files,
    except the harness's own records (HARNESS_RECORDS)."""
    top = Path(_git(["rev-parse", "--show-toplevel"], root))
    spec = ["--", "."] + [f":(exclude){p}" for p in HARNESS_RECORDS]
    out = _git(["status", "--porcelain", "-z", "--untracked-files=all", *spec], top, binary=True)
    return [e[3:].decode(errors="replace") for e in out.split(b"\0") if len(e) > 3]


def _dirty(root: Path) -> bool:
    return bool(dirty_paths(root))


def branch_ref(branch: str, repo: Path) -> str:
    """refs/heads/<branch>, which must exist in `repo`."""
    ref = f"refs/heads/{branch}"
    if subprocess.run(["git", "rev-parse", "--verify", "--quiet", ref], cwd=repo, capture_output=True).returncode:
        raise InputError(f"the lock's main_branch {branch!r}: {repo} has no {ref}",
                         f"fetch the branch (git fetch origin {branch}:{branch}) or fix main_branch in the lock")
    return ref


def on_branch(commit: str, branch: str, repo: Path) -> bool:
    """Whether `commit` is reachable from refs/heads/<branch> (is on the branch)."""
    ref = branch_ref(branch, repo)
    return subprocess.run(["git", "merge-base", "--is-ancestor", commit, ref], cwd=repo,
                          capture_output=True).returncode == 0


def resolve(spec: str, scratch: Path, repo: Path = HARNESS_ROOT, main_branch: str = "main") -> CandidateSource:
    """main = the checkout's HEAD, which must be on refs/heads/<main_branch>; a path = that tree (development
    only); else a git rev of `repo`. Git arms are exported into `scratch` (the round's private root)."""
    if spec == "main":
        try:
            commit = _git(["rev-parse", "--verify", "HEAD^{commit}"], repo)
        except InputError as exc:
            raise InputError(f"--candidate main: {repo} is not a git checkout with a commit ({exc.message})",
                             "run main rounds from a clone of the repository") from None
        if not on_branch(commit, main_branch, repo):
            raise InputError(f"--candidate main: HEAD {commit[:12]} of {repo} is not on the main branch "
                             f"refs/heads/{main_branch}; only commits on it are main",
                             f"check out {main_branch} (git switch {main_branch}), or grade this commit as a pull "
                             f"request: --candidate {commit[:12]}")
        return export(commit, "main", True, scratch, repo, dirty=_dirty(repo))
    path = Path(spec)
    if path.exists():
        if not (path / "engines").is_dir():
            raise InputError(f"--candidate {spec}: no engines/ directory there",
                             "point --candidate at a checkout of this repository")
        try:
            commit, dirty = _git(["rev-parse", "HEAD"], path), _dirty(path)
        except InputError:
            commit, dirty = "", True
        return CandidateSource(str(path), path.resolve(), commit, dirty, False, "path")
    try:
        commit = _git(["rev-parse", "--verify", f"{spec}^{{commit}}"], repo)
    except InputError:
        raise InputError(f"--candidate {spec!r} is neither 'main', an existing path, nor a git revision",
                         "pass --candidate main, a commit/branch of this repository, or a path to a checkout") from None
    return export(commit, spec, False, scratch, repo)


def contract_version(commit: str, repo: Path = HARNESS_ROOT) -> int:
    """The engine contract version a commit was written against: its scoreboard/engine.py's CONTRACT_VERSION
    (absent: 1). Read from the harness's own git objects, which no candidate process can write. A commit the
    repository does not have is an InputError (the caller names the fix), never "an old contract": that would
    quietly swap the same-round frontier arm for the pinned slot."""
    _git(["cat-file", "-e", f"{commit}^{{commit}}"], repo)
    try:
        text = _git(["show", f"{commit}:scoreboard/engine.py"], repo)
    except InputError:
        return 1
    m = re.search(r"^CONTRACT_VERSION = (\d+)", text, re.MULTILINE)
    return int(m.group(1)) if m else 1


def remeasure_problem(commit: str, repo: Path = HARNESS_ROOT) -> str | None:
    """Why this harness cannot run `commit`'s engines as a round's frontier arm (None: it can): the engine contract
    it was written against is not this harness's (contract_version; a commit the repository lacks: InputError)."""
    from ..engine import CONTRACT_VERSION

    version = contract_version(commit, repo)
    return None if version == CONTRACT_VERSION else f"speaks engine contract {version}, this harness {CONTRACT_VERSION}"


def resolve_main_arm(scratch: Path, repo: Path = HARNESS_ROOT, main_branch: str = "main") -> CandidateSource:
    """A PR round's main arm: the tip of refs/heads/<main_branch>, exported like any git arm (never the
    checkout, which the candidate's own processes could have written)."""
    commit = _git(["rev-parse", "--verify", f"{branch_ref(main_branch, repo)}^{{commit}}"], repo)
    return export(commit, "main", True, scratch, repo)


def export(commit: str, label: str, is_main: bool, scratch: Path, repo: Path, dirty: bool = False) -> CandidateSource:
    """`git archive` of CANDIDATE_CODE at `commit`, unpacked into a fresh directory of `scratch` and checked
    against the commit's tree hash of engines/."""
    names = set(_git(["ls-tree", "--name-only", commit], repo).splitlines())
    if "engines" not in names:
        raise InputError(f"--candidate {label}: commit {commit[:12]} has no engines/ directory",
                         "grade a commit of this repository")
    tree = _git(["rev-parse", f"{commit}:engines"], repo)
    data = _git(["archive", "--format=tar", commit, *[p for p in CANDIDATE_CODE if p in names]], repo, binary=True)
    dest = Path(tempfile.mkdtemp(prefix=f"arm-{commit[:12]}-", dir=scratch))  # private (0700)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")  # nothing outside dest, no device files, no setuid bits
    src = CandidateSource(label, dest, commit, dirty, is_main, "git", tree)
    verify_export(src)
    return src


def verify_export(source: CandidateSource) -> None:
    """Refuse an export whose engines/ no longer hashes to its commit's tree (checked before each use)."""
    if source.kind != "git":
        return
    got = tree_hash(source.root / "engines")
    if got != source.engines_tree:
        raise InputError(f"the export of {source.label} ({source.commit[:12]}) at {source.root} changed: engines/ "
                         f"hashes to tree {got[:12]}, the commit has {source.engines_tree[:12]}",
                         "something wrote into the round's private scratch; re-run the round")


def tree_hash(path: Path) -> str:
    """git's tree object id of the directory at `path` (as `git write-tree` would compute for it)."""
    entries = []
    for entry in os.scandir(path):
        p = Path(entry.path)
        if entry.is_symlink():
            mode, oid = b"120000", _object(b"blob", os.readlink(p).encode())
        elif entry.is_dir():
            mode, oid = b"40000", tree_hash(p)
        else:
            mode = b"100755" if p.stat().st_mode & 0o100 else b"100644"
            oid = _object(b"blob", p.read_bytes())
        key = entry.name.encode() + (b"/" if mode == b"40000" else b"")
        entries.append((key, mode + b" " + entry.name.encode() + b"\0" + bytes.fromhex(oid)))
    return _object(b"tree", b"".join(e for _, e in sorted(entries)))


def _object(kind: bytes, body: bytes) -> str:
    return hashlib.sha1(kind + b" " + str(len(body)).encode() + b"\0" + body).hexdigest()


def import_root(source: CandidateSource, cache_dir: Path) -> Path:
    """The directory whose `engines` a worker imports: a git arm's export (it holds only CANDIDATE_CODE),
    re-verified here before each launch; for a development path, a shim holding only `engines` -> the tree's
    engines/, so that not even an unsandboxed worker has the rest of that tree on its path."""
    if source.kind == "git":
        verify_export(source)
        return source.root
    key = hashlib.sha256(str(source.root).encode()).hexdigest()[:16]
    shim = Path(cache_dir) / "import-shims" / key
    shim.mkdir(parents=True, exist_ok=True)
    link = shim / "engines"
    target = source.root / "engines"
    if link.is_symlink() and os.readlink(link) != str(target):
        link.unlink()
    if not link.exists():
        link.symlink_to(target, target_is_directory=True)
    return shim
