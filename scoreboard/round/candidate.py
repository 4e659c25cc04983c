"""Resolve `--candidate main|<git rev>|<path>` to a source tree whose `engines/` the workers import."""

from __future__ import annotations

import hashlib
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError

HARNESS_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class CandidateSource:
    label: str  # "main", a git rev as given, or a path
    root: Path  # tree holding engines/
    commit: str
    dirty: bool
    is_main: bool

    def as_dict(self) -> dict:
        return {"label": self.label, "root": str(self.root), "commit": self.commit, "dirty": self.dirty,
                "is_main": self.is_main}


def _git(args: list[str], cwd: Path) -> str:
    out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if out.returncode != 0:
        raise InputError(f"git {' '.join(args)} failed in {cwd}: {out.stderr.strip()}")
    return out.stdout.strip()


# What a candidate *runs*: its engines and the packaging that registers them. The harness's own data in
# the same checkout (reference.lock slots, rounds/ and its ledger) changes with every sealed round and
# does not make the candidate's code differ from its commit.
CANDIDATE_CODE = ("engines", "pyproject.toml")


def _dirty(root: Path) -> bool:
    """Uncommitted changes to tracked candidate code (CANDIDATE_CODE) under `root`."""
    return bool(_git(["status", "--porcelain", "--untracked-files=no", "--", *CANDIDATE_CODE], root))


def resolve(spec: str, cache_dir: Path, repo: Path = HARNESS_ROOT) -> CandidateSource:
    """main = this checkout's HEAD (the candidate's main line); a path = that tree; else a git rev,
    checked out clean into a cached worktree."""
    if spec == "main":
        try:
            commit = _git(["rev-parse", "HEAD"], repo)
            dirty = _dirty(repo)
        except InputError:
            commit, dirty = "", True
        return CandidateSource("main", repo, commit, dirty, True)
    path = Path(spec)
    if path.exists():
        if not (path / "engines").is_dir():
            raise InputError(f"--candidate {spec}: no engines/ directory there",
                             "point --candidate at a checkout of this repository")
        try:
            commit, dirty = _git(["rev-parse", "HEAD"], path), _dirty(path)
        except InputError:
            commit, dirty = "", True
        return CandidateSource(str(path), path.resolve(), commit, dirty, False)
    try:
        commit = _git(["rev-parse", "--verify", f"{spec}^{{commit}}"], repo)
    except InputError:
        raise InputError(f"--candidate {spec!r} is neither 'main', an existing path, nor a git revision",
                         "pass --candidate main, a commit/branch of this repository, or a path to a checkout") from None
    tree = Path(cache_dir) / "candidates" / commit
    if not (tree / ".git").exists():
        tree.parent.mkdir(parents=True, exist_ok=True)
        _git(["worktree", "add", "--detach", "--force", str(tree), commit], repo)
    else:
        _git(["checkout", "--detach", "--force", commit], tree)
        _git(["clean", "-fdx"], tree)
    head = _git(["rev-parse", "HEAD"], tree)
    if head != commit:
        raise InputError(f"candidate worktree {tree} is at {head}, expected {commit}")
    return CandidateSource(spec, tree, commit, False, False)


def import_root(source: CandidateSource, cache_dir: Path) -> Path:
    """A directory holding only `engines` -> the candidate's engines/, so a worker imports the
    candidate's engine code but the harness's own `scoreboard` (grade with the harness, LESSONS 14)."""
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
