"""Two sealed receipts side by side (`scoreboard compare A B`): per metric and depth, each arm's numbers in A and
in B and B/A with its confidence interval, recomputed from the raw samples; refused when the two are not
measurements of the same thing.

Comparable means the same target definition on the same node class: the target id, its model, quant and node
class, its geometry, and the weights' bytes (every shard's sha256). The first field that differs is named
(pyperf refuses to compare benchmarks whose checked metadata differ, and says which). Blocks of two rounds
are not paired, so B/A's interval resamples each round's block values on its own
(stats.unpaired_ratio_ci); a round with a single block has no interval.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import InputError
from .history.receipt import Receipt, SpeedMetric
from .stats import RatioCI, arm_stats, unpaired_ratio_ci

CONFIDENCE, RESAMPLES = 0.95, 2000


@dataclass(frozen=True)
class ArmPair:
    """One arm of one metric in both receipts (tok/s)."""

    metric: str  # e.g. "decode 32 tok @ depth 1024"
    phase: str
    depth: int
    n_tokens: int
    arm: str
    a_value: float  # geomean of block medians: the estimator the verdict and the slots use
    b_value: float
    a_median: float  # median of all reps: descriptive
    b_median: float
    a_blocks: int
    b_blocks: int
    ratio: RatioCI | None  # B/A; None when either round has fewer than 2 blocks

    def as_dict(self) -> dict[str, Any]:
        r = self.ratio
        return {"metric": self.metric, "phase": self.phase, "depth": self.depth, "n_tokens": self.n_tokens,
                "arm": self.arm, "a_value": self.a_value, "b_value": self.b_value, "a_median": self.a_median,
                "b_median": self.b_median, "a_blocks": self.a_blocks, "b_blocks": self.b_blocks,
                "b_over_a": self.b_value / self.a_value,
                "ci": None if r is None else {"low": r.low, "high": r.high, "confidence": r.confidence,
                                              "method": r.method}}


def _weights(r: Receipt) -> tuple[str, ...]:
    return tuple(sorted(f"{f.path}:{f.sha256}" for f in (r.weights.files if r.weights else [])))


def _fields(r: Receipt) -> dict[str, Any]:
    t = r.lock_target or {}
    return {"target": r.target, "lock_target.node": t.get("node"), "lock_target.model": t.get("model"),
            "lock_target.quant": t.get("quant"), "lock_target.geometry": t.get("geometry"),
            "weights.files[].sha256": _weights(r)}


def comparable_problems(a: Receipt, b: Receipt) -> list[str]:
    """Every field in which A and B are not measurements of the same thing ([]: comparable)."""
    fa, fb = _fields(a), _fields(b)
    out = []
    for k in fa:
        if fa[k] != fb[k]:
            shown = ("different shard hashes" if k.startswith("weights") else f"A has {fa[k]!r}, B has {fb[k]!r}")
            out.append(f"{k}: {shown}")
    for name, r in (("A", a), ("B", b)):
        if not r.speed:
            out.append(f"speed: {name} ({r.round_id}) has no speed numbers ("
                       f"{r.verdict.label if r.verdict else 'aborted'})")
    return out


def _name(m: SpeedMetric) -> str:
    return f"{m.phase} {m.n_tokens} tok @ depth {m.depth}"


def _key(m: SpeedMetric) -> tuple[str, int, int]:
    return (m.phase, m.depth, m.n_tokens)


def _pair(ma: SpeedMetric, mb: SpeedMetric, arm: str, seed: int) -> ArmPair:
    sa = arm_stats([(b.samples_ns, b.n_tokens) for b in ma.arms[arm].blocks])
    sb = arm_stats([(b.samples_ns, b.n_tokens) for b in mb.arms[arm].blocks])
    ratio = None
    if len(sa.block_values) >= 2 and len(sb.block_values) >= 2:
        ratio = unpaired_ratio_ci(sb.block_values, sa.block_values, CONFIDENCE, RESAMPLES, seed)
    return ArmPair(_name(ma), ma.phase, ma.depth, ma.n_tokens, arm, sa.value, sb.value, sa.median, sb.median,
                   len(sa.block_values), len(sb.block_values), ratio)


def compare(a: Receipt, b: Receipt) -> tuple[list[ArmPair], list[str]]:
    """(every arm of every metric both hold, shallow to deep within a phase; the metrics and arms only one
    holds). InputError naming the field when the two are not comparable."""
    problems = comparable_problems(a, b)
    if problems:
        raise InputError(f"not comparable: {problems[0]}" + (f" (and {len(problems) - 1} more: "
                                                              f"{'; '.join(problems[1:])})" if problems[1:] else ""),
                         "compare two sealed receipts of one target on one node class (the same weights and "
                         "geometry); `scoreboard round show ID` shows one")
    assert a.speed is not None and b.speed is not None
    mb = {_key(m): m for m in b.speed.metrics}
    pairs: list[ArmPair] = []
    alone: list[str] = []
    seed = (a.seed * 1_000_003 + b.seed) % 2 ** 31  # reproducible from the two receipts
    for ma in sorted(a.speed.metrics, key=lambda m: (m.phase != "decode", m.phase, m.depth, m.n_tokens)):
        other = mb.pop(_key(ma), None)
        if other is None:
            alone.append(f"{_name(ma)}: only in A")
            continue
        for arm in ma.arms:
            if arm in other.arms:
                pairs.append(_pair(ma, other, arm, seed))
            else:
                alone.append(f"{_name(ma)} arm {arm}: only in A")
        alone += [f"{_name(ma)} arm {arm}: only in B" for arm in other.arms if arm not in ma.arms]
    alone += [f"{_name(m)}: only in B" for m in mb.values()]
    return pairs, alone
