"""The committed calibration of the repository's targets, copied into a test's own rounds/ directory.

Test rounds run against a temporary rounds/ (their own history); `round run` needs the target's latest
calibration there, so tests that want a real, frontier-moving round start from the sealed record this
repository ships (its own hash chain, independent of the rounds' ledger).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from engines.sparkinfer.faults import GATE_FAULTS
from scoreboard.calibrate import definition, definition_sha256, new_calibration_id, separation_problems, summary
from scoreboard.history.receipt import utc_now
from scoreboard.lockfile import load_lock

REPO = Path(__file__).resolve().parent.parent
TARGET = "k3-mini-cpu"


def seed_calibration(rounds_dir: Path, source: Path = REPO / "rounds") -> Path:
    """Copy source/calibrations.jsonl and source/calibrations/ into rounds_dir; returns rounds_dir."""
    rounds_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source / "calibrations.jsonl", rounds_dir / "calibrations.jsonl")
    shutil.copytree(source / "calibrations", rounds_dir / "calibrations", dirs_exist_ok=True)
    return rounds_dir


def synthetic(lock_path: Path, target: str = TARGET, correct: float = 1e-9, noise: float = 2e-9, fault: float = 1.0,
              fault_kl: dict[str, float] | None = None, seeds: tuple[int, ...] = (1, 2)) -> dict:
    """A calibration record with chosen numbers, against the lock's current definition of the target."""
    lk = load_lock(lock_path)
    t = lk.target(target)
    defn = definition(lk, target)

    def arm(kl: float, top1: float) -> list[dict]:
        return [{"depth": d, "rows": t.gate.rows_per_depth, "kl_mean": kl, "kl_p99": 3 * kl, "kl_max": 5 * kl,
                 "top1": top1} for d in t.gate.depths]

    created = utc_now()
    rec = {"kind": "calibration", "format_version": "1.1", "calibration_id": new_calibration_id(target, created),
           "created_at": created, "target": target, "definition": defn, "definition_sha256": definition_sha256(defn),
           "policy": {"margin": t.gate.calibration_margin, "kl_max": t.gate.kl_max, "kl_p99_max": t.gate.kl_p99_max,
                      "top1_min": t.gate.top1_min, "depths": list(t.gate.depths),
                      "rows_per_depth": t.gate.rows_per_depth}, "seeds": list(seeds),
           "instrument": {"engine": "sparkinfer", "label": "synthetic"}, "reference": {"engine": "llamacpp"},
           "noise_floor": {"precise": "float64", "coarse": "float32"}, "faults": list(GATE_FAULTS),
           "runs": [{"seed": s, "prompt": {}, "correct": arm(correct, 1.0), "noise_floor": arm(noise, 1.0),
                     "faults": {f: arm((fault_kl or {}).get(f, fault), 0.2) for f in GATE_FAULTS}} for s in seeds]}
    rec["summary"] = summary(rec)
    problems = separation_problems(rec, t.gate)
    rec["separation"] = {"separated": not problems, "problems": problems}
    return rec
