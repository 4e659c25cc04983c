"""Slots in reference.lock written from sealed receipts: raise-only frontiers, re-measured baselines,
and the one logged escape hatch that lowers a frontier.

Rules (docs/receipt-format.md, "Slots"):
- only a sealed receipt recorded under rounds/ with status "verdict", candidate main (clean, with a
  commit), gate passed, verdict not REJECT/inconclusive, not a claim, timed outputs checked, weights
  fully pinned, may write slots;
- frontier slot (candidate engine) of every metric: raised when the sealed value beats it, never lowered;
- baseline slot (reference engine) of every metric: replaced by the same round's reference arm value
  (baselines are re-measured every round on the same box; they are not a high-water mark);
- `lower_frontier` is the explicit hatch: a reason, a sealed main receipt carrying exactly that value
  for that slot, and a ``frontier-lower`` ledger line.
Slot names come only from `Target.slot` (scoreboard.slots.slot_name).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping

from . import ledger
from ..errors import InputError, NonCompliant
from .ledger import SlotChange
from ..lockfile import Lock, Metric, load_lock, set_slot, update_lock
from .receipt import Receipt, arm_reps, arm_value, parse_receipt, receipt_target, scored_metric, utc_now
from .seal import canonical_bytes, sha256_hex, verify_sealed
from .sealed import SealedReceipt

DECIMALS = 4  # slot values are stored rounded to 1e-4 of their unit (tok/s)


def slot_value(x: float) -> float:
    return round(float(x), DECIMALS)


@dataclass(frozen=True)
class Measured:
    """One slot's value as a sealed receipt measured it."""

    slot: str
    kind: Literal["frontier", "baseline"]  # frontier: the candidate arm; baseline: the reference arm
    value: float  # tok/s, rounded by slot_value
    reps: int
    commit: str
    role: str  # the metric's role: "scored" | "guard"


def reference_commit(receipt: Receipt) -> str:
    """What the baseline measured: the reference's git commit, or its sdist pin."""
    ident = receipt.reference.identity or {}
    src = ident.get("source") or {}
    if src.get("commit"):
        return str(src["commit"])
    if src.get("package"):
        return f"{src['package']}=={src.get('version', '?')}@sha256:{str(src.get('sha256', ''))[:12]}"
    return f"{receipt.reference.engine} {ident.get('version', '?')}"


def measured_slots(receipt: Receipt) -> list[Measured]:
    """Every slot value the receipt's speed section measured (no eligibility check)."""
    if not receipt.speed:
        return []
    target = receipt_target(receipt)
    out: list[Measured] = []
    for i, m in enumerate(receipt.speed.metrics):
        metric = Metric(phase=m.phase, depth=m.depth, n_tokens=m.n_tokens, role=m.role)
        cand = target.slot(target.candidate_engine, metric)
        if m.slot != cand:
            raise InputError(f"receipt {receipt.round_id}: speed.metrics[{i}].slot is {m.slot!r} but "
                             f"Target.slot derives {cand!r}; a number measured under one name is never read "
                             "as another")
        out.append(Measured(cand, "frontier", slot_value(arm_value(m, "candidate")), arm_reps(m, "candidate"),
                            receipt.candidate.commit, m.role))
        out.append(Measured(target.slot(target.reference_engine, metric), "baseline",
                            slot_value(arm_value(m, "reference")), arm_reps(m, "reference"),
                            reference_commit(receipt), m.role))
    return out


MOVES_FRONTIER = ("BASELINE", "XS", "S", "M", "L", "XL")


def ineligible(receipt: Receipt, by_verdict: bool = True) -> str | None:
    """Why this (sealed) receipt may not write slots; None when it may. `by_verdict` False leaves out the rule
    on its verdict's label (a re-base writes slots from a round scored against a pinned slot: history.rebase)."""
    v, gate, cand, env = receipt.verdict, receipt.gate, receipt.candidate, receipt.environment
    label = v.label if v else None
    harness = (env.model_extra or {}).get("harness") or {}
    checks = [
        (receipt.status != "verdict", f"the round {receipt.status}"),
        (bool(v and v.claim), "a claim never moves a slot"),
        (not cand.is_main, f"the candidate is {cand.label!r}, not main"),
        (cand.dirty or not cand.commit, "main had uncommitted changes or no commit"),
        (harness.get("dirty") is True, "the harness (scoreboard/) that measured had uncommitted changes"),
        # receipts from before the sandbox have no isolation record; every later round writes one
        ((env.isolation or {"tool": "bwrap"}).get("tool") != "bwrap",
         "the candidate's workers ran without the sandbox (isolation: none)"),
        (not (gate and gate.pass_), "the correctness gate did not pass"),
        (by_verdict and label not in MOVES_FRONTIER,
         f"verdict is {label}: only BASELINE or a significant tier moves a slot (noise must not ratchet it)"),
        (not receipt.speed, "no speed numbers"),
        (not all(m.timed_output_ok for m in (receipt.speed.metrics if receipt.speed else [])),
         "timed outputs did not match the checked run"),
        (not (receipt.weights and receipt.weights.fully_pinned), "weights are not fully pinned"),
        (receipt.calibration is not None and receipt.calibration.status == "skipped",
         "the round ran without a calibration of the target's bars (a test round)"),
    ]
    return next((why for bad, why in checks if bad), None)


def plan(lock: Lock, receipt: Receipt, values: Mapping[str, float] | None = None) -> list[SlotChange]:
    """The slot changes this sealed receipt earns against `lock` (pure; [] when ineligible), or against
    `values` (slot -> value, e.g. the state a ledger replay reached) when given."""
    if ineligible(receipt):
        return []
    expected = lock.expected_slots()
    changes = []
    for m in measured_slots(receipt):
        if m.slot not in expected:
            raise InputError(f"reference.lock no longer defines slot {m.slot} (round {receipt.round_id})",
                             f"the metrics of target {receipt.target!r} changed since the round; re-run it")
        current = lock.slots.get(m.slot)
        before = values.get(m.slot, 0.0) if values is not None else (current.value if current else 0.0)
        better = m.value > before if m.kind == "frontier" else m.value != before
        if better:
            changes.append(SlotChange(slot=m.slot, kind=m.kind, before=before, after=m.value, reps=m.reps,
                                      commit=m.commit))
    return changes


def late_plan(lock: Lock, receipt: Receipt, values: Mapping[str, float],
              later: list[ledger.LedgerEntry]) -> list[SlotChange]:
    """The slot changes a receipt still earns when its raise is written after `later` lines (an interrupted raise,
    or a receipt re-chained late): frontiers it beats in `values` (the ledger's state now) unless a later line
    lowered them (a lowering is deliberate: an older measurement never undoes it), and baselines only where no
    later line re-measured them (an older reference measurement never replaces a newer one)."""
    written = {c.slot for e in later for c in e.changes}
    lowered = {c.slot for e in later if e.kind == "frontier-lower" for c in e.changes}
    return [c for c in plan(lock, receipt, values)
            if (c.kind == "frontier" and c.slot not in lowered) or (c.kind == "baseline" and c.slot not in written)]


def apply(lock_path: str | os.PathLike[str], changes: list[SlotChange], receipt: Receipt,
          reason: str = "", verb: str = "lowered") -> None:
    """Write `changes` into the lock (comment-preserving, atomic). Refuses when a slot moved since planning.
    `reason` (a logged hatch's) goes into each slot's comment after `verb`."""
    if not changes:
        return

    def edit(doc: Any) -> None:
        slots = doc.get("slots") or {}
        for c in changes:
            now = float(slots[c.slot]["value"]) if c.slot in slots else 0.0
            if now != c.before and now != c.after:
                raise NonCompliant(f"slots.{c.slot}: is {now}, expected {c.before} (changed concurrently?)",
                                   "run `scoreboard verify`")
            note = f"{c.kind} {c.before} -> {c.after} by round {receipt.round_id}"
            set_slot(doc, c.slot, {"value": c.after, "unit": "tok/s", "kind": c.kind, "reps": c.reps,
                                   "round": receipt.round_id, "commit": c.commit,
                                   "measured_at": receipt.created_at},
                     comment=note + (f" ({verb}: {reason})" if reason else ""))

    update_lock(lock_path, edit)


def recorded_receipt(receipt: Mapping[str, Any] | str | os.PathLike[str],
                     rounds_dir: str | os.PathLike[str]) -> SealedReceipt:
    """The receipt as recorded under rounds_dir: sealed, unedited, identical to what the caller holds."""
    import json

    if isinstance(receipt, Mapping):
        rid = receipt.get("round_id")
        held: Mapping[str, Any] | None = receipt
    else:
        held, rid = None, Path(receipt).stem
    path = Path(rounds_dir) / f"{rid}.json"
    if not path.is_file():
        raise NonCompliant(f"{path}: no recorded receipt for round {rid}",
                           "only a sealed receipt recorded under rounds/ is a measurement; others are claims")
    raw = path.read_bytes()
    data = json.loads(raw)
    verify_sealed(data, str(path))
    if held is not None and canonical_bytes(dict(held)) != canonical_bytes(data):
        raise NonCompliant(f"{path}: differs from the receipt passed in", "pass the recorded file itself")
    if not isinstance(receipt, Mapping) and Path(receipt).resolve() != path.resolve():
        other = json.loads(Path(receipt).read_bytes())
        if canonical_bytes(other) != canonical_bytes(data):
            raise NonCompliant(f"{receipt}: differs from the recorded {path}", "pass the recorded file itself")
    return SealedReceipt(path, data, parse_receipt(data, str(path)), sha256_hex(raw))


def _slot_entry(kind: str, data: Receipt, path: Path, changes: list[SlotChange],
                lock: Lock | None, reason: str = "", values: Mapping[str, float] | None = None,
                date: str | None = None) -> dict[str, Any]:
    """A ``frontier-raise`` / ``frontier-lower`` / ``frontier-rebase`` ledger line (prev_sha256 filled in by
    ledger.append). `slot`/`value`/`frontier_*` name the scored slot on a raise or a re-base and the lowered slot
    on a lowering.
    `values`/`date`: the slot state and time the line was (re)written at (default: the lock, now)."""
    scored = kind in ("frontier-raise", "frontier-rebase")  # lines about a round's scored slot; a lowering names its own
    slot = scored_slot(data) if scored else changes[0].slot
    if values is not None:
        before = values.get(slot, 0.0)
    else:
        before = lock.slots[slot].value if lock is not None and slot in lock.slots else 0.0
    after = next((c.after for c in changes if c.slot == slot), before)
    value = scored_value(data) if scored else changes[0].after
    return {"kind": kind, "round_id": data.round_id, "date": date or utc_now(), "target": data.target,
            "status": data.status, "candidate_commit": data.candidate.commit,
            "is_main": data.candidate.is_main, "verdict": _label(data),
            "value": value, "slot": slot, "frontier_before": before, "frontier_after": after,
            "changes": [c.model_dump() for c in changes], "reason": reason,
            "receipt_sha256": sha256_hex(path.read_bytes()), "seal_sha256": _seal_sha256(data)}


def _label(data: Receipt) -> str:
    """The verdict label a ledger line records ("aborted" for a round without a verdict)."""
    return data.verdict.label if data.verdict else "aborted"


def _seal_sha256(data: Receipt) -> str:
    if data.seal is None:
        raise NonCompliant(f"receipt {data.round_id}: not sealed", "only a sealed receipt writes a ledger line")
    return data.seal.sha256


def _on_ledger(entries: list[ledger.LedgerEntry], rec: SealedReceipt) -> None:
    rid = rec.receipt.round_id
    if not any(ledger.is_round(e) and e.round_id == rid and e.receipt_sha256 == rec.file_sha256 for e in entries):
        raise NonCompliant(f"{rec.path}: round {rid} has no ledger line",
                           f"finish the round with `scoreboard frontier resume --receipt {rec.path}`")


def _record_and_apply(kind: str, lock_path: str | os.PathLike[str], rounds_dir: str | os.PathLike[str],
                      data: Receipt, path: Path, changes: list[SlotChange], reason: str = "") -> None:
    """Append the ledger line for `changes` (unless the ledger already holds exactly these, from an
    interrupted earlier call), then write the lock: the ledger is never behind the lock."""
    entries = ledger.read_entries(rounds_dir)
    last = ledger.last_changes(entries)
    pending = [c for c in changes
               if not (c.slot in last and last[c.slot][0].round_id == data.round_id
                       and last[c.slot][0].kind == kind and last[c.slot][1].after == c.after)]
    if pending:
        ledger.append(rounds_dir, _slot_entry(kind, data, path, pending, load_lock(lock_path), reason))
    apply(lock_path, changes, data, reason, "re-based" if kind == "frontier-rebase" else "lowered")


def raise_frontier(lock_path: str | os.PathLike[str], receipt: Mapping[str, Any] | str | os.PathLike[str],
                   rounds_dir: str | os.PathLike[str]) -> list[SlotChange]:
    """Raise frontier slots (and replace baselines) from a sealed, recorded main receipt; never lower.

    The receipt must be the file under rounds_dir, sealed and on the ledger (`records.write_receipt`).
    Returns the changes written ([] when ineligible or nothing was beaten); they are logged as one
    ``frontier-raise`` ledger line before the lock is written. Idempotent: calling it again finishes
    an interrupted call and otherwise changes nothing.
    """
    with ledger.exclusive(rounds_dir):
        rec = recorded_receipt(receipt, rounds_dir)
        _on_ledger(ledger.read_entries(rounds_dir), rec)
        changes = plan(load_lock(lock_path), rec.receipt)
        if changes:
            _record_and_apply("frontier-raise", lock_path, rounds_dir, rec.receipt, rec.path, changes)
    return changes


def lower_frontier(lock_path: str | os.PathLike[str], slot: str, value: float, reason: str,
                   receipt_path: str | os.PathLike[str], rounds_dir: str | os.PathLike[str] = "rounds",
                   target: str | None = None) -> SlotChange:
    """The escape hatch: lower a frontier slot to a value a sealed main receipt measured for it, logged
    as a ``frontier-lower`` ledger line carrying the reason."""
    if not reason or not reason.strip():
        raise InputError("lowering a frontier needs --reason (a slower replacement box, a real regression on main)")
    with ledger.exclusive(rounds_dir):
        rec = recorded_receipt(receipt_path, rounds_dir)
        data, path = rec.receipt, rec.path
        _on_ledger(ledger.read_entries(rounds_dir), rec)
        if target is not None and data.target != target:
            raise InputError(f"{path}: round is for target {data.target!r}, not {target!r}")
        why = lower_refusal(data)
        if why:
            raise InputError(f"{path}: cannot lower from this receipt: {why}")
        lock = load_lock(lock_path)
        t = lock.target(data.target)
        names = {t.slot(t.candidate_engine, m) for m in t.metrics}
        if slot not in names:
            raise InputError(f"slot {slot!r} is not a frontier slot of target {data.target!r}",
                             f"frontier slots: {', '.join(sorted(names))}")
        m = next((x for x in measured_slots(data) if x.slot == slot and x.kind == "frontier"), None)
        if m is None or m.value != slot_value(value):
            got = "nothing" if m is None else m.value
            raise InputError(f"{path}: measured {got} for {slot}, not {slot_value(value)}",
                             "pass the value exactly as the sealed receipt measured it")
        before = lock.slots[slot].value if slot in lock.slots else 0.0
        if m.value >= before:
            raise InputError(f"slots.{slot}: {m.value} is not below the frontier {before}; nothing to lower",
                             "a sealed main round raises the frontier by itself")
        change = SlotChange(slot=slot, kind="frontier", before=before, after=m.value, reps=m.reps, commit=m.commit)
        _record_and_apply("frontier-lower", lock_path, rounds_dir, data, path, [change], reason.strip())
    return change


def lower_refusal(data: Receipt) -> str | None:
    """A lowering needs main's sealed measurement with a passed gate (its verdict may be REJECT by a
    guard: that is exactly the regression the hatch exists for)."""
    cand = data.candidate
    if data.status != "verdict" or not data.speed:
        return "the round has no speed numbers"
    if not cand.is_main or cand.dirty or not cand.commit:
        return "not measured on a clean main"
    if not (data.gate and data.gate.pass_):
        return "the correctness gate did not pass"
    if data.verdict and data.verdict.claim:
        return "it is a claim"
    if not (data.weights and data.weights.fully_pinned):
        return "weights are not fully pinned"
    return None


def scored_slot(receipt: Receipt) -> str:
    """The scored candidate slot name, derived via Target.slot ("" when the receipt has no target table)."""
    if not receipt.lock_target:
        return ""
    t = receipt_target(receipt)
    return t.slot(t.candidate_engine, t.scored)


def scored_value(receipt: Receipt) -> float | None:
    m = scored_metric(receipt)
    return slot_value(arm_value(m, "candidate")) if m else None
