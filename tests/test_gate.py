"""Gate math: KL against known answers, full vocabulary, float64, ratchet, worst-depth aggregation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from scoreboard.gate import GateResult, gate_positions, grade_depth, kl_rows, log_softmax64, top1_agreement
from scoreboard.lockfile import GatePolicy

POLICY = GatePolicy(depths=(8,), rows_per_depth=4, top1_min=0.95, kl_max=0.05, kl_prefer=0.02, kl_p99_max=0.5,
                    ratchet_ratio=2.0, ratchet_floor=1e-4)


def test_kl_known_answer():
    p = np.array([[0.5, 0.5]])
    q = np.array([[0.9, 0.1]])
    expected = 0.5 * np.log(0.5 / 0.9) + 0.5 * np.log(0.5 / 0.1)
    assert kl_rows(np.log(p), np.log(q))[0] == pytest.approx(expected, rel=1e-12)


def test_kl_is_argument_ordered_and_zero_on_identity():
    a = np.log(np.array([[0.7, 0.2, 0.1]]))
    b = np.log(np.array([[0.1, 0.2, 0.7]]))
    assert kl_rows(a, a)[0] == 0.0
    assert kl_rows(a, b)[0] != pytest.approx(kl_rows(b, a)[0] * 0.5)


def test_full_vocabulary_not_topk():
    """A mass shift in the tail (outside any top-k) must show in the KL (a top-k truncated KL misses it)."""
    vocab = 4096
    ref = np.zeros((1, vocab), dtype=np.float32)
    ref[0, 0] = 10.0
    cand = ref.copy()
    cand[0, 2000:] += 3.0  # tail tokens gain mass
    assert kl_rows(ref, cand)[0] > 0.05


def test_wide_logits_do_not_overflow():
    x = np.full((1, 163840), 80.0, dtype=np.float32)
    x[0, 5] = 95.0
    assert np.isfinite(log_softmax64(x)).all()
    assert kl_rows(x, x)[0] == 0.0


@settings(max_examples=50, deadline=None)
@given(arrays(np.float64, (3, 16), elements=st.floats(-20, 20)), arrays(np.float64, (3, 16), elements=st.floats(-20, 20)))
def test_kl_nonnegative_and_shift_invariant(a, b):
    k = kl_rows(a, b)
    assert (k >= 0).all()
    assert np.allclose(kl_rows(a + 3.0, b - 7.0), k, atol=1e-9)


def test_top1():
    a = np.array([[1.0, 2.0], [3.0, 1.0]])
    b = np.array([[0.0, 5.0], [0.0, 1.0]])
    assert top1_agreement(a, b).tolist() == [1.0, 0.0]


def test_grade_depth_bars_and_flags():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(4, 64)).astype(np.float32)
    ok = grade_depth(8, [4, 5, 6, 7], ref, ref + 1e-4 * rng.normal(size=ref.shape), POLICY)
    assert ok.passed and not ok.flagged and ok.top1 == 1.0
    bad = grade_depth(8, [4, 5, 6, 7], ref, rng.normal(size=ref.shape), POLICY)
    assert not bad.passed and any("KL mean" in r for r in bad.reasons)


def test_ratchet_catches_drift_under_the_floor():
    """A PR that doubles KL passes a floor (0.05) but not the ratchet (a floor cannot see drift)."""
    rng = np.random.default_rng(1)
    ref = rng.normal(size=(4, 64))
    cand = ref + 0.05 * rng.normal(size=ref.shape)
    kl = kl_rows(ref, cand).mean()
    assert kl < POLICY.kl_max
    r = grade_depth(8, [4, 5, 6, 7], ref, cand, POLICY, ratchet_baseline=kl / 3)
    assert not r.passed and not r.ratchet_ok and "ratchet" in r.reasons[0]
    r2 = grade_depth(8, [4, 5, 6, 7], ref, cand, POLICY, ratchet_baseline=kl / 1.5)
    assert r2.passed


def test_worst_depth_aggregation():
    rng = np.random.default_rng(2)
    ref = rng.normal(size=(4, 64))
    good = grade_depth(8, [4, 5, 6, 7], ref, ref, POLICY)
    deep = grade_depth(64, [60, 61, 62, 63], ref, rng.normal(size=ref.shape), POLICY)
    g = GateResult([good, deep])
    assert not g.passed and g.worst()["top1"] == deep.top1 and g.worst()["kl_mean"] == deep.kl_mean


def test_gate_positions_include_scored_depth():
    pos = gate_positions(1024, 8)
    assert pos[-1] == 1023 and len(pos) == 8  # last row has 1024 tokens of context
    with pytest.raises(ValueError):
        gate_positions(4, 8)
