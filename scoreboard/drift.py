"""The box is not what it was: the reference arm of a round against its own baseline slot.

The reference engine is pinned, so its throughput on a box of the same node class should stay put. When
a round's reference arm lands far from the baseline slot (a loaded box, throttling, a noisy neighbour),
every candidate/reference number of that round is suspect even though the paired ratio may look fine.
Where the verdict's basis is paired within the round (a same-round main or frontier arm) this is a warning:
the box moved both arms alike. Where the basis is the pinned frontier slot (a constant measured on the box as
it was then), nothing cancels the box's state, so scoreboard.tiers makes such a verdict inconclusive from the
receipt's own record of the baseline (`speed.metrics[].baseline`, receipt 1.3): `drift_problem`.
"""

from __future__ import annotations

from typing import Mapping

from .history.receipt import Receipt, SpeedMetric, arm_value
from .lockfile import Lock, Target


def drift_problem(entry: SpeedMetric, baseline: float, tol: float, slot: str) -> str | None:
    """Why `entry`'s reference arm is too far from `baseline` (tok/s; <= 0: no baseline, None), else None."""
    if not baseline or baseline <= 0 or "reference" not in entry.arms:
        return None
    try:
        value = arm_value(entry, "reference")
    except ValueError:
        return None
    ratio = value / baseline
    if abs(ratio - 1.0) <= tol:
        return None
    return (f"reference {entry.phase}@{entry.depth}: {value:.4g} tok/s is {ratio:.2f}x its baseline slot {slot} "
            f"({baseline:.4g} tok/s), beyond speed.reference_drift_max {tol:.0%}: the box is not what it was (load, "
            "throttling, another tenant)")


def reference_drift(receipt: Receipt, lock: Lock | None, baselines: Mapping[str, float] | None = None) -> list[str]:
    """One warning per metric whose reference arm is more than speed.reference_drift_max away from the
    baseline slot: the one the receipt recorded at round start (1.3), else `baselines` (slot -> tok/s as read
    before the round), else `lock`'s slots (a slot last written by this very round is not its own baseline)."""
    if not receipt.speed or receipt.lock_target is None:
        return []
    try:
        target = Target.model_validate(receipt.lock_target)
    except ValueError:
        return []
    tol = target.speed.reference_drift_max
    out = []
    for m in target.metrics:
        entry = next((e for e in receipt.speed.metrics if (e.phase, e.depth, e.n_tokens)
                      == (m.phase, m.depth, m.n_tokens)), None)
        if entry is None or "reference" not in entry.arms:
            continue
        slot = target.slot(target.reference_engine, m)
        if entry.baseline is not None:  # what the round itself read at its start (receipt 1.3)
            base = float(entry.baseline)
        elif baselines is not None:
            base = baselines.get(slot, 0.0)
        else:
            s = lock.slots.get(slot) if lock is not None else None
            base = s.value if s is not None and s.round != receipt.round_id else 0.0
        why = drift_problem(entry, base, tol, slot)
        if why:
            out.append(why + "; re-run on a quiet box before trusting this round")
    return out
