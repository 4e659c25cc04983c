"""bench/worker_start.py on the CPU target: two fresh worker-like processes sharing one Triton cache dir, each
phase of a block's worker timed (the import, the weight load, each depth's begin and reps, the prefill)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_worker_start_times_every_phase_of_a_block_cold_and_warm(tmp_path: Path) -> None:
    out = tmp_path / "start.json"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "worker_start.py"), "--target", "k3-mini-cpu",
                           "--device", "cpu", "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    res = json.loads(out.read_text())
    assert set(res["runs"]) == {"cold", "warm"}
    for run in res["runs"].values():
        names = [p["phase"] for p in run["phases"]]
        assert names[:3] == ["import", "weights verified, prompt drawn", "prepare (weight load)"]
        assert "decode@1024 begin" in names and "prefill@512 first rep" in names  # k3-mini-cpu's slots
        assert all(p["s"] >= 0 for p in run["phases"])
        assert run["total_s"] >= sum(p["s"] for p in run["phases"]) - 0.001 * len(run["phases"])  # phases in sequence
    assert res["compile_share_s"] == round(res["runs"]["cold"]["total_s"] - res["runs"]["warm"]["total_s"], 3)


def test_an_unknown_target_is_refused_by_name_before_any_process_starts(tmp_path: Path) -> None:
    out = tmp_path / "start.json"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "worker_start.py"), "--target", "k3-nope",
                           "--device", "cpu", "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 1
    assert "--target k3-nope: the target is not in ./reference.lock" in done.stderr and "Traceback" not in done.stderr
    assert not out.exists()
