"""bench/pick_split.py: a grid timed beside the build picks the step a lease scores, or the plan's else."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _grid(tmp_path: Path, us_rows: float, us_heads: float = 200.0) -> Path:
    heads = {"MLA_ROWS_FORM_HEADS": 0, "MLA_BH": 16, "MLA_BT": 64, "WARPS.mla_split": 4, "STAGES.mla_split": 2,
             "MLA_PROGRAMS": 264, "span": 131072, "us": us_heads}
    rows = {"MLA_ROWS_FORM_HEADS": 1, "MLA_ROWS_BH": 32, "MLA_BT": 64, "WARPS.mla_split_rows": 8,
            "STAGES.mla_split_rows": 2, "MLA_PROGRAMS": 264, "span": 131072, "us": us_rows}
    broken = {**rows, "MLA_ROWS_BH": 64, "error": "OutOfResources"}
    broken.pop("us")
    path = tmp_path / "grid.json"
    path.write_text(json.dumps({"presets": {"k3-wide-long": {"decode_grid": [heads, rows, broken]}}}))
    return path


def _pick(tmp_path: Path, grid: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "bench" / "pick_split.py"), str(grid), "--preset", "k3-wide-long",
                           "--current", "16,64,4,2,264,0", "--step", "32,64,8,2,264,1=abc1234",
                           "--step", "64,64,8,2,264,1=def5678", "--replan", str(tmp_path / "replan"), *extra],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("us_rows", "want"), [(150.0, 'PHASES="ladder"\nSTEPS="abc1234"\n'),
                                               (195.0, 'PHASES="round"\nSTEPS=""\n')])
def test_the_fastest_step_is_chosen_only_past_the_gain_asked(tmp_path: Path, us_rows: float, want: str) -> None:
    out = _pick(tmp_path, _grid(tmp_path, us_rows))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "replan").read_text() == want
    assert "current (16, 64, 4, 2, 264, 0) 200.0 us; fastest step (32, 64, 8, 2, 264, 1)" in out.stdout


def test_a_bad_step_argument_writes_nothing(tmp_path: Path) -> None:
    out = _pick(tmp_path, _grid(tmp_path, 150.0), "--step", "32,64,8=abc")
    assert out.returncode == 1 and "six numbers" in out.stderr and "nothing written" in out.stderr
    assert not (tmp_path / "replan").exists()
