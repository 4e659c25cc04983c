"""Where each target stands (the report's first section): per slot its frontier against the reference, and the
target's latest sealed verdict, the targets whose latest verdict is a regression first.

The frontier and the reference's baseline come from the lock's slots (each one backed by a sealed receipt:
`scoreboard verify`, whose findings the report prints beside them); without a lock, from the receipts
themselves: the latest main round's measured values. Only seal-checked receipts are read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from .history.receipt import Receipt
    from .lockfile import Lock, Target

# a target's place in the list by its latest verdict: what needs attention first
RANK = {"regression": 0, "REJECT": 1, "aborted": 2, "inconclusive": 3}


@dataclass(frozen=True)
class SlotStanding:
    metric: str  # e.g. "decode 32 tok @ depth 1024"
    role: str
    slot: str
    frontier: float  # tok/s, 0: none yet
    commit: str  # the frontier's commit ("" when none)
    round_id: str  # the sealed round that measured it
    reference: float | None  # tok/s: the reference's baseline (None: not measured)

    @property
    def ratio(self) -> float | None:
        return self.frontier / self.reference if self.frontier and self.reference else None


@dataclass(frozen=True)
class TargetStanding:
    target: str
    latest: Receipt  # the latest sealed receipt of the target (any candidate)
    slots: tuple[SlotStanding, ...] = field(default_factory=tuple)
    rederived: str | None = None  # the label today's rules re-derive from its raw samples, when not the sealed one

    @property
    def label(self) -> str:
        v = self.latest.verdict
        return v.label if v is not None else "aborted"

    @property
    def rank(self) -> int:
        """Its place by what the record means today: a round sealed as none that re-derives as a regression is
        listed with the regressions."""
        return min(RANK.get(self.label, len(RANK)), RANK.get(self.rederived or "", len(RANK)))


def rederive(r: Receipt) -> str | None:
    """The label `scoreboard tier --receipt` computes for `r` under the policy it recorded, when it differs from
    the sealed one (receipts sealed before a rule existed: a regression sealed as none); None otherwise."""
    from .errors import ScoreboardError
    from .tiers import verdict_from_receipt

    if r.verdict is None:
        return None
    try:
        label = verdict_from_receipt(r).label
    except ScoreboardError:
        return None
    return label if label != r.verdict.label else None


def _from_lock(lock: Lock, t: Target) -> tuple[SlotStanding, ...]:
    from .tiers import metric_name

    out = []
    for m in t.metrics:
        f = lock.slots.get(t.slot(t.candidate_engine, m))
        ref = lock.slots.get(t.slot(t.reference_engine, m))
        out.append(SlotStanding(metric_name(m), m.role, t.slot(t.candidate_engine, m), f.value if f else 0.0,
                                f.commit if f else "", f.round if f else "", ref.value if ref and ref.value else None))
    return tuple(out)


def _from_receipt(r: Receipt) -> tuple[SlotStanding, ...]:
    from .history.receipt import arm_value, metric_label

    out = []
    for m in r.speed.metrics if r.speed else []:
        try:
            cand, ref = arm_value(m, "candidate"), arm_value(m, "reference")
        except ValueError:
            continue
        out.append(SlotStanding(metric_label(m), m.role, m.slot, cand, r.candidate.commit, r.round_id, ref))
    return tuple(out)


def standings(receipts: Sequence[Receipt], lock: Lock | None) -> list[TargetStanding]:
    """One entry per target with a sealed receipt: regressions first, then REJECTs, aborted and inconclusive
    rounds, then the rest; each target's slots in the lock's metric order."""
    latest: dict[str, Receipt] = {}
    latest_main: dict[str, Receipt] = {}
    for r in sorted(receipts, key=lambda r: r.created_at):
        latest[r.target] = r
        if r.candidate.is_main and r.speed:
            latest_main[r.target] = r
    out = []
    for tid, r in latest.items():
        if lock is not None and tid in lock.targets:
            slots = _from_lock(lock, lock.targets[tid])
        else:
            slots = _from_receipt(latest_main[tid]) if tid in latest_main else ()
        out.append(TargetStanding(tid, r, slots, rederive(r)))
    return sorted(out, key=lambda s: (s.rank, s.target))
