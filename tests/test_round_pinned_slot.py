"""The default target's incident end to end, on the real engines: a frontier whose commit speaks an older engine
contract, a main round on a smaller box scored against the pinned slot, and the re-base that gets out of it.

A throwaway repository holds the candidate's code (engines/, pyproject.toml) and scoreboard/engine.py: commit A
without a CONTRACT_VERSION (contract 1: this harness cannot run it as a frontier arm), commit B with this
harness's. Round 1 (main at A) sets the BASELINE. Round 2 (main at B) runs with this process pinned to one
core, as a smaller box: the frontier's commit cannot be re-measured, so the basis is the slot from round 1,
and the reference arm lands far from its baseline: inconclusive, not a regression. The re-base from round 2's
sealed receipt moves the slots to B's measurement through a logged line; round 3 re-measures B beside itself.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from calibration_fixtures import seed_calibration
from receipt_factory import shrunk_lock

from scoreboard.history import durable, ledger
from scoreboard.history.rebase import rebase_frontier
from scoreboard.history.verify import verify
from scoreboard.lockfile import load_lock
from scoreboard.round.candidate import remeasure_problem
from scoreboard.round.run import RoundOptions, run_round
from scoreboard.weights.verify import default_cache

REPO = Path(__file__).resolve().parent.parent
TARGET = "k3-mini-cpu"
pytestmark = pytest.mark.slow
_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
        "PATH": "/usr/bin:/bin"}


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True, env=_ENV).stdout.strip()


def _candidate_repo(root: Path) -> tuple[Path, str]:
    """(the repository at commit A, contract 1); B is committed by the test."""
    repo = root / "repo"
    repo.mkdir()
    shutil.copytree(REPO / "engines", repo / "engines", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(REPO / "pyproject.toml", repo / "pyproject.toml")
    (repo / "scoreboard").mkdir()
    (repo / "scoreboard" / "engine.py").write_text('"""the engine contract before it had a version"""\n')
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "A: contract 1")
    return repo, _git(repo, "rev-parse", "HEAD")


def _round(lock: Path, rounds: Path, repo: Path, seed: int):
    return run_round(RoundOptions(target=TARGET, lock_path=lock, rounds_dir=rounds, cache_dir=default_cache(),
                                  seed=seed, repo=repo))


def test_a_pinned_slot_on_another_box_is_inconclusive_and_a_rebase_gets_out_of_it(tmp_path):
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores to pin the second round to one")
    lock = shrunk_lock(tmp_path / "reference.lock", TARGET)
    rounds = seed_calibration(tmp_path / "rounds")
    repo, a = _candidate_repo(tmp_path)
    first = _round(lock, rounds, repo, 11)
    assert first.receipt["verdict"]["label"] == "BASELINE", first.receipt.get("aborted") or first.receipt["verdict"]
    t = load_lock(lock).target(TARGET)
    slot = t.slot(t.candidate_engine, t.scored)
    assert load_lock(lock).slots[slot].commit == a and remeasure_problem(a, repo) is not None

    shutil.copy2(REPO / "scoreboard" / "engine.py", repo / "scoreboard" / "engine.py")
    _git(repo, "commit", "-q", "-am", "B: this harness's contract")
    b = _git(repo, "rev-parse", "HEAD")
    assert remeasure_problem(b, repo) is None
    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cores)})  # a smaller box from here on: the reference arm runs at about half
    try:
        second = _round(lock, rounds, repo, 12)
        r2 = second.receipt
        v = r2["verdict"]
        assert r2["status"] == "verdict", r2.get("aborted")
        assert "speaks engine contract 1" in r2["provenance"]["frontier_arm"] and v["basis"] == "frontier-slot"
        assert v["label"] == "inconclusive" and second.exit_code == 0, v
        assert any("beyond speed.reference_drift_max" in f for f in v["flags"]), v["flags"]
        assert load_lock(lock).slots[slot].commit == a  # nothing moved

        lines = len(ledger.read_lines(rounds))
        changes = rebase_frontier(lock, second.path, "the frontier's commit speaks engine contract 1; a 1-core box",
                                  rounds, TARGET, lambda c: remeasure_problem(c, repo))
        durable.save(rounds, lock, f"frontier rebase {TARGET}")  # as `scoreboard frontier rebase` keeps it
        assert {c.slot for c in changes if c.kind == "frontier"} == {t.slot(t.candidate_engine, m) for m in t.metrics}
        assert load_lock(lock).slots[slot].commit == b and len(ledger.read_lines(rounds)) == lines + 1
        assert verify(lock, rounds).ok, verify(lock, rounds).problems

        third = _round(lock, rounds, repo, 13)
        r3 = third.receipt
        assert r3["status"] == "verdict", r3.get("aborted")
        assert r3["speed"]["frontier_arm"]["commit"] == b and r3["verdict"]["basis"] == "frontier-same-round"
        assert not any("reference_drift_max" in f for f in r3["verdict"]["flags"])
        assert verify(lock, rounds).ok
    finally:
        os.sched_setaffinity(0, cores)
