"""The box is not what it was: the reference arm of a round against its own baseline slot.

The reference engine is pinned, so its throughput on a box of the same node class should stay put. When
a round's reference arm lands far from the baseline slot (a loaded box, throttling, a noisy neighbour),
every candidate/reference number of that round is suspect even though the paired ratio may look fine.
A warning, never a verdict change: the verdict's basis is paired within the round.
"""

from __future__ import annotations

from typing import Mapping

from .history.receipt import Receipt, arm_value
from .lockfile import Lock, Target


def reference_drift(receipt: Receipt, lock: Lock | None, baselines: Mapping[str, float] | None = None) -> list[str]:
    """One warning per metric whose reference arm is more than speed.reference_drift_max away from the
    baseline slot. `baselines` (slot -> tok/s as read before the round) wins over `lock`'s slots; a slot
    last written by this very round is not its own baseline."""
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
        if baselines is not None:
            base = baselines.get(slot, 0.0)
        else:
            s = lock.slots.get(slot) if lock is not None else None
            base = s.value if s is not None and s.round != receipt.round_id else 0.0
        if not base:
            continue
        try:
            value = arm_value(entry, "reference")
        except ValueError:
            continue
        ratio = value / base
        if abs(ratio - 1.0) > tol:
            out.append(f"reference {m.phase}@{m.depth}: {value:.4g} tok/s is {ratio:.2f}x its baseline slot {slot} "
                       f"({base:.4g} tok/s), beyond speed.reference_drift_max {tol:.0%}: the box is not what it "
                       "was (load, throttling, another tenant); re-run on a quiet box before trusting this round")
    return out
