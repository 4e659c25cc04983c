"""Correctness gate math: full-vocabulary KL(ref||cand) in float64, top-1, per-depth verdicts, ratchet.

Pure functions on arrays; the round collects logits from the engines and calls these.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from .lockfile import GatePolicy


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax over the last axis with max subtraction. [rows, vocab] -> [rows, vocab]."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    z = x - m
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def kl_rows(ref_logits: np.ndarray, cand_logits: np.ndarray) -> np.ndarray:
    """KL(ref || cand) per row, nats, over the FULL vocabulary (no top-k truncation). -> [rows]."""
    if ref_logits.shape != cand_logits.shape:
        raise ValueError(f"logits shapes differ: reference {ref_logits.shape} vs candidate {cand_logits.shape}")
    lp = log_softmax64(ref_logits)
    lq = log_softmax64(cand_logits)
    p = np.exp(lp)
    kl = (p * (lp - lq)).sum(axis=-1)
    return np.maximum(kl, 0.0)  # clamp -1e-17 rounding


def top1_agreement(ref_logits: np.ndarray, cand_logits: np.ndarray) -> np.ndarray:
    """Per row: 1.0 where argmax agrees, else 0.0. -> [rows]."""
    return (np.argmax(ref_logits, axis=-1) == np.argmax(cand_logits, axis=-1)).astype(np.float64)


@dataclass
class DepthResult:
    depth: int
    rows: int
    positions: list[int]
    kl_mean: float
    kl_p99: float
    kl_max: float
    top1: float
    ratchet_baseline: float | None = None
    ratchet_ok: bool = True
    passed: bool = True
    flagged: bool = False
    reasons: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["pass"] = d.pop("passed")
        return d


def top1_ok(top1: float, policy: GatePolicy) -> bool:
    """The top-1 bar, for logits rows and for checked outputs alike (inclusive)."""
    return top1 >= policy.top1_min


def ratchet_exceeded(kl_mean: float, baseline: float | None, policy: GatePolicy) -> bool:
    """More than ratchet_ratio x main's last sealed KL at this depth, and above the ratchet's noise floor."""
    return baseline is not None and baseline > 0 and kl_mean > policy.ratchet_ratio * baseline and \
        kl_mean > policy.ratchet_floor


def bar_reasons(depth: int, kl_mean: float, kl_p99: float, top1: float, baseline: float | None,
                policy: GatePolicy) -> list[str]:
    """The gate's pass rule for one depth: every bar it breaks, worded once for the round and the verdict."""
    at = f"gate depth {depth}"
    out = []
    if kl_mean > policy.kl_max:
        out.append(f"{at}: KL mean {kl_mean:.4g} > kl_max {policy.kl_max:g} nats")
    if kl_p99 > policy.kl_p99_max:
        out.append(f"{at}: KL p99 {kl_p99:.4g} > kl_p99_max {policy.kl_p99_max:g} nats")
    if not top1_ok(top1, policy):
        out.append(f"{at}: top-1 agreement {top1:.4g} < top1_min {policy.top1_min:g}")
    if ratchet_exceeded(kl_mean, baseline, policy):
        out.append(f"{at}: KL mean {kl_mean:.4g} > {policy.ratchet_ratio:g} x main's sealed {baseline:.4g} (ratchet)")
    return out


def grade_depth(depth: int, positions: list[int], ref: np.ndarray, cand: np.ndarray, policy: GatePolicy,
                ratchet_baseline: float | None = None) -> DepthResult:
    """Grade one depth's rows against the bars and the per-depth ratchet (main's last sealed KL)."""
    kl = kl_rows(ref, cand)
    t1 = top1_agreement(ref, cand)
    r = DepthResult(depth=depth, rows=int(kl.size), positions=[int(p) for p in positions],
                    kl_mean=float(kl.mean()), kl_p99=float(np.percentile(kl, 99)), kl_max=float(kl.max()),
                    top1=float(t1.mean()), ratchet_baseline=ratchet_baseline)
    r.reasons = bar_reasons(depth, r.kl_mean, r.kl_p99, r.top1, ratchet_baseline, policy)
    r.ratchet_ok = not ratchet_exceeded(r.kl_mean, ratchet_baseline, policy)
    r.passed = not r.reasons
    r.flagged = r.passed and r.kl_mean > policy.kl_prefer
    return r


@dataclass
class GateResult:
    depths: list[DepthResult]

    @property
    def passed(self) -> bool:
        return all(d.passed for d in self.depths)

    @property
    def flagged(self) -> bool:
        return any(d.flagged for d in self.depths)

    @property
    def reasons(self) -> list[str]:
        return [r for d in self.depths for r in d.reasons]

    def worst(self) -> dict[str, float]:
        """Aggregate by the worst depth: a deep regression cannot hide behind good shallow probes."""
        return {"kl_mean": max(d.kl_mean for d in self.depths), "kl_p99": max(d.kl_p99 for d in self.depths),
                "kl_max": max(d.kl_max for d in self.depths), "top1": min(d.top1 for d in self.depths)}

    def as_dict(self) -> dict:
        return {"depths": [d.as_dict() for d in self.depths], "worst": self.worst(), "pass": self.passed,
                "flagged": self.flagged, "reasons": self.reasons}


def gate_positions(depth: int, rows: int) -> list[int]:
    """`rows` consecutive positions ending at the depth: the rows' contexts are depth-rows+1 .. depth tokens.

    Position p's row is the next-token distribution after consuming tokens[0..p], so the last row has
    exactly `depth` tokens of context — the scored depth itself is graded.
    """
    if rows > depth:
        raise ValueError(f"cannot take {rows} rows at depth {depth}")
    return list(range(depth - rows, depth))
