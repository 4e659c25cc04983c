"""Speed statistics: per-arm summaries and bootstrap ratio intervals over paired blocks (pure, no I/O).

Units: samples are nanoseconds per rep, token counts are tokens per rep, throughputs are tok/s.
A *block* is one interleaved slot of the schedule; its value is the median rep throughput in it.
Ratios are estimated on the log scale: point = exp(mean(log(c_i / b_i))), the geometric mean of the
per-block ratios, which equals geomean(c) / geomean(b) — so the ratio of the arms' summary values
(`geometric_mean` of their block values) is exactly the point ratio.
"""

from __future__ import annotations

import inspect
import math
import warnings
from dataclasses import dataclass
from typing import Sequence, cast

import numpy as np


def _bootstrap():
    """scipy.stats.bootstrap and its seeding keyword, imported on first use (scipy costs ~1 s to import).

    scipy >= 1.15 takes `rng=`; older releases only `random_state=` (both accept a numpy Generator).
    """
    from scipy import stats as st

    kw = "rng" if "rng" in inspect.signature(st.bootstrap).parameters else "random_state"
    return st.bootstrap, kw

# a block as recorded in a receipt: (samples_ns per rep, n_tokens per rep)
Block = tuple[Sequence[int | float], Sequence[int | float]]


def rep_throughput(ns: float, n_tokens: float) -> float:
    """tok/s of one rep: n_tokens / (ns / 1e9). Refuses non-positive times (a rep cannot take 0 ns)."""
    if not ns > 0:
        raise ValueError(f"a rep's time must be > 0 ns, got {ns!r}")
    if n_tokens < 0:
        raise ValueError(f"a rep's token count must be >= 0, got {n_tokens!r}")
    return float(n_tokens) / (float(ns) / 1e9)


def block_value(samples_ns: Sequence[float], n_tokens: Sequence[float]) -> float:
    """Median rep throughput (tok/s) within one block."""
    if len(samples_ns) != len(n_tokens):
        raise ValueError(f"samples_ns has {len(samples_ns)} reps but n_tokens has {len(n_tokens)}")
    if not samples_ns:
        raise ValueError("a block needs at least one rep")
    return float(np.median([rep_throughput(ns, n) for ns, n in zip(samples_ns, n_tokens)]))


def geometric_mean(values: Sequence[float]) -> float:
    """exp(mean(log x)) of positive values: an arm's summary value over its block values."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0 or np.any(~(x > 0)):
        raise ValueError("geometric mean needs at least one value, all > 0")
    return float(np.exp(np.mean(np.log(x))))


@dataclass(frozen=True)
class ArmStats:
    """Descriptive statistics of one arm's rep throughputs (tok/s) pooled over its blocks."""

    median: float  # tok/s, over all reps
    mad: float  # tok/s, median absolute deviation from the median (unscaled)
    cv: float  # sample std (ddof=1) / mean; 0 for a single rep or a constant arm
    n: int  # reps
    block_values: tuple[float, ...]  # tok/s, median rep throughput per block, schedule order
    value: float  # tok/s, geometric mean of block_values: the arm's summary number

    def as_dict(self) -> dict[str, object]:
        return {"median": self.median, "mad": self.mad, "cv": self.cv, "n": self.n,
                "block_values": list(self.block_values), "value": self.value}


def arm_stats(blocks: Sequence[Block]) -> ArmStats:
    """Summarize an arm from its raw blocks [(samples_ns, n_tokens), ...]."""
    if not blocks:
        raise ValueError("an arm needs at least one block")
    reps = np.array([rep_throughput(ns, n) for ns_list, n_list in blocks
                     for ns, n in _pairs(ns_list, n_list)], dtype=np.float64)
    med = float(np.median(reps))
    mad = float(np.median(np.abs(reps - med)))
    mean = float(np.mean(reps))
    spread = float(np.std(reps, ddof=1)) if reps.size > 1 and np.ptp(reps) > 0 else 0.0
    cv = spread / mean if mean > 0 and spread > 0 else 0.0
    values = tuple(block_value(ns, n) for ns, n in blocks)
    return ArmStats(median=med, mad=mad, cv=cv, n=int(reps.size), block_values=values,
                    value=geometric_mean(values))


def _pairs(ns_list: Sequence[float], n_list: Sequence[float]):
    if len(ns_list) != len(n_list):
        raise ValueError(f"samples_ns has {len(ns_list)} reps but n_tokens has {len(n_list)}")
    return zip(ns_list, n_list)


@dataclass(frozen=True)
class RatioCI:
    """A ratio candidate/basis with a bootstrap confidence interval over blocks."""

    point: float  # geometric mean of per-block ratios
    low: float
    high: float
    confidence: float  # e.g. 0.95
    n_blocks: int
    method: str  # "BCa" | "percentile" (fallback when BCa is degenerate), "+t-floor" when the t-interval was wider

    @property
    def width(self) -> float:
        return self.high - self.low


def _log_ratios(candidate: Sequence[float], basis: Sequence[float]) -> np.ndarray:
    c = np.asarray(candidate, dtype=np.float64)
    b = np.asarray(basis, dtype=np.float64)
    if c.shape != b.shape:
        raise ValueError(f"paired blocks differ in count: candidate {c.size}, basis {b.size}")
    if c.ndim != 1 or c.size < 2:
        raise ValueError(f"a confidence interval needs at least 2 paired blocks, got {c.size}")
    if np.any(~(c > 0)) or np.any(~(b > 0)) or not (np.all(np.isfinite(c)) and np.all(np.isfinite(b))):
        raise ValueError("block values must be finite and > 0")
    # rounded to 1e-12 (a relative 1e-12 on the ratio): inputs equal up to float rounding (the same arms
    # in other units, swapped arms) give bit-identical intervals instead of BCa tie-breaking on ulps
    return np.round(np.log(c) - np.log(b), _DIGITS)


_DIGITS = 12


def _mean(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Resample means on the same 1e-12 grid: equal multisets in another order tie exactly (BCa's bias term)."""
    return cast(np.ndarray, np.round(np.mean(x, axis=axis), _DIGITS))  # a scalar only when `x` is 1-D


def _bootstrap_mean(logs: np.ndarray, confidence: float, resamples: int, seed: int) -> tuple[float, float, str]:
    """CI of mean(logs); BCa, falling back to percentile when BCa is degenerate (NaN)."""
    if np.ptp(logs) == 0.0:  # identical ratios: every resample has the same mean
        m = float(_mean(logs))
        return m, m, "percentile"
    for method in ("BCa", "percentile"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DegenerateDataWarning: handled by the fallback
            bootstrap, rng_kw = _bootstrap()
            res = bootstrap((logs,), _mean, n_resamples=resamples, confidence_level=confidence,
                                method=method, vectorized=True, axis=-1, **{rng_kw: np.random.default_rng(seed)})
        lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
        if math.isfinite(lo) and math.isfinite(hi):
            return lo, hi, method
    raise ValueError("bootstrap produced no finite interval")  # pragma: no cover - percentile is finite


def _t_interval(logs: np.ndarray, confidence: float) -> tuple[float, float]:
    """Student-t interval of mean(logs) with n-1 degrees of freedom.

    The bootstrap is anti-conservative with few blocks (it cannot see more spread than the handful of
    values it resamples: an A/A round on a noisy 2-core box gave a +4.5% "S" from 4 blocks); the
    t-interval is the floor on the CI's width. For many blocks the two agree.
    """
    from scipy.stats import t

    n = logs.size
    m = float(_mean(logs))
    sd = float(np.std(logs, ddof=1))
    half = float(t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
    return m - half, m + half


def paired_ratio_ci(candidate_blocks: Sequence[float], basis_blocks: Sequence[float], confidence: float = 0.95,
                    resamples: int = 2000, seed: int = 0) -> RatioCI:
    """Ratio candidate/basis over paired block values (tok/s): geometric-mean point, bootstrap CI
    floored by the Student-t interval (whichever is wider).

    Resamples whole blocks (pairs stay together); `seed` makes the interval reproducible.
    """
    logs = _log_ratios(candidate_blocks, basis_blocks)
    lo, hi, method = _bootstrap_mean(logs, confidence, resamples, seed)
    t_lo, t_hi = _t_interval(logs, confidence)
    if t_lo < lo or t_hi > hi:  # the wider of the two: never narrower than the t-interval
        lo, hi, method = min(lo, t_lo), max(hi, t_hi), f"{method}+t-floor"
    point = float(np.exp(_mean(logs)))
    # exp is monotone: the log-scale interval maps to the ratio scale; clamp float noise around the point
    return RatioCI(point=point, low=min(math.exp(lo), point), high=max(math.exp(hi), point),
                   confidence=confidence, n_blocks=int(logs.size), method=method)


def ci_vs_constant(candidate_blocks: Sequence[float], constant: float, confidence: float = 0.95,
                   resamples: int = 2000, seed: int = 0) -> RatioCI:
    """Ratio candidate/constant (a pinned frontier slot): only the candidate's block noise is in the CI."""
    if not constant > 0 or not math.isfinite(constant):
        raise ValueError(f"the constant basis must be finite and > 0, got {constant!r}")
    return paired_ratio_ci(candidate_blocks, [constant] * len(candidate_blocks), confidence, resamples, seed)


def suggest_blocks(current_blocks: int, current_width: float, target_width: float) -> int:
    """Total blocks expected to shrink a CI from current_width to target_width: ceil(n * (w / target)^2).

    CI width scales ~ 1/sqrt(n). Never fewer than current_blocks + 1 when the CI is too wide.
    """
    if current_blocks < 1 or not target_width > 0 or current_width < 0:
        raise ValueError("need current_blocks >= 1, current_width >= 0 and target_width > 0")
    if current_width <= target_width:
        return current_blocks
    need = math.ceil(current_blocks * (current_width / target_width) ** 2 - 1e-9)
    return max(need, current_blocks + 1)


def unpaired_ratio_ci(numer_blocks: Sequence[float], denom_blocks: Sequence[float], confidence: float = 0.95,
                      resamples: int = 2000, seed: int = 0) -> RatioCI:
    """Ratio geomean(numer) / geomean(denom) of two arms measured in different rounds (no block pairs them):
    each arm's log block values resampled on their own (percentile bootstrap of the difference of log means),
    floored by Welch's t-interval (whichever is wider). `n_blocks` is the smaller arm's count."""
    x = np.log(np.asarray(numer_blocks, dtype=np.float64))
    y = np.log(np.asarray(denom_blocks, dtype=np.float64))
    if x.size < 2 or y.size < 2:
        raise ValueError(f"an unpaired interval needs at least 2 blocks per arm, got {x.size} and {y.size}")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise ValueError("block values must be finite and > 0")
    d = float(x.mean() - y.mean())
    rng = np.random.default_rng(seed)
    diffs = (rng.choice(x, (resamples, x.size)).mean(axis=1) - rng.choice(y, (resamples, y.size)).mean(axis=1))
    alpha = (1 - confidence) / 2
    lo, hi = float(np.quantile(diffs, alpha)), float(np.quantile(diffs, 1 - alpha))
    vx, vy = float(x.var(ddof=1)) / x.size, float(y.var(ddof=1)) / y.size
    method = "percentile-unpaired"
    if vx + vy > 0:
        from scipy.stats import t

        df = (vx + vy) ** 2 / ((vx ** 2 / (x.size - 1) if vx else 0) + (vy ** 2 / (y.size - 1) if vy else 0))
        half = float(t.ppf(1 - alpha, df)) * math.sqrt(vx + vy)
        if d - half < lo or d + half > hi:
            lo, hi, method = min(lo, d - half), max(hi, d + half), "percentile-unpaired+welch-floor"
    point = math.exp(d)
    return RatioCI(point=point, low=min(math.exp(lo), point), high=max(math.exp(hi), point), confidence=confidence,
                   n_blocks=int(min(x.size, y.size)), method=method)
