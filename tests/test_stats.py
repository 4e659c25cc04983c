"""scoreboard.stats: throughput arithmetic, arm summaries, bootstrap ratio intervals, block suggestions."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scoreboard.stats import (ArmStats, arm_stats, block_value, ci_vs_constant, geometric_mean, paired_ratio_ci,
                              rep_throughput, suggest_blocks, _bootstrap_mean, _t_interval)


def test_rep_throughput_is_tokens_over_seconds():
    assert rep_throughput(2_000_000_000, 128) == 64.0
    assert rep_throughput(1_000_000, 1) == 1000.0
    with pytest.raises(ValueError, match="> 0 ns"):
        rep_throughput(0, 128)
    with pytest.raises(ValueError, match=">= 0"):
        rep_throughput(10, -1)


def test_block_value_is_the_median_rep_throughput():
    # 10, 40, 20 tok/s -> median 20 (not the mean 23.3, not the fastest rep)
    assert block_value([1e9, 0.25e9, 0.5e9], [10, 10, 10]) == 20.0
    with pytest.raises(ValueError, match="3 reps but n_tokens has 2"):
        block_value([1, 2, 3], [1, 1])


def test_arm_stats_known_values():
    # reps at 10, 20, 30 tok/s in one block and 20 tok/s in another
    s = arm_stats([([1e9, 0.5e9, 1e9 / 3], [10, 10, 10]), ([0.5e9], [10])])
    assert isinstance(s, ArmStats)
    assert s.n == 4
    assert s.median == pytest.approx(20.0)
    assert s.mad == pytest.approx(5.0)  # |10-20|,|20-20|,|30-20|,|20-20| -> median of 10,0,10,0
    assert s.cv == pytest.approx(np.std([10, 20, 30, 20], ddof=1) / 20.0)
    assert s.block_values == pytest.approx((20.0, 20.0))
    assert s.value == pytest.approx(20.0)


@given(st.floats(0.1, 1e6), st.integers(1, 6), st.integers(1, 5))
def test_cv_of_a_constant_arm_is_zero(rate, n_blocks, reps):
    ns = 1e9 * 64 / rate
    s = arm_stats([([ns] * reps, [64] * reps)] * n_blocks)
    assert s.cv == 0.0
    assert s.mad == 0.0
    assert s.median == pytest.approx(rate)


def test_constant_ratio_gives_a_zero_width_interval():
    r = paired_ratio_ci([11.0] * 5, [10.0] * 5, seed=1)
    assert r.point == pytest.approx(1.1)
    assert (r.low, r.high) == pytest.approx((1.1, 1.1))
    assert r.width == pytest.approx(0.0, abs=1e-12)
    assert r.n_blocks == 5


def test_point_is_the_geometric_mean_of_block_ratios():
    c, b = [12.0, 9.0, 10.0], [10.0, 10.0, 8.0]
    r = paired_ratio_ci(c, b, seed=0)
    expect = (1.2 * 0.9 * 1.25) ** (1 / 3)
    assert r.point == pytest.approx(expect)
    assert r.point == pytest.approx(geometric_mean(c) / geometric_mean(b))
    assert r.low <= r.point <= r.high


def test_seed_makes_the_interval_reproducible():
    rng = np.random.default_rng(7)
    b = rng.lognormal(3, 0.05, 8)
    c = b * 1.04 * rng.lognormal(0, 0.03, 8)
    a1 = paired_ratio_ci(c, b, resamples=1000, seed=42)
    a2 = paired_ratio_ci(c, b, resamples=1000, seed=42)
    assert a1 == a2
    logs = np.log(c) - np.log(b)  # the bootstrap itself is what the seed drives
    assert _bootstrap_mean(logs, 0.95, 1000, 42) == _bootstrap_mean(logs, 0.95, 1000, 42)
    assert _bootstrap_mean(logs, 0.95, 1000, 42) != _bootstrap_mean(logs, 0.95, 1000, 43)
    assert a1.method.startswith("BCa")


def test_few_blocks_get_at_least_the_t_interval():
    """With 4 blocks the bootstrap is too narrow; the CI is never narrower than Student-t's."""
    c = [161.0, 148.5, 155.9, 166.1]  # a real A/A round on the 2-core box (decode tok/s)
    m = [160.5, 135.6, 143.1, 166.5]
    r = paired_ratio_ci(c, m, seed=5)
    lo, hi = _t_interval(np.log(np.array(c)) - np.log(np.array(m)), 0.95)
    assert r.low <= np.exp(lo) + 1e-9 and r.high >= np.exp(hi) - 1e-9
    assert r.low < 1.0 < r.high  # not significant: the A/A gain of +4.5% is noise


def test_pairing_cancels_shared_block_drift():
    # a 20% drift shared by both arms of a block must not widen the CI of a constant 5% ratio
    drift = np.array([1.0, 1.2, 0.8, 1.1, 0.9, 1.15])
    r = paired_ratio_ci(50 * 1.05 * drift, 50 * drift, seed=3)
    assert r.point == pytest.approx(1.05)
    assert r.width < 1e-9


def test_noisy_samples_cover_the_true_ratio_at_about_the_stated_rate():
    rng = np.random.default_rng(2026)
    true, trials, hits = 1.05, 150, 0
    for i in range(trials):
        b = rng.lognormal(3.0, 0.05, 10)
        c = b * true * rng.lognormal(0.0, 0.03, 10)
        r = paired_ratio_ci(c, b, confidence=0.95, resamples=1000, seed=i)
        hits += r.low <= true <= r.high
    assert 0.85 <= hits / trials <= 0.995  # loose: BCa on 10 blocks under-covers a little


def test_ci_vs_constant_only_carries_the_candidate_noise():
    r = ci_vs_constant([100.776] * 6, 98.80)
    assert r.point == pytest.approx(1.02)
    assert r.width == pytest.approx(0.0, abs=1e-12)
    noisy = ci_vs_constant([9.0, 11.0, 10.0, 10.5], 10.0, seed=1)
    assert noisy.low < noisy.point < noisy.high
    with pytest.raises(ValueError, match="constant basis"):
        ci_vs_constant([1.0, 2.0], 0.0)


def test_ratio_refuses_bad_input():
    with pytest.raises(ValueError, match="at least 2 paired blocks"):
        paired_ratio_ci([1.0], [1.0])
    with pytest.raises(ValueError, match="differ in count"):
        paired_ratio_ci([1.0, 2.0, 3.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="> 0"):
        paired_ratio_ci([1.0, 0.0], [1.0, 1.0])


def test_suggest_blocks_scales_with_the_square_of_the_width_ratio():
    assert suggest_blocks(6, 0.08, 0.04) == 24  # twice as wide -> four times the blocks
    assert suggest_blocks(6, 0.05, 0.04) == 10  # ceil(6 * 1.5625 = 9.375)
    assert suggest_blocks(6, 0.03, 0.04) == 6  # already narrow enough
    assert suggest_blocks(6, 0.0401, 0.04) == 7  # always at least one more block when too wide
    with pytest.raises(ValueError):
        suggest_blocks(0, 0.1, 0.04)


_rates = st.lists(st.floats(0.5, 5000.0), min_size=2, max_size=10)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_properties_of_the_paired_ratio(data):
    c = data.draw(_rates)
    b = data.draw(st.lists(st.floats(0.5, 5000.0), min_size=len(c), max_size=len(c)))
    k = data.draw(st.floats(1e-3, 1e3))
    r = paired_ratio_ci(c, b, resamples=300, seed=11)
    # the CI contains the point
    assert r.low <= r.point <= r.high
    # swapping the arms inverts the point and the interval
    s = paired_ratio_ci(b, c, resamples=300, seed=11)
    assert s.point == pytest.approx(1 / r.point, rel=1e-6)
    assert s.low == pytest.approx(1 / r.high, rel=1e-6)
    assert s.high == pytest.approx(1 / r.low, rel=1e-6)
    # scaling both arms (a faster box, other units) leaves the ratio unchanged
    t = paired_ratio_ci([x * k for x in c], [x * k for x in b], resamples=300, seed=11)
    assert t.point == pytest.approx(r.point, rel=1e-6)
    assert (t.low, t.high) == pytest.approx((r.low, r.high), rel=1e-6)
    assert all(math.isfinite(x) for x in (r.low, r.high))
