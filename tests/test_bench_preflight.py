"""bench/preflight.py, the GPU box's first step, run for real on the CPU target: the reference is built before the
weights are touched, so a box that generates its weights in another process builds beside it instead of after it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from llamacpp_fixtures import test_cache_dir

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent


def test_the_preflight_builds_the_reference_before_it_verifies_the_weights(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    shared = test_cache_dir() / "llamacpp"  # the suite's keyed, re-verified build; the weights are not shared
    shared.mkdir(parents=True, exist_ok=True)
    (cache / "llamacpp").symlink_to(shared)
    out = subprocess.run([sys.executable, str(REPO / "bench" / "preflight.py"), "k3-mini-cpu"], cwd=REPO,
                         capture_output=True, text=True, timeout=1800,
                         env={**os.environ, "SCOREBOARD_CACHE": str(cache)})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    lines = out.stdout.splitlines()

    def first(text: str) -> int:
        return next(i for i, line in enumerate(lines) if text in line)

    built = first("reference built in")
    assert first("building reference llamacpp before the weights") < built < first("weight shard(s) of k3-mini")
    assert first("weight shard(s) of k3-mini") < first("preflight of k3-mini-cpu done")
    assert (cache / "weights" / "k3-mini").is_dir()  # the round's own preflight still verified (made) them


def test_an_unknown_target_is_an_error_naming_it_and_the_fix(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(REPO / "bench" / "preflight.py"), "k3-nope"], cwd=REPO,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "SCOREBOARD_CACHE": str(tmp_path / "cache")})
    assert out.returncode == 1
    assert "error: unknown target 'k3-nope' in the lock" in out.stderr and "fix:" in out.stderr
    assert "Traceback" not in out.stderr
