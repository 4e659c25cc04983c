"""`scoreboard verify` logic: every receipt's seal and who sealed it (a key pinned in the lock, or listed as
sealed before the signer pin: `trust`), the ledger chain, every slot in reference.lock backed by the ledger and
a trusted sealed receipt with the same value, and the calibration chain with its sealed records. Reports, never
prints."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import frontier, ledger, rebase
from ..errors import InputError, LockError
from .ledger import LedgerEntry
from ..lockfile import Lock, load_lock
from .receipt import Receipt, scored_metric, validation_problems
from .records import receipt_files
from .seal import check_seal, check_signature, load_public_key, sha256_hex
from .trust import PRE_PIN, Trust


@dataclass
class Problem:
    file: str
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}: {self.field}: {self.message}"


@dataclass
class Report:
    lock: str
    rounds: str
    receipts: int = 0
    ledger_lines: int = 0
    slots_checked: int = 0
    calibrations: int = 0
    signatures: str = ""
    signed: dict[str, int] = field(default_factory=dict)  # pinned signer id -> records it sealed
    pre_pin: list[str] = field(default_factory=list)  # ids of records trusted as sealed before the signer pin
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # facts that are no finding (pre-pin records, superseded raises)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


@dataclass
class _Rec:
    path: Path
    data: dict[str, Any]  # the JSON as read (what its seal is over)
    receipt: Receipt  # the same, parsed
    file_sha: str
    trusted: bool = False  # its seal holds and a pinned key (or the pre-pin list) vouches for it


class _Ctx:
    def __init__(self, report: Report, trust: Trust):
        self.report = report
        self.trust = trust

    def add(self, file: Path | str, fld: str, message: str) -> None:
        self.report.problems.append(Problem(str(file), fld, message))

    def judge(self, path: Path, data: dict[str, Any], kind: str) -> bool:
        """Whether a record whose seal holds is trusted; an untrusted one is a finding, a pre-pin one a note."""
        st = self.trust.standing(data, "round" if kind == "round" else "calibration")
        if st.state == "signed":
            self.report.signed[st.signer] = self.report.signed.get(st.signer, 0) + 1
        elif st.state == "pre-pin":
            self.report.pre_pin.append(path.stem)
        else:
            self.add(path, "seal", f"UNTRUSTED: {st.why}")
        return st.trusted


def _split(p: str) -> tuple[str, str]:
    head, _, tail = p.partition(": ")
    return (head, tail) if tail else ("<root>", p)


def _check_receipts(ctx: _Ctx, rounds: Path, trusted: Any) -> dict[str, _Rec]:
    recs: dict[str, _Rec] = {}
    for path in receipt_files(rounds):
        raw = path.read_bytes()
        try:
            data = json.loads(raw)
        except ValueError as exc:
            ctx.add(path, "<file>", f"not JSON ({exc})")
            continue
        problems = validation_problems(data)
        for p in problems:
            ctx.add(path, *_split(p))
        if problems or not isinstance(data, dict):
            continue
        receipt = Receipt.model_validate(data)
        if path.stem != receipt.round_id:
            ctx.add(path, "round_id", f"{receipt.round_id!r} does not match the file name (renamed?)")
        seal = check_seal(data) + check_signature(data, trusted)
        for fld, msg in seal:
            ctx.add(path, fld, msg)
        ok = not seal and ctx.judge(path, data, "round")
        recs[receipt.round_id] = _Rec(path, data, receipt, sha256_hex(raw), ok)
    ctx.report.receipts = len(recs)
    return recs


def _line_vs_receipt(ctx: _Ctx, where: str, e: LedgerEntry, rec: _Rec, earlier: set[str]) -> None:
    """The line's fields against its receipt; `earlier`: the hashes of the lines before it ("" included)."""
    d = rec.receipt
    if e.receipt_sha256 != rec.file_sha:
        ctx.add(where, "receipt_sha256", f"{rec.path} bytes changed since the line was written")
    if e.seal_sha256 != (d.seal.sha256 if d.seal else None):
        ctx.add(where, "seal_sha256", f"does not match {rec.path} seal.sha256")
    expect: dict[str, Any] = {
        "target": d.target, "status": d.status, "candidate_commit": d.candidate.commit,
        "is_main": d.candidate.is_main, "verdict": d.verdict.label if d.verdict else "aborted"}
    if ledger.is_round(e):
        m = scored_metric(d)
        at_start = m.frontier if m else None
        expect.update(date=d.created_at, value=frontier.scored_value(d), frontier_before=at_start,
                      frontier_after=at_start, changes=[])
        sealed_after = d.seal.prev_ledger_sha256 if d.seal else None
        if e.kind == "round" and sealed_after != e.prev_sha256:
            ctx.add(where, "prev_sha256", f"{rec.path} was sealed after a different ledger line (reordered?)")
        if e.kind == "round-late" and sealed_after not in earlier:
            ctx.add(where, "kind", f"round-late, but {rec.path} was sealed after no earlier line of the ledger")
    for k, v in expect.items():
        if getattr(e, k) != v:
            ctx.add(where, k, f"{getattr(e, k)!r} but {rec.path} says {v!r}")


def _changes_backed(ctx: _Ctx, where: str, e: LedgerEntry, rec: _Rec) -> None:
    if ledger.is_round(e):
        return  # a round line changes nothing (checked in _line_vs_receipt)
    if not e.changes:
        ctx.add(where, "changes", f"a {e.kind} line without changes")
    try:
        measured = {(m.slot, m.kind): m for m in frontier.measured_slots(rec.receipt)}
    except InputError as exc:
        ctx.add(where, "changes", exc.message)
        return
    why = frontier.ineligible(rec.receipt) if e.kind == "frontier-raise" else \
        rebase.line_refusal(rec.receipt, e.changes) if e.kind == rebase.KIND else frontier.lower_refusal(rec.receipt)
    if why:
        ctx.add(where, "round_id", f"round {e.round_id} may not write slots: {why}")
    if e.kind in ("frontier-lower", rebase.KIND) and not e.reason.strip():
        ctx.add(where, "reason", "a lowering needs a reason" if e.kind == "frontier-lower" else "a re-base needs a reason")
    for i, c in enumerate(e.changes):
        m = measured.get((c.slot, c.kind))
        if m is None or m.value != c.after:
            ctx.add(where, f"changes[{i}].after", f"{c.slot}={c.after} is not what {rec.path} measured "
                                                  f"({m.value if m else 'nothing'})")
        elif c.reps != m.reps or c.commit != m.commit:
            ctx.add(where, f"changes[{i}]", f"reps/commit differ from {rec.path} ({m.reps}, {m.commit})")
        elif e.kind == "frontier-lower" and (c.kind != "frontier" or not c.after < c.before):
            ctx.add(where, f"changes[{i}]", "a frontier-lower line may only lower a frontier")
        elif e.kind == "frontier-raise" and c.kind == "frontier" and not c.after > c.before:
            ctx.add(where, f"changes[{i}]", "a frontier-raise line may only raise a frontier")


def _check_ledger(ctx: _Ctx, rounds: Path, recs: dict[str, _Rec]) -> list[tuple[int, LedgerEntry]]:
    lp = ledger.ledger_path(rounds)
    lines, file_problem = ledger.read_chain_for_report(lp)
    if file_problem:
        ctx.add(lp, "<file>", file_problem)
    ctx.report.ledger_lines = len(lines)
    for n, fld, msg in ledger.chain_problems(lines):
        ctx.add(f"{lp}:{n}", fld, msg)
    entries: list[tuple[int, LedgerEntry]] = []
    seen: dict[str, int] = {}
    hashes = [""] + [sha256_hex(raw) for raw in lines]  # hashes[n - 1]: the line line n follows ("" for line 1)
    for n, e in ledger.valid_lines(lines, LedgerEntry):
        entries.append((n, e))
        where = f"{lp}:{n}"
        if ledger.is_round(e):
            if e.round_id in seen:
                ctx.add(where, "round_id", f"round {e.round_id} already on line {seen[e.round_id]}")
            seen.setdefault(e.round_id, n)
        elif e.round_id not in seen:
            ctx.add(where, "round_id", f"{e.kind} line before the round line of {e.round_id} (reordered?)")
        rec = recs.get(e.round_id)
        if rec is None:
            ctx.add(where, "round_id", f"{rounds / (e.round_id + '.json')} is missing or invalid (deleted?)")
            continue
        if not rec.trusted:
            ctx.add(where, "round_id", f"backed by {rec.path}, which no pinned key vouches for (see its finding): a "
                                       "ledger line is only as trusted as the receipt it names")
        _line_vs_receipt(ctx, where, e, rec, set(hashes[:n]))
        _changes_backed(ctx, where, e, rec)
    for rid, rec in recs.items():
        if rid not in seen:
            ctx.add(rec.path, "<file>", f"no round line in {lp} (deleted line, or an interrupted round: "
                                        f"`scoreboard frontier resume --receipt {rec.path}`)")
    return entries


def _check_slots(ctx: _Ctx, lock_path: Path, rounds: Path, lock: Lock, entries: list[tuple[int, LedgerEntry]],
                 recs: dict[str, _Rec]) -> None:
    last: dict[str, tuple[int, LedgerEntry, Any]] = {}
    for n, e in entries:
        for i, c in enumerate(e.changes):
            prev = last[c.slot][2].after if c.slot in last else 0.0
            if c.before != prev:
                ctx.add(f"{ledger.ledger_path(rounds)}:{n}", f"changes[{i}].before",
                        f"{c.slot} before={c.before} but the ledger had it at {prev}")
            last[c.slot] = (n, e, c)
    expected = lock.expected_slots()
    for name in sorted(set(lock.slots) | {s for s in last if s in expected}):
        slot = lock.slots.get(name)
        value = slot.value if slot else 0.0
        f = f"slots.{name}"
        ctx.report.slots_checked += 1
        hit = last.get(name)
        if hit is None:
            if value:
                ctx.add(lock_path, f"{f}.value", f"{value} is not backed by any ledger line (hand-edited; "
                                                 "slots are written only from sealed receipts)")
            continue
        n, e, c = hit
        if value != c.after:
            ctx.add(lock_path, f"{f}.value", f"{value} but ledger line {n} (round {e.round_id}) set it to {c.after}"
                                             " (hand-edited, or an interrupted round: `scoreboard frontier "
                                             f"resume --receipt {rounds / (e.round_id + '.json')}`)")
            continue
        rec = recs.get(e.round_id)
        if rec is None:
            continue  # reported with the ledger
        if not rec.trusted and value:
            ctx.add(lock_path, f"{f}.value", f"{value} was set by round {e.round_id}, whose receipt {rec.path} no "
                                             "pinned key vouches for")
        want = {"round": e.round_id, "commit": c.commit, "reps": c.reps, "measured_at": rec.receipt.created_at,
                "unit": "tok/s", "kind": c.kind}
        for k, v in want.items():
            if getattr(slot, k) != v:
                ctx.add(lock_path, f"{f}.{k}", f"{getattr(slot, k)!r} but ledger line {n} / {rec.path} say {v!r}")


def _check_raises(ctx: _Ctx, lock: Lock, rounds: Path, entries: list[tuple[int, LedgerEntry]],
                  recs: dict[str, _Rec]) -> None:
    """A round that earned slot changes at its place on the ledger (`frontier.plan`) and has no frontier-raise line
    after it: a finding while it still earns some (`frontier.late_plan`: an interrupted raise, which `scoreboard
    frontier resume` finishes), a note once later rounds superseded every one."""
    state: dict[str, float] = {}
    final = {slot: c.after for slot, (_, c) in ledger.last_changes([x for _, x in entries]).items()}
    for i, (n, e) in enumerate(entries):
        rec = recs.get(e.round_id)
        later = [x for _, x in entries[i + 1:]]
        if ledger.is_round(e) and rec is not None and rec.trusted and \
                not any(x.kind == "frontier-raise" and x.round_id == e.round_id for x in later):
            try:
                earned = frontier.plan(lock, rec.receipt, state)
            except InputError:
                earned = []  # the lock no longer defines its slots: nothing it could raise now
            if earned:
                still = frontier.late_plan(lock, rec.receipt, final, later)
                msg = ", ".join(f"{c.slot} {c.before} -> {c.after}" for c in (still or earned))
                if still:
                    ctx.add(f"{ledger.ledger_path(rounds)}:{n}", "round_id",
                            f"round {e.round_id} earned slot changes no frontier-raise line records ({msg}): an "
                            f"interrupted raise; `scoreboard frontier resume --rounds {rounds}` finishes it")
                else:
                    ctx.report.notes.append(f"round {e.round_id} earned slot changes that were never raised "
                                            f"({msg}); later rounds superseded every one")
        for c in e.changes:
            state[c.slot] = c.after


def _check_calibrations(ctx: _Ctx, rounds: Path, trusted: Any, recs: dict[str, _Rec]) -> None:
    """The calibration chain, every sealed record and who sealed it, and every receipt's reference to one."""
    from ..calibrate import verify_problems

    n, problems = verify_problems(rounds, trusted, {rid: rec.receipt for rid, rec in recs.items()}, ctx.judge)
    ctx.report.calibrations = n
    for file, fld, msg in problems:
        ctx.add(file, fld, msg)


def _describe_trust(report: Report, trust: Trust) -> None:
    """The report's one line on signers, and a note per record trusted only as sealed before the pin."""
    pinned = ", ".join(sorted(trust.signers)) or "none"
    signed = ", ".join(f"{n} by {sid}" for sid, n in sorted(report.signed.items())) or "none"
    report.signatures = (f"signers pinned in {trust.source}: {pinned}; records signed by them: {signed}; "
                         f"{len(report.pre_pin)} {PRE_PIN}")
    if trust.problem:
        report.signatures = f"no pinned signers could be read: {trust.problem}"
    if report.pre_pin:
        report.notes.append(f"{len(report.pre_pin)} record(s) {PRE_PIN}, trusted as listed by id and seal in "
                            f"{trust.source} [sealed_before_pin]: {', '.join(report.pre_pin)}")


def verify(lock_path: str | os.PathLike[str] = "reference.lock", rounds_dir: str | os.PathLike[str] = "rounds",
           public_key: str | os.PathLike[str] | None = None) -> Report:
    """Check everything; return a Report (the CLI turns problems into exit 2)."""
    lock_path, rounds = Path(lock_path), Path(rounds_dir)
    report = Report(lock=str(lock_path), rounds=str(rounds))
    trusted = load_public_key(public_key) if public_key else None
    lock: Lock | None = None
    problems: list[str] = []
    try:
        lock = load_lock(lock_path)
    except LockError as exc:
        problems = exc.problems
    trust = Trust.of(lock, lock_path) if lock is not None else Trust.unreadable(f"{lock_path} does not load",
                                                                                  str(lock_path))
    ctx = _Ctx(report, trust)
    for p in problems:
        ctx.add(lock_path, *_split(p))
    recs = _check_receipts(ctx, rounds, trusted)
    entries = _check_ledger(ctx, rounds, recs)
    _check_calibrations(ctx, rounds, trusted, recs)
    if lock is not None:
        _check_slots(ctx, lock_path, rounds, lock, entries, recs)
        _check_raises(ctx, lock, rounds, entries, recs)
    _describe_trust(report, trust)
    if trusted is not None:
        report.signatures += f"; every record must also be signed by {public_key}"
    return report
