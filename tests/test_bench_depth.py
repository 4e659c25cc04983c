"""The depth diagnosis scripts run here in their reduced forms, so the H200 call that runs them in full does not
fail on a plumbing error: bench/h200_profile.py --depths (decode at nested depths after restored prefills, then a
prefill from empty, each with an op table) on k3-mini's CPU target, and bench/mla_depth.py --quick (MLA's kernels
in Triton's interpreter against the torch form). What they time here means nothing; what they return is checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parent.parent


def _run(args: list[str], tmp_path: Path, **env: str) -> dict:
    out = tmp_path / "out.json"
    p = subprocess.run([sys.executable, *args, "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                       timeout=900, env={**os.environ, "PYTHONPATH": str(REPO), **env})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return json.loads(out.read_text())


def test_the_depth_profile_restores_each_depth_and_tables_the_ops(tmp_path):
    res = _run(["bench/h200_profile.py", "--target", "k3-mini-cpu", "--device", "cpu", "--depths", "2100,64",
                "--prefill", "256", "--tokens", "4", "--reps", "1"], tmp_path)
    assert res["depths"] == [64, 2100] and list(res["forms"]) == ["kernels"]  # on CPU the kernels are off: one form
    form = res["forms"]["kernels"]
    assert form["identity_kernels"] == "torch: cpu" and not form["use_kernels"]
    deep = form["decode"]["2100"]
    assert deep["first_begin_restored"] == 0 and deep["rep_restored"] == 2048  # every rep after the first restores
    assert deep["tok_s"] > 0 and deep["kernels"]["launches_per_token"] > 0 and deep["kernels"]["top"]
    assert form["prefill"]["tok_s"] > 0 and form["prefill"]["rep_restored"] == 0  # from empty: nothing to restore


def test_the_mla_kernels_at_depth_run_in_the_interpreter(tmp_path):
    res = _run(["bench/mla_depth.py", "--device", "cpu", "--quick", "--no-grid"], tmp_path, TRITON_INTERPRET="1")
    rec = res["presets"]["k3-gpu"]
    assert rec["widths"]["kvr"] == 512 and [r["span"] for r in rec["decode"]] == [256, 256, 1024, 1024]
    assert all(r["rel_vs_torch_form"] < 5e-3 for r in rec["decode"])  # the torch form rounds q_abs to f16
    calls = rec["prefill"]["calls"]
    assert [c["n_past"] for c in calls] == [0, 128]
    assert all(err < 2e-3 for c in calls for err in c["rel_vs_float64"].values())


def test_the_calibration_cost_times_each_instrument_arm_at_the_gate_rows(tmp_path):
    """bench/cal_cost.py: the target's precision, the noise floor's other one and a fault, each loaded and asked for
    the gate rows once. --depth 200 (a smoke run) takes the deeper depths' rows at 200, the faults' at their own
    depths capped there."""
    res = _run(["bench/cal_cost.py", "--target", "k3-mini-cpu", "--device", "cpu", "--depth", "200"], tmp_path)
    arms = res["arms"]
    assert list(arms) == ["dtype:float32", "dtype:float16", "fault:experts_hidden_width"]
    assert res["depths"] == [64, 512, 1024] and res["fault_depths"] == [64, 200, 200]
    for a in arms.values():
        assert a["tokens"] == 200 and a["rows"] == 64 and a["vocab"] == 512  # 32 rows at 64, 32 at 200
        assert a["load_s"] >= 0 and a["logits_s"] > 0 and "peak_gib" not in a


def test_the_calibration_cost_names_an_unknown_target_and_exits_1(tmp_path):
    p = subprocess.run([sys.executable, "bench/cal_cost.py", "--target", "k3-mini-cpux", "--device", "cpu", "--out",
                        str(tmp_path / "out.json")], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 1 and "unknown target 'k3-mini-cpux'" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "out.json").exists()
