"""The committed calibration of the repository's targets, copied into a test's own rounds/ directory.

Test rounds run against a temporary rounds/ (their own history); `round run` needs the target's latest
calibration there, so tests that want a real, frontier-moving round start from the sealed record this
repository ships (its own hash chain, independent of the rounds' ledger).
"""

from __future__ import annotations

import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def seed_calibration(rounds_dir: Path, source: Path = REPO / "rounds") -> Path:
    """Copy source/calibrations.jsonl and source/calibrations/ into rounds_dir; returns rounds_dir."""
    rounds_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source / "calibrations.jsonl", rounds_dir / "calibrations.jsonl")
    shutil.copytree(source / "calibrations", rounds_dir / "calibrations", dirs_exist_ok=True)
    return rounds_dir
