"""The records' durable copy: after every write of history, rounds/ and reference.lock are committed to a git ref
that no routine git step touches.

Where: ``refs/scoreboard/records`` of the repository whose work tree holds rounds/ (a linked worktree gets
``refs/scoreboard/worktrees/<id>/records``; a rounds directory elsewhere than ``<top>/rounds`` gets
``refs/scoreboard/records-<its path>``); a rounds directory in no git work tree gets a bare repository of its own,
``<rounds>/../.scoreboard-records.git``. Each commit's tree holds ``rounds/<receipt>.json``, ``rounds/ledger.jsonl``,
``rounds/calibrations.jsonl``, ``rounds/calibrations/<id>.json`` and ``reference.lock``, as the bytes on disk.

Why no routine step loses it: it is written with plumbing only (`git hash-object -w`, `git mktree`,
`git commit-tree`, `git update-ref` with the old value as a compare-and-swap), never through the index or the work
tree; checkout, switch, `commit -a`, stash, reset and clean do not touch refs under refs/scoreboard/, and gc keeps
what a ref reaches. Push it off the box with `git push origin refs/scoreboard/records`. A candidate never writes it:
its workers run in the sandbox, which binds neither the checkout nor its .git, and the records are saved after
the last worker of the round has ended.

`differences` compares the working tree's records with the last saved state (a round refuses to start while they
differ); `restore` brings back what the working tree lost (`scoreboard records restore`, and the first step of
`scoreboard frontier resume`).
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InputError
from . import ledger

RECORDS_REF = "refs/scoreboard/records"
BARE_STORE = ".scoreboard-records.git"  # beside a rounds directory that is in no git work tree
ROUNDS, LOCK = "rounds", "reference.lock"  # the tree's names, wherever the files live
_ZERO = "0" * 40
_IDENTITY = {"GIT_AUTHOR_NAME": "scoreboard", "GIT_AUTHOR_EMAIL": "scoreboard@localhost",
             "GIT_COMMITTER_NAME": "scoreboard", "GIT_COMMITTER_EMAIL": "scoreboard@localhost"}


@dataclass(frozen=True)
class Store:
    git_dir: Path  # the repository holding the ref (a work tree's common .git, or the bare store)
    ref: str

    def describe(self) -> str:
        return f"{self.ref} in {self.git_dir}"

    def git(self, *args: str, stdin: bytes | None = None, ok: bool = False) -> bytes | None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")} | _IDENTITY
        out = subprocess.run(["git", f"--git-dir={self.git_dir}", *args], input=stdin, capture_output=True, env=env)
        if out.returncode != 0:
            if ok:
                return None
            raise InputError(f"git {' '.join(args[:2])} failed on {self.git_dir}: "
                             f"{out.stderr.decode(errors='replace').strip()}",
                             "the records' durable copy needs git and a writable repository (docs/nothing-lost.md)")
        return out.stdout

    def tip(self) -> str | None:
        out = self.git("rev-parse", "--verify", "--quiet", f"{self.ref}^{{commit}}", ok=True)
        return out.decode().strip() if out else None


def _git_in(d: Path, *args: str) -> str | None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    out = subprocess.run(["git", *args], cwd=d, capture_output=True, text=True, env=env)
    return out.stdout.strip() if out.returncode == 0 else None


def locate(rounds_dir: str | os.PathLike[str]) -> Store:
    """The store of this rounds directory (module docstring); it need not exist yet."""
    rounds = Path(rounds_dir).resolve()
    d = rounds if rounds.is_dir() else rounds.parent
    while not d.is_dir():
        d = d.parent
    top = _git_in(d, "rev-parse", "--show-toplevel")
    if top is None:
        return Store(rounds.parent / BARE_STORE, RECORDS_REF)
    common = Path(_git_in(d, "rev-parse", "--path-format=absolute", "--git-common-dir") or "")
    own = Path(_git_in(d, "rev-parse", "--absolute-git-dir") or "")
    ref = RECORDS_REF if own == common else f"refs/scoreboard/worktrees/{own.name}/records"
    rel = os.path.relpath(rounds, top)
    if rel != ROUNDS:
        ref += "-" + re.sub(r"[^A-Za-z0-9._-]+", "-", rel).strip("-.")
    return Store(common, ref)


def record_files(rounds_dir: str | os.PathLike[str], lock_path: str | os.PathLike[str]) -> dict[str, Path]:
    """{name in the store's tree: file} of every record: receipts, both chains, calibration records, the lock."""
    from ..calibrate import CHAIN_NAME, RECORDS_DIR
    from .records import receipt_files

    rounds = Path(rounds_dir)
    out = {f"{ROUNDS}/{p.name}": p for p in receipt_files(rounds)}
    for name in (ledger.LEDGER_NAME, CHAIN_NAME):
        if (rounds / name).is_file():
            out[f"{ROUNDS}/{name}"] = rounds / name
    cal = rounds / RECORDS_DIR
    for p in sorted(cal.glob("*.json")) if cal.is_dir() else []:
        if not p.name.startswith("."):
            out[f"{ROUNDS}/{RECORDS_DIR}/{p.name}"] = p
    if Path(lock_path).is_file():
        out[LOCK] = Path(lock_path)
    return out


def _blob_ids(store: Store, files: dict[str, Path], write: bool) -> dict[str, str]:
    if not files:
        return {}
    names = sorted(files)
    args = ["hash-object", "--no-filters", "--stdin-paths"] + (["-w"] if write else [])
    out = store.git(*args, stdin="\n".join(str(files[n].resolve()) for n in names).encode())
    return dict(zip(names, (out or b"").decode().split()))


def _mktree(store: Store, blobs: dict[str, str]) -> str:
    """The tree object holding `blobs` ({a/b/c: blob id}), subtrees made first."""
    files = {n: b for n, b in blobs.items() if "/" not in n}
    dirs: dict[str, dict[str, str]] = {}
    for n, b in blobs.items():
        if "/" in n:
            head, rest = n.split("/", 1)
            dirs.setdefault(head, {})[rest] = b
    lines = [f"100644 blob {b}\t{n}" for n, b in files.items()]
    lines += [f"040000 tree {_mktree(store, sub)}\t{d}" for d, sub in dirs.items()]
    out = store.git("mktree", stdin=("\n".join(sorted(lines, key=lambda x: x.split("\t")[1])) + "\n").encode())
    return (out or b"").decode().strip()


@dataclass(frozen=True)
class Saved:
    store: Store
    commit: str
    changed: bool  # False: the tip already held exactly these records

    def describe(self) -> str:
        return f"{self.store.describe()} at {self.commit[:12]}" + ("" if self.changed else " (unchanged)")


def save(rounds_dir: str | os.PathLike[str], lock_path: str | os.PathLike[str], message: str) -> Saved:
    """Commit the records as they are on disk to the store's ref (a new commit only when they changed)."""
    store = locate(rounds_dir)
    if not store.git_dir.exists():
        made = subprocess.run(["git", "init", "-q", "--bare", str(store.git_dir)], capture_output=True, text=True)
        if made.returncode != 0:
            raise InputError(f"{store.git_dir}: cannot create the records' store ({made.stderr.strip()})",
                             "the directory beside rounds/ must be writable (docs/nothing-lost.md)")
    with ledger.exclusive(rounds_dir):
        files = record_files(rounds_dir, lock_path)
        blobs = _blob_ids(store, files, write=True)
        old = store.tip()
        lost = _dropped(store, old, files, blobs) if old else []
        if lost:
            raise InputError(f"{store.describe()}: saving would drop what its last state holds ({'; '.join(lost[:4])}); "
                             "the ref only grows", f"restore first: `scoreboard frontier resume --lock {lock_path} "
                                                   f"--rounds {rounds_dir}`")
        tree = _mktree(store, blobs)
        if old is not None and (store.git("rev-parse", f"{old}^{{tree}}") or b"").decode().strip() == tree:
            return Saved(store, old, False)
        parent = ["-p", old] if old else []
        commit = (store.git("commit-tree", tree, *parent, "-m", message) or b"").decode().strip()
        store.git("update-ref", "-m", message, store.ref, commit, old or _ZERO)
    return Saved(store, commit, True)


def _dropped(store: Store, tip: str, files: dict[str, Path], blobs: dict[str, str]) -> list[str]:
    """Records the tip holds that these files lose: a record gone or changed, a chain that does not extend it."""
    out = []
    for name, blob in _stored(store, tip).items():
        if name == LOCK or blobs.get(name) == blob:
            continue
        if name.endswith(".jsonl") and name in files and files[name].read_bytes().startswith(
                store.git("cat-file", "blob", blob) or b""):
            continue
        out.append(f"{name}: {'gone' if name not in files else 'changed'}")
    return out


def _stored(store: Store, tip: str) -> dict[str, str]:
    out = store.git("ls-tree", "-r", "-z", tip) or b""
    blobs = {}
    for entry in out.split(b"\0"):
        if entry:
            meta, name = entry.decode().split("\t", 1)
            blobs[name] = meta.split()[2]
    return blobs


def _slots(text: bytes) -> dict[str, object]:
    import tomlkit

    try:
        return dict(tomlkit.parse(text.decode("utf-8")).unwrap().get("slots") or {})
    except Exception:  # a lock that no longer parses: every slot differs, which the caller reports
        return {"<unreadable>": text[:0]}


def differences(rounds_dir: str | os.PathLike[str], lock_path: str | os.PathLike[str]) -> list[str]:
    """How the working tree's records differ from the last saved state ([] when equal, or nothing saved yet):
    each record file gone, changed or added, and each slot of the lock that differs (the rest of the lock is
    policy, changed by reviewed commits)."""
    store = locate(rounds_dir)
    tip = store.tip() if store.git_dir.exists() else None
    if tip is None:
        return []
    stored, files = _stored(store, tip), record_files(rounds_dir, lock_path)
    mine = _blob_ids(store, files, write=False)
    out = []
    for name in sorted(set(stored) | set(mine)):
        if name == LOCK or stored.get(name) == mine.get(name):
            continue
        what = "gone" if name not in mine else "not in it" if name not in stored else "changed"
        out.append(f"{name}: {what}")
    if stored.get(LOCK) != mine.get(LOCK):
        then = _slots(store.git("cat-file", "blob", stored[LOCK]) or b"") if LOCK in stored else {}
        now = _slots(Path(lock_path).read_bytes()) if Path(lock_path).is_file() else {}
        out += [f"{LOCK}: slots.{s}: changed" for s in sorted(set(then) | set(now)) if then.get(s) != now.get(s)]
    return out


def refuse_unsettled(rounds_dir: str | os.PathLike[str], lock_path: str | os.PathLike[str]) -> None:
    """InputError, before a round starts, while the records differ from the last saved state."""
    diff = differences(rounds_dir, lock_path)
    if diff:
        shown = "; ".join(diff[:6]) + (f" (and {len(diff) - 6} more)" if len(diff) > 6 else "")
        raise InputError(f"{rounds_dir}, {lock_path}: the records differ from their last sealed state in "
                         f"{locate(rounds_dir).describe()}: {shown}; a round never starts on records a git step may "
                         "have rolled back",
                         f"`scoreboard frontier resume --lock {lock_path} --rounds {rounds_dir}` restores what was "
                         f"lost and chains what is new (`scoreboard records status --lock {lock_path} --rounds "
                         f"{rounds_dir}` lists it)")


@dataclass
class Restored:
    written: list[str] = field(default_factory=list)  # files written back from the store
    kept: list[str] = field(default_factory=list)  # what the working tree has beyond the store (left for rechain)


def restore(rounds_dir: str | os.PathLike[str], lock_path: str | os.PathLike[str]) -> Restored:
    """Write back every record the working tree lost or changed since the last saved state: receipts and
    calibration records as sealed, a chain (ledger, calibrations) the store holds more of. A chain that runs
    ahead of the store (rounds recorded since, or records brought by git) is kept; the slots of the lock are left
    to `records.rechain`, which writes them from the ledger."""
    from .records import _write_once

    store = locate(rounds_dir)
    tip = store.tip() if store.git_dir.exists() else None
    out = Restored()
    if tip is None:
        return out
    rounds = Path(rounds_dir)
    stored, mine = _stored(store, tip), _blob_ids(store, record_files(rounds_dir, lock_path), write=False)
    with ledger.exclusive(rounds):
        for name, blob in sorted(stored.items()):
            if name == LOCK or mine.get(name) == blob:
                continue
            path = rounds / name[len(ROUNDS) + 1:]
            data = store.git("cat-file", "blob", blob) or b""
            current = path.read_bytes() if path.is_file() else None
            if current is not None and name.endswith(".jsonl") and current.startswith(data):
                out.kept.append(f"{name}: runs ahead of the store")
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            if current is None:
                _write_once(path, data)
                out.written.append(f"{name}: restored")
                continue
            from ..lockfile import atomic_write_text

            atomic_write_text(path, data.decode("utf-8"))
            dropped = len(current.splitlines()) - _common_lines(current, data) if name.endswith(".jsonl") else 0
            out.written.append(f"{name}: rewritten as sealed" + (f" ({dropped} line(s) of the working tree's, "
                                                                 "after the lines they share, dropped: their receipts "
                                                                 "are re-chained)" if dropped else ""))
        out.kept += [f"{n}: not in the store" for n in sorted(mine) if n not in stored and n != LOCK]
    return out


def _common_lines(a: bytes, b: bytes) -> int:
    n = 0
    for x, y in zip(a.splitlines(), b.splitlines()):
        if x != y:
            break
        n += 1
    return n
