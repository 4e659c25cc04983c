"""Re-base a frontier whose commit this harness cannot run, from a sealed main receipt: the logged step
that replaces a by-hand edit when a main round can only be scored against a pinned slot.

Why it exists: a main round re-measures the commit that set the scored frontier, in the same round on the
same box (round/run.py, the "frontier" arm). A commit written against an older engine contract cannot run
under this harness's worker, so its rounds fall back to the slot itself: a constant measured on whatever
box set it. From then on no main round on another box can be scored fairly (a slower box reads as a
regression, a faster one as a gain), and a raise-only frontier never moves to a commit that could be
re-measured. `rebase_frontier` sets every frontier slot of the target whose commit cannot be re-measured,
and the target's baselines, to what one sealed, gate-passing main receipt measured, either direction; the
next main round then re-measures that receipt's commit beside itself.

Rules (each refusal names the receipt or slot and the next command; nothing is written on a refusal):
- the receipt is recorded under rounds/, sealed and on the ledger, of the target named;
- `rebase_refusal`: a clean main, the gate passed, its timed outputs matched the checked run, its samples are
  a measurement (no zero-variance or implausible arm), weights fully pinned, the sandbox on, a calibrated
  round, not a claim, and the round itself could not re-measure the frontier (no "frontier" arm);
- every slot it re-bases still holds the value that round was judged against (its `frontier` at round
  start): a slot moved since by another line is not re-based from an older round;
- the caller's `unmeasurable(commit)` says why that slot's commit cannot run here (None: it can, and a
  main round re-measures it: refused, `frontier lower` is the hatch for a real regression);
- a reason; the change is one ``frontier-rebase`` ledger line (its reason carries the finding), written
  before the lock, like ``frontier-lower``. `scoreboard verify` re-checks the receipt side (`line_refusal`).
"""

from __future__ import annotations

import os
from typing import Callable

from . import ledger
from ..errors import InputError
from .frontier import _on_ledger, _record_and_apply, ineligible, lower_refusal, measured_slots, recorded_receipt
from .ledger import SlotChange
from ..lockfile import load_lock
from .receipt import Receipt

KIND = "frontier-rebase"


def rebase_refusal(data: Receipt) -> str | None:
    """Why this sealed receipt may not re-base a frontier (None: it may). Everything `ineligible` asks of a
    slot-writing receipt except its verdict (a pinned-slot round is none, regression or inconclusive by
    construction), plus: the round did not re-measure the frontier's commit itself."""
    why = lower_refusal(data)
    if why:
        return why
    why = ineligible(data, by_verdict=False)
    if why:
        return why
    assert data.speed is not None  # lower_refusal: the round has speed numbers
    if data.speed.frontier_arm is not None or any("frontier" in m.arms for m in data.speed.metrics):
        return ("the round re-measured the frontier's commit in the same round: its verdict already has a sound "
                "basis, nothing to re-base")
    bad = _not_a_measurement(data)
    return f"its samples are no measurement ({bad})" if bad else None


def _not_a_measurement(data: Receipt) -> str:
    """Zero-variance or implausible candidate/reference samples in any metric ('' when none)."""
    from ..tiers import metric_name, zero_variance
    from ..lockfile import Metric

    for m in data.speed.metrics if data.speed else []:
        name = metric_name(Metric(phase=m.phase, depth=m.depth, n_tokens=m.n_tokens, role=m.role))
        zero = zero_variance(m.arms, name)
        if zero:
            return zero[0]
        if m.plausible is False:
            return f"{name}: an arm beat the physical ceiling"
    return ""


def line_refusal(data: Receipt, changes: list[SlotChange]) -> str | None:
    """What `scoreboard verify` re-checks of a ``frontier-rebase`` line from its receipt alone: the receipt may
    re-base (`rebase_refusal`), and every frontier slot it changed was at the value that round read at its start."""
    why = rebase_refusal(data)
    if why:
        return why
    at_start = {m.slot: float(m.frontier or 0.0) for m in data.speed.metrics} if data.speed else {}
    for c in changes:
        if c.kind == "frontier" and at_start.get(c.slot) != c.before:
            return (f"{c.slot} was {c.before} before the re-base, but round {data.round_id} was judged against "
                    f"{at_start.get(c.slot)}")
    return None


def plan_rebase(data: Receipt, lock_path: str | os.PathLike[str],
                unmeasurable: Callable[[str], str | None]) -> tuple[list[SlotChange], list[str]]:
    """(the slot changes, the findings: why each re-based slot's commit cannot run here). InputError when a
    frontier slot of the target can still be re-measured, or moved since the round, or nothing would change."""
    lock = load_lock(lock_path)
    lock.target(data.target)  # an unknown target names the lock's targets
    at_start = {m.slot: float(m.frontier or 0.0) for m in data.speed.metrics} if data.speed else {}
    changes: list[SlotChange] = []
    findings: list[str] = []
    for m in measured_slots(data):
        current = lock.slots.get(m.slot)
        before = current.value if current else 0.0
        if m.kind == "frontier":
            if not before:
                continue  # nothing pinned: a main round sets the BASELINE itself
            assert current is not None
            why = unmeasurable(current.commit)
            if why is None:
                raise InputError(f"slots.{m.slot}: its commit {current.commit[:12]} can be re-measured by this "
                                 "harness, so a main round scores against it in the same round; a re-base is only "
                                 "for a commit that cannot run here",
                                 "run `scoreboard round run` on main; for a real regression on main, "
                                 "`scoreboard frontier lower` from its sealed receipt")
            if at_start.get(m.slot) != before:
                raise InputError(f"slots.{m.slot} is {before} but round {data.round_id} was judged against "
                                 f"{at_start.get(m.slot)}: the slot moved since that round",
                                 "re-base from a sealed main round run after the last change of the slot")
            findings.append(f"{m.slot} at {current.commit[:12]}: {why}")
        if m.value != before:
            changes.append(SlotChange(slot=m.slot, kind=m.kind, before=before, after=m.value, reps=m.reps,
                                      commit=m.commit))
    if not findings:
        raise InputError(f"target {data.target!r} has no pinned frontier slot to re-base",
                         "a main round sets the BASELINE by itself: `scoreboard round run`")
    if not any(c.kind == "frontier" for c in changes):
        raise InputError(f"round {data.round_id} measured exactly the pinned frontier slots: nothing to re-base",
                         "the slots already hold what it measured: `scoreboard frontier show`")
    return changes, findings


def rebase_frontier(lock_path: str | os.PathLike[str], receipt_path: str | os.PathLike[str], reason: str,
                    rounds_dir: str | os.PathLike[str], target: str,
                    unmeasurable: Callable[[str], str | None]) -> list[SlotChange]:
    """Re-base target `target`'s frontier slots whose commits cannot be re-measured (and its baselines) to what
    the sealed main receipt at `receipt_path` measured; one ``frontier-rebase`` ledger line, then the lock.
    `unmeasurable(commit)`: why that commit cannot run under this harness, or None when it can."""
    if not reason or not reason.strip():
        raise InputError("a re-base needs --reason (e.g. 'frontier commit speaks engine contract 1; new box')",
                         f"scoreboard frontier rebase --target {target} --receipt {receipt_path} --reason TEXT")
    with ledger.exclusive(rounds_dir):
        rec = recorded_receipt(receipt_path, rounds_dir)
        data, path = rec.receipt, rec.path
        _on_ledger(ledger.read_entries(rounds_dir), rec)
        if data.target != target:
            raise InputError(f"{path}: round is for target {data.target!r}, not {target!r}",
                             f"pass --target {data.target}, or a receipt of {target}")
        why = rebase_refusal(data)
        if why:
            raise InputError(f"{path}: cannot re-base from this receipt: {why}",
                             f"re-base from a sealed main round of {target}: `scoreboard round run --target {target}`")
        changes, findings = plan_rebase(data, lock_path, unmeasurable)
        note = f"{reason.strip()} (not re-measurable here: {'; '.join(findings)})"
        _record_and_apply(KIND, lock_path, rounds_dir, data, path, changes, note)
    return changes
