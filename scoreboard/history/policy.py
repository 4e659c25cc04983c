"""`scoreboard verify --base REV`: what a change to the repository (a pull request) changes in policy and in
history, judged against the base commit.

Every field of reference.lock that differs from the base commit's lock is listed as a policy change (targets,
slots, signers, the records listed as sealed before the pin, references, weights, nodes). Findings (exit 2):

- history rewritten: a receipt, calibration record, ledger line or calibration chain line the base holds is
  changed or gone (history is append-only);
- a record added (a receipt or a calibration record the base does not hold) that no key pinned *at the base*
  signed: a key the same change pins vouches for nothing yet, and neither does a record it lists as sealed
  before the pin;
- a slot changed whose ledger change is not backed by a receipt trusted at the base;
- a target whose calibrated definition changed (bars, margin, weights, reference, engines, geometry, candidate
  options: `calibrate.definition`) whose latest calibration is not a record trusted at the base, made against
  the new definition, that separates its bars.

Why the base: a pull request can edit reference.lock, rounds/ and its own signers; the base commit is what was
reviewed and merged before it, so trust is read from there. Everything here is read from git objects
(`git show BASE:path`) and the checked-out tree; nothing is written.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InputError, ScoreboardError
from ..fields import flatten
from .trust import RecordKind, Trust


@dataclass
class PolicyChange:
    field: str  # dotted path into the lock, e.g. targets.k3-mini-cpu.gate.kl_max
    before: str  # JSON of the base's value, or "(absent)"
    after: str  # JSON of this tree's value, or "(absent)"

    def __str__(self) -> str:
        return f"{self.field}: {self.before} -> {self.after}"


@dataclass
class PolicyReport:
    base: str  # the revision as given
    commit: str  # what it resolved to
    changes: list[PolicyChange] = field(default_factory=list)
    backing: list[str] = field(default_factory=list)  # how each backed change is backed
    problems: list[tuple[str, str, str]] = field(default_factory=list)  # (file, field, message)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "problems": [{"file": f, "field": k, "message": m} for f, k, m in self.problems]}


def _git(repo: Path, *args: str, binary: bool = False, ok: bool = False) -> Any:
    out = subprocess.run(["git", *args], cwd=repo, capture_output=True)
    if out.returncode != 0:
        if ok:
            return None
        raise InputError(f"git {' '.join(args)} failed in {repo}: {out.stderr.decode(errors='replace').strip()}")
    return out.stdout if binary else out.stdout.decode().strip()


@dataclass
class _Base:
    """The base commit's lock and records, read from git objects."""

    repo: Path
    commit: str
    lock_rel: str  # the lock's path inside the repository
    rounds_rel: str  # the rounds directory's path inside the repository

    def file(self, rel: str) -> bytes | None:
        return _git(self.repo, "show", f"{self.commit}:{rel}", binary=True, ok=True)

    def blobs(self) -> dict[str, str]:
        """{path relative to the rounds directory: blob id} of every file under it at the base."""
        out = _git(self.repo, "ls-tree", "-r", "-z", self.commit, "--", self.rounds_rel + "/", binary=True)
        blobs: dict[str, str] = {}
        for entry in out.split(b"\0"):
            if entry:
                meta, path = entry.decode().split("\t", 1)
                blobs[os.path.relpath(path, self.rounds_rel)] = meta.split()[2]
        return blobs


def _open_base(rev: str, lock_path: Path, rounds: Path) -> _Base:
    top_raw = _git(lock_path.resolve().parent, "rev-parse", "--show-toplevel", ok=True)
    if not top_raw:
        raise InputError(f"--base {rev}: {lock_path} is not inside a git repository", "run verify --base in a clone")
    top = Path(top_raw)
    commit = _git(top, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", ok=True)
    if not commit:
        raise InputError(f"--base {rev}: not a commit of {top}",
                         f"fetch it first (`git fetch origin {rev.split('/')[-1]}`; in CI: actions/checkout with "
                         "fetch-depth: 0)")
    return _Base(top, commit, os.path.relpath(lock_path.resolve(), top), os.path.relpath(rounds.resolve(), top))


def _lock_dump(lock: Any) -> dict[str, Any]:
    """The lock as JSON, with the records listed as sealed before the pin keyed by id (one change per record)."""
    dump = lock.model_dump(mode="json", by_alias=True)
    pre = dump.get("sealed_before_pin") or {}
    dump["sealed_before_pin"] = {k: {r["id"]: r["seal_sha256"] for r in v} for k, v in pre.items()}
    return dump


def lock_changes(base_lock: Any, lock: Any) -> list[PolicyChange]:
    """Every leaf of the lock that differs from the base's, by dotted path."""
    a, b = flatten(_lock_dump(base_lock) if base_lock is not None else {}), flatten(_lock_dump(lock))
    return [PolicyChange(k, a.get(k, "(absent)"), b.get(k, "(absent)")) for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]


def policy_report(rev: str, lock_path: str | os.PathLike[str], rounds_dir: str | os.PathLike[str]) -> PolicyReport:
    """The policy changes of this tree against `rev`, and the findings listed in the module docstring."""
    from ..lockfile import load_lock, parse_lock

    lock_path, rounds = Path(lock_path), Path(rounds_dir)
    base = _open_base(rev, lock_path, rounds)
    report = PolicyReport(rev, base.commit)
    raw = base.file(base.lock_rel)
    try:
        base_lock = parse_lock(raw.decode("utf-8"), f"{rev}:{base.lock_rel}") if raw is not None else None
    except (ScoreboardError, UnicodeDecodeError) as exc:
        raise InputError(f"--base {rev}: its {base.lock_rel} does not load ({exc}); compare against a base whose lock "
                         "loads") from None
    lock = load_lock(lock_path)
    report.changes = lock_changes(base_lock, lock)
    trust = Trust.of(base_lock, f"{rev}:{base.lock_rel}") if base_lock is not None else \
        Trust.unreadable(f"{rev} has no {base.lock_rel}")
    added = _history_changes(report, base, rounds)
    _added_records_trusted(report, rounds, added, trust)
    _slots_backed(report, lock, lock_path, rounds, base, trust)
    _bars_backed(report, base_lock, lock, rounds, trust)
    return report


def _history_changes(report: PolicyReport, base: _Base, rounds: Path) -> list[str]:
    """Findings for every base record changed or gone, and for chains that do not extend the base's; returns the
    paths (relative to rounds/) of files this tree adds."""
    theirs = base.blobs()
    mine = _blob_ids(rounds)
    for rel, blob in sorted(theirs.items()):
        if rel.startswith("unsealed/"):
            continue
        if rel not in mine:
            report.problems.append((str(rounds / rel), "<file>", f"in {report.base} but gone here: history is "
                                                                 "append-only"))
        elif mine[rel] != blob and rel not in ("ledger.jsonl", "calibrations.jsonl"):
            report.problems.append((str(rounds / rel), "<file>", f"differs from {report.base}: a sealed record is "
                                                                 "written once"))
    for chain in ("ledger.jsonl", "calibrations.jsonl"):
        before = base.file(f"{base.rounds_rel}/{chain}") or b""
        now = (rounds / chain).read_bytes() if (rounds / chain).is_file() else b""
        if not now.startswith(before):
            report.problems.append((str(rounds / chain), "<file>", f"does not begin with {report.base}'s "
                                                                   f"{len(before.splitlines())} line(s): a chain is "
                                                                   "append-only"))
    return sorted(rel for rel in mine if rel not in theirs and rel.endswith(".json"))


def _blob_ids(rounds: Path) -> dict[str, str]:
    """{path relative to rounds/: git blob id} of every file under it (what `git hash-object` gives)."""
    files = sorted(p for p in rounds.rglob("*") if p.is_file()) if rounds.is_dir() else []
    if not files:
        return {}
    out = subprocess.run(["git", "hash-object", "--no-filters", "--stdin-paths"], input="\n".join(map(str, files)),
                         capture_output=True, text=True, check=True).stdout.split()
    return {str(p.relative_to(rounds)): oid for p, oid in zip(files, out)}


def _added_records_trusted(report: PolicyReport, rounds: Path, added: list[str], trust: Trust) -> None:
    """Every receipt and calibration record this tree adds must be signed by a key the base pins."""
    import json

    for rel in added:
        kind: RecordKind = "calibration" if rel.startswith("calibrations/") else "round"
        if kind == "round" and "/" in rel:
            continue  # not a receipt (rounds/unsealed/ and the like are no history)
        try:
            data = json.loads((rounds / rel).read_bytes())
        except ValueError:
            continue  # plain verify reports it
        standing = trust.standing(data, kind) if isinstance(data, dict) else None
        if standing is None or standing.state != "signed":
            why = standing.why if standing is not None and not standing.trusted else \
                f"listed as sealed before the pin by {trust.source}, yet not in {report.base}'s rounds/"
            report.problems.append((str(rounds / rel), "seal", f"added, and no key pinned at {report.base} "
                                                               f"signed it: {why}"))
        else:
            report.backing.append(f"{rounds / rel}: {standing.describe()} (pinned at {report.base})")


def _slots_backed(report: PolicyReport, lock: Any, lock_path: Path, rounds: Path, base: _Base, trust: Trust) -> None:
    """A changed slot must be what a ledger line sets, backed by a receipt a key pinned at the base vouches for."""
    import json

    from . import ledger

    changed = sorted({c.field.split(".")[1] for c in report.changes if c.field.startswith("slots.")})
    if not changed:
        return
    try:
        last = ledger.last_changes(ledger.read_entries(rounds))
    except ScoreboardError as exc:
        report.problems.append((str(ledger.ledger_path(rounds)), "<file>", exc.message.splitlines()[0]))
        return
    for name in changed:
        where, hit = f"slots.{name}", last.get(name)
        slot = lock.slots.get(name)
        value = slot.value if slot else 0.0
        if hit is None or hit[1].after != value:
            report.problems.append((str(lock_path), where, f"changed to {value} but no ledger line sets it to that"))
            continue
        path = rounds / f"{hit[0].round_id}.json"
        data = json.loads(path.read_bytes()) if path.is_file() else {}
        standing = trust.standing(data, "round")
        if not standing.trusted:
            report.problems.append((str(lock_path), where, f"changed to {value} by round {hit[0].round_id}, whose "
                                                           f"receipt no key pinned at {report.base} vouches for: "
                                                           f"{standing.why}"))
        else:
            report.backing.append(f"{where} = {value}: {hit[0].kind} of round {hit[0].round_id}, "
                                  f"{standing.describe()}")


def _bars_backed(report: PolicyReport, base_lock: Any, lock: Any, rounds: Path, trust: Trust) -> None:
    """A target whose calibrated definition changed needs a latest calibration, trusted at the base, made against
    the new definition, that separates its bars."""
    from ..calibrate import definition, definition_changes, latest_calibration, separation_problems

    for tid, t in sorted(lock.targets.items()):
        now = definition(lock, tid)
        then = definition(base_lock, tid) if base_lock is not None and tid in base_lock.targets else {}
        if now == then:
            continue
        what = "; ".join(definition_changes(then, now)[:6]) if then else "a new target"
        where = f"targets.{tid}"
        try:
            found = latest_calibration(rounds, tid)
        except ScoreboardError as exc:
            report.problems.append((str(rounds), where, exc.message.splitlines()[0]))
            continue
        rec = found[0] if found else None
        standing = trust.standing(rec, "calibration") if rec is not None else None
        if rec is None or standing is None or not standing.trusted:
            why = "it has no calibration" if rec is None else f"its latest calibration {rec['calibration_id']} " \
                                                             f"is not trusted at {report.base}: {standing.why if standing else ''}"
            report.problems.append((str(rounds), where, f"bars changed ({what}) and {why}; changed bars are backed "
                                                        "only by a calibration the box's pinned key sealed"))
        elif rec["definition"] != now:
            report.problems.append((str(rounds), where, f"bars changed ({what}) but its latest calibration "
                                                        f"{rec['calibration_id']} was made against another definition"))
        elif separation_problems(rec, t.gate):
            report.problems.append((str(rounds), where, f"bars changed ({what}); its calibration "
                                                        f"{rec['calibration_id']} does not separate them"))
        else:
            report.backing.append(f"{where} bars ({what}): calibration {rec['calibration_id']}, "
                                  f"{standing.describe()}")
