"""`scoreboard round run` end to end on the real engines and k3-mini: the gate proves itself.

Each test runs real rounds (pinned llama.cpp build from the cache, the bundled sparkinfer engine in
fresh worker processes) against a copy of reference.lock whose k3-mini-cpu speed policy is shrunk
(2 blocks, 1 rep) to keep the suite short.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import sigint_default

from scoreboard.errors import LockError

from engines.sparkinfer.faults import GATE_FAULTS
from calibration_fixtures import seed_calibration
from conftest import main_round_receipt
from receipt_factory import shrunk_lock
from scoreboard.lockfile import load_lock
from scoreboard.round.run import RoundOptions, run_round
from scoreboard.history.verify import verify as verify_all
from scoreboard.weights.verify import default_cache

REPO = Path(__file__).resolve().parent.parent
TARGET = "k3-mini-cpu"
pytestmark = pytest.mark.slow


@pytest.fixture
def lock(tmp_path: Path) -> Path:
    p = shrunk_lock(tmp_path / "reference.lock", TARGET)  # a fresh history: this test's own frontier
    seed_calibration(tmp_path / "rounds")  # the target's committed calibration (speed policy is not part of it)
    return p


def _opts(lock: Path, tmp_path: Path, **kw) -> RoundOptions:
    base = dict(target=TARGET, lock_path=lock, rounds_dir=tmp_path / "rounds", cache_dir=default_cache(), seed=7)
    base.update(kw)
    return RoundOptions(**base)


@pytest.mark.parametrize("fault", GATE_FAULTS)
def test_every_injected_fault_is_rejected_before_timing(fault, lock, tmp_path):
    out = run_round(_opts(lock, tmp_path, candidate_options={"faults": [fault]}))
    r = out.receipt
    assert r["status"] == "verdict", r.get("aborted")
    assert r["verdict"]["label"] == "REJECT"
    assert r["speed"] is None  # no speed numbers for a gate failure
    assert not r["gate"]["pass"]
    assert out.exit_code == 2
    assert out.path is not None and out.path.exists()  # the REJECT is sealed and on the ledger
    assert verify_all(lock, tmp_path / "rounds").ok


def test_wrong_path_only_when_timed_is_rejected(lock, tmp_path):
    """Correct when checked, a different path when timed: caught by the timed-output check."""
    out = run_round(_opts(lock, tmp_path, candidate_options={"faults": ["cheat_when_timed"]}))
    r = out.receipt
    assert r["gate"]["pass"], r["gate"]["reasons"]
    assert r["speed"] is not None
    assert any(not m["timed_output_ok"] for m in r["speed"]["metrics"])
    assert r["verdict"]["label"] == "REJECT"
    assert any("differ" in x for x in r["verdict"]["reasons"])


def test_main_round_sets_baseline_and_frontier_never_goes_down(main_round_history, tmp_path):
    """The first main round of a fresh history (the session's `main_round_history`, conftest.py: a real sealed
    round of HEAD, seed 11) set the BASELINE; a second main round, on a copy of that history, never lowers it."""
    shutil.copytree(main_round_history, tmp_path, dirs_exist_ok=True)
    lock = tmp_path / "reference.lock"
    r = main_round_receipt(tmp_path)
    assert r["status"] == "verdict", r.get("aborted")
    assert r["verdict"]["label"] == "BASELINE", r["verdict"]
    lk = load_lock(lock)
    slot = lk.target(TARGET).slot("sparkinfer", lk.target(TARGET).scored)
    f1 = lk.slots[slot].value
    assert f1 > 0 and lk.slots[slot].round == r["round_id"]
    second = run_round(_opts(lock, tmp_path, seed=12))
    assert second.receipt["status"] == "verdict"
    f2 = load_lock(lock).slots[slot].value
    assert f2 >= f1  # raise-only
    # the second round's gate ratchets against the first (main's last sealed KL)
    assert all(d["ratchet_baseline"] is not None for d in second.receipt["gate"]["depths"])
    assert verify_all(lock, tmp_path / "rounds").ok


def test_same_seed_reproduces_the_gate(lock, tmp_path, monkeypatch):
    import hashlib

    from scoreboard.round import stages

    sides: list[dict[str, str]] = []  # which engine's logits moved, when the KL does (named in the failure)
    grade = stages.GateStage.grade

    def spy(self, per_depth, positions, ref, cand, baselines):
        sides.append({k: hashlib.sha256(v.tobytes()).hexdigest()[:16] for k, v in (("reference", ref), ("candidate", cand))})
        return grade(self, per_depth, positions, ref, cand, baselines)
    monkeypatch.setattr(stages.GateStage, "grade", spy)
    a = run_round(_opts(lock, tmp_path, seed=123, seal=False, gate_only=True)).receipt["gate"]
    b = run_round(_opts(lock, tmp_path, seed=123, seal=False, gate_only=True)).receipt["gate"]
    moved_sides = [k for k in ("reference", "candidate") if sides[0][k] != sides[1][k]]
    # Everything but the KL statistics is bit for bit: the prompt, the rows, top-1, the verdict. The KL statistics may
    # move in bits far below the bar: CI read the same prompt's KL at depth 64 as 8.9e-9 and then 3.7e-10 nats
    # (2026-12-05), and at depth 1024 as 1.2e-11 and then 1.2e-6 (2026-12-07, above the ratchet's floor): the cause
    # found and fixed is in docs/engines.md ("The same prompt, the same logits, run to run"); the tolerance stays for
    # what no test has yet shown. Every kl_* field, at any level (the depths, the decode
    # path's rows), must be present in both and agree within 1e-7 nats: 1e-4 of k3-mini-cpu's kl_max (1e-3), a
    # tenth of its ratchet floor (1e-6), so no difference this loose could change a gate's pass or its ratchet.
    kl_tol = 1e-7

    def without_kl(g):
        if isinstance(g, dict):
            return {k: without_kl(v) for k, v in g.items() if not k.startswith("kl_")}
        return [without_kl(v) for v in g] if isinstance(g, list) else g

    def kl_fields(g, at=""):
        if isinstance(g, dict):
            return [f for k, v in g.items() for f in ([(at + k, v)] if k.startswith("kl_") else kl_fields(v, f"{at}{k}."))]
        return [f for i, v in enumerate(g) for f in kl_fields(v, f"{at}{i}.")] if isinstance(g, list) else []
    ka, kb = kl_fields(a), kl_fields(b)
    assert ka and [p for p, _ in ka] == [p for p, _ in kb]
    moved = [(p, x, y) for (p, x), (_, y) in zip(ka, kb) if x != y]
    assert all(abs(x - y) <= kl_tol for _, x, y in moved), (f"logits that moved: {moved_sides}", moved)
    assert json.dumps(without_kl(a), sort_keys=True) == json.dumps(without_kl(b), sort_keys=True)
    c = run_round(_opts(lock, tmp_path, seed=124, seal=False, gate_only=True)).receipt["gate"]
    assert c["prompt"]["token_ids_sha256"] != a["prompt"]["token_ids_sha256"]


def test_a_a_round_is_never_a_tier(lock, tmp_path):
    """candidate = main = the same code (HEAD): the speed earns none or inconclusive, never a tier.

    The guard may still convict, rarely: that is its false-alarm rate, not a fault. It convicts when the
    upper bound of a 95% interval (never narrower than Student's t) lies below -guard_tolerance. With
    four blocks of one rep on a 2-core box the block log-ratios' standard deviation is 0.15-0.25
    (measured), where an identical pair convicts in about 0.7-1.2% of rounds (normal and t(2) noise,
    simulated). CI met one such round on 2026-12-02. So a REJECT here must be a guard's, after a passed
    gate, with the speed's own label still none or inconclusive; the scored metric's regression rule is the
    same test with the same false-alarm rate, so a regression is the scored metric's false alarm."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    if not head:
        pytest.skip("not a git checkout")
    out = run_round(_opts(lock, tmp_path, candidate=head, seed=5, blocks=4))
    r = out.receipt
    v = r["verdict"]
    assert r["status"] == "verdict", r.get("aborted")
    assert r["main"] is not None and "main" in r["speed"]["metrics"][0]["arms"]
    assert v["basis"] == "main-same-round"
    assert v["speed_label"] in ("none", "inconclusive", "regression"), v  # the speed alone: never a tier
    assert v["label"] in ("none", "inconclusive", "REJECT", "regression"), v
    if v["speed_label"] == "regression":
        assert any(" regressed: " in x and "(guard_tolerance)" in x for x in v["reasons"]), v
    if v["label"] == "REJECT":  # only a guard's false alarm: the gate passed and a guard's reason says so
        assert r["gate"]["pass"], v
        assert any(x.startswith("guard ") and " regressed: " in x for x in v["reasons"]), v


def test_cli_main_job_and_show(lock, tmp_path):
    """The README's main job through the console script; `round show` renders what it sealed."""
    rounds = tmp_path / "rounds"
    proc = subprocess.run([sys.executable, "-m", "scoreboard.cli.main", "round", "run", "--lock", str(lock),
                           "--rounds", str(rounds), "--seed", "3"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "verdict: BASELINE" in proc.stdout
    receipts = sorted(rounds.glob("*.json"))
    assert len(receipts) == 1
    said = " ".join(proc.stdout.split())  # where the records went, and what to do with them
    assert f"records: receipt {receipts[0]}" in said and "+2 line(s): round, frontier-raise" in said, said
    assert f"lock {lock}" in said and "next:" in said
    show = subprocess.run([sys.executable, "-m", "scoreboard.cli.main", "round", "show", str(receipts[0])],
                          capture_output=True, text=True, cwd=tmp_path)
    assert show.returncode == 0 and "correctness gate" in show.stdout and "speed" in show.stdout
    ver = subprocess.run([sys.executable, "-m", "scoreboard.cli.main", "verify", "--lock", str(lock), "--rounds",
                          str(rounds)], capture_output=True, text=True, cwd=tmp_path)
    assert ver.returncode == 0, ver.stdout + ver.stderr


def test_bad_target_is_an_error_with_no_receipt(lock, tmp_path):
    from scoreboard.errors import InputError

    with pytest.raises(InputError, match="unknown target"):
        run_round(_opts(lock, tmp_path, target="k3-mini-cpx"))
    rounds = tmp_path / "rounds"  # holds only the seeded calibration
    assert not list(rounds.glob("*.json")) and not (rounds / "ledger.jsonl").exists()


def test_an_unknown_engine_option_is_refused_before_anything_runs(lock, tmp_path):
    """A fault the candidate engine does not know is refused by its typed options before any engine runs:
    a LockError naming the option path, nothing written, the lock untouched."""
    before = lock.read_bytes()
    with pytest.raises(LockError, match=r"candidate_options\.faults: unknown fault\(s\) \['no_such_fault'\]"):
        run_round(_opts(lock, tmp_path, candidate_options={"faults": ["no_such_fault"]}))
    assert lock.read_bytes() == before
    assert not list((tmp_path / "rounds").glob("*.json")) and not (tmp_path / "rounds" / "ledger.jsonl").exists()


def test_interrupt_leaves_no_receipt_and_an_untouched_lock(lock, tmp_path):
    """Ctrl-C during the speed stage: nothing sealed, no partial files, the lock byte-identical."""
    import signal
    import time

    before = lock.read_bytes()
    rounds = tmp_path / "rounds"
    proc = subprocess.Popen([sys.executable, "-m", "scoreboard.cli.main", "round", "run", "--lock", str(lock),
                             "--rounds", str(rounds), "--blocks", "6"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=sigint_default)
    deadline = time.time() + 120
    seen = ""
    while time.time() < deadline and "== speed" not in seen:  # interrupt once timing has started
        line = proc.stderr.readline()
        if not line:
            break
        seen += line
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert "== speed" in seen
    assert proc.returncode == 130, err[-2000:]
    assert "nothing was sealed" in err
    assert not list(rounds.glob("*.json")) and not (rounds / "ledger.jsonl").exists()  # only the seeded calibration
    assert lock.read_bytes() == before


def test_transient_failure_is_retried_and_recorded(lock, tmp_path, monkeypatch):
    """Out of memory at load is retried (bounded) and recorded in the receipt; the round goes on."""
    import scoreboard.round.run as run_mod
    from scoreboard.errors import TransientError

    real, calls = run_mod.preflight, []

    def flaky(rnd):
        calls.append(1)
        if len(calls) == 1:
            raise TransientError("CUDA out of memory at load (simulated)")
        return real(rnd)

    monkeypatch.setattr(run_mod, "preflight", flaky)
    r = run_round(_opts(lock, tmp_path, seal=False, gate_only=True)).receipt
    assert len(calls) == 2 and r["gate"]["pass"]
    assert [x["stage"] for x in r["retries"]] == ["preflight"] and "out of memory" in r["retries"][0]["error"]


def test_bad_options_and_files_are_errors_with_nothing_written(lock, tmp_path):
    from scoreboard.errors import InputError

    with pytest.raises(InputError, match="--blocks 1: must be at least 4"):
        run_round(_opts(lock, tmp_path, blocks=1))
    rounds = tmp_path / "rounds"  # holds only the seeded calibration
    assert not list(rounds.glob("*.json")) and not (rounds / "ledger.jsonl").exists()
    bad = tmp_path / "broken.json"
    bad.write_text('{"format_version": "1.0", "round_id": ')
    out = subprocess.run([sys.executable, "-m", "scoreboard.cli.main", "round", "show", str(bad)],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "not a readable JSON receipt" in out.stderr
    bad.write_text('{"format_version": "9.0"}')
    out = subprocess.run([sys.executable, "-m", "scoreboard.cli.main", "round", "show", str(bad)],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "format_version '9.0' has unknown major version 9" in out.stderr
