"""Slots written from sealed receipts: raise-only frontiers, replaced baselines, the logged lowering,
and recovery of an interrupted round. Real lock copies, real rounds/ directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from receipt_factory import (
    GUARD_SLOT, MAIN_COMMIT, REF_GUARD_SLOT, REF_SCORED_SLOT, SCORED_SLOT, lock_with_test_target, make_receipt,
)

from scoreboard.history import frontier
from scoreboard.history import ledger
from scoreboard.errors import InputError, NonCompliant
from scoreboard.lockfile import load_lock
from scoreboard.history.receipt import parse_receipt
from scoreboard.history.records import record_round, resume_round, write_receipt
from scoreboard.history.verify import verify

_n = iter(range(1, 1000))


def rid_kwargs(hour: int = 15) -> dict:
    return {"round_hex": f"{next(_n):08x}", "created_at": f"2026-11-29T{hour:02d}:00:00Z"}


@pytest.fixture
def env(tmp_path: Path) -> tuple[Path, Path]:
    return lock_with_test_target(tmp_path), tmp_path / "rounds"


def slots(lock: Path) -> dict[str, float]:
    return {k: v.value for k, v in load_lock(lock).slots.items() if k.startswith("RCPT_")}


def test_main_round_raises_frontiers_and_sets_baselines_with_provenance(env):
    lock, rounds = env
    text_before = lock.read_text()
    rec = record_round(make_receipt(candidate_tps=50.0, reference_tps=40.0, **rid_kwargs()), rounds, lock)
    assert {(c.slot, c.kind, c.before, c.after) for c in rec.changes} == {
        (SCORED_SLOT, "frontier", 0.0, 50.0), (GUARD_SLOT, "frontier", 0.0, 900.0),
        (REF_SCORED_SLOT, "baseline", 0.0, 40.0), (REF_GUARD_SLOT, "baseline", 0.0, 800.0)}
    s = load_lock(lock).slots[SCORED_SLOT]
    assert (s.value, s.kind, s.reps, s.round, s.commit, s.measured_at) == (
        50.0, "frontier", 9, rec.receipt["round_id"], MAIN_COMMIT, "2026-11-29T15:00:00Z")
    assert load_lock(lock).slots[REF_SCORED_SLOT].commit == "llama-cpp-python==0.3.36@sha256:832db0699007"
    # comments of the hand-edited lock survive the rewrite
    for line in text_before.splitlines():
        if line.startswith("#"):
            assert line in lock.read_text()
    kinds = [e.kind for e in ledger.read_entries(rounds)]
    assert kinds == ["round", "frontier-raise"]
    assert verify(lock, rounds).problems == []


@pytest.mark.parametrize("kwargs, why", [
    ({"candidate_tps": 45.0}, "slower main"),
    ({"candidate_tps": 70.0, "is_main": False, "label": "XL"}, "a PR"),
    ({"candidate_tps": 70.0, "claim": True}, "a claim"),
    ({"candidate_tps": 70.0, "label": "inconclusive"}, "inconclusive"),
    ({"candidate_tps": 70.0, "gate_pass": False}, "REJECT by the gate"),
    ({"candidate_tps": 70.0, "status": "aborted"}, "aborted"),
    ({"candidate_tps": 70.0, "commit": ""}, "no commit"),
])
def test_frontier_is_raise_only_and_only_main_moves_it(env, kwargs, why):
    lock, rounds = env
    record_round(make_receipt(candidate_tps=50.0, **rid_kwargs(10)), rounds, lock)
    before = slots(lock)
    rec = record_round(make_receipt(**kwargs, **rid_kwargs()), rounds, lock)
    assert rec.changes == [], why
    assert slots(lock) == before, why
    assert verify(lock, rounds).problems == []


def test_guard_frontier_rises_independently_and_baselines_are_replaced_both_ways(env):
    lock, rounds = env
    record_round(make_receipt(candidate_tps=50.0, guard_tps=900.0, **rid_kwargs(10)), rounds, lock)
    rec = record_round(make_receipt(candidate_tps=49.0, guard_tps=950.0, reference_tps=38.5, **rid_kwargs()),
                       rounds, lock)
    assert slots(lock)[SCORED_SLOT] == 50.0  # not lowered
    assert slots(lock)[GUARD_SLOT] == 950.0  # raised
    assert slots(lock)[REF_SCORED_SLOT] == 38.5  # baseline replaced (re-measured each round)
    assert {c.slot for c in rec.changes} == {GUARD_SLOT, REF_SCORED_SLOT}
    assert verify(lock, rounds).problems == []


def test_unsealed_tampered_or_unrecorded_receipts_are_refused(env):
    lock, rounds = env
    before = lock.read_bytes()
    # a receipt that was never recorded is a claim
    with pytest.raises(NonCompliant, match="no recorded receipt"):
        frontier.raise_frontier(lock, make_receipt(candidate_tps=99.0), rounds)
    # a recorded receipt edited afterwards fails its seal
    p = write_receipt(make_receipt(candidate_tps=50.0, **rid_kwargs()), rounds)
    data = json.loads(p.read_bytes())
    for blk in data["speed"]["metrics"][0]["arms"]["candidate"]["blocks"]:
        blk["samples_ns"] = [ns // 2 for ns in blk["samples_ns"]]  # "twice as fast"
    p.write_text(json.dumps(data))
    with pytest.raises(NonCompliant, match="speed.metrics: does not match seal.sha256"):
        frontier.raise_frontier(lock, p, rounds)
    # a dict that differs from the recorded file is refused even if it carries the right seal
    with pytest.raises(NonCompliant):
        frontier.raise_frontier(lock, data, rounds)
    assert lock.read_bytes() == before


def test_slot_name_in_receipt_must_match_target_slot(env):
    lock, rounds = env
    r = make_receipt(**rid_kwargs())
    r["speed"]["metrics"][0]["slot"] = "RCPT_MINI_RCPT_TEST_CPU_Q80_SPARKINFER_DECODE_128K"
    p = write_receipt(r, rounds)
    with pytest.raises(InputError, match=r"speed.metrics\[0\].slot is .* but Target.slot derives "
                                         "'RCPT_MINI_RCPT_TEST_CPU_Q80_SPARKINFER_DECODE_512'"):
        frontier.raise_frontier(lock, p, rounds)


def test_lower_frontier_needs_reason_and_matching_sealed_main_receipt_and_is_logged(env):
    lock, rounds = env
    record_round(make_receipt(candidate_tps=50.0, **rid_kwargs(10)), rounds, lock)
    slow = record_round(make_receipt(candidate_tps=44.25, label="none", **rid_kwargs()), rounds, lock)
    assert slots(lock)[SCORED_SLOT] == 50.0  # the round itself never lowers
    with pytest.raises(InputError, match="needs --reason"):
        frontier.lower_frontier(lock, SCORED_SLOT, 44.25, "  ", slow.path, rounds)
    with pytest.raises(InputError, match="measured 44.25 for .*, not 40.0"):
        frontier.lower_frontier(lock, SCORED_SLOT, 40.0, "new box", slow.path, rounds)
    with pytest.raises(InputError, match="not a frontier slot"):
        frontier.lower_frontier(lock, REF_SCORED_SLOT, 40.0, "new box", slow.path, rounds)
    pr = record_round(make_receipt(candidate_tps=30.0, is_main=False, label="none", **rid_kwargs(16)), rounds, lock)
    with pytest.raises(InputError, match="not measured on a clean main"):
        frontier.lower_frontier(lock, SCORED_SLOT, 30.0, "new box", pr.path, rounds)
    assert slots(lock)[SCORED_SLOT] == 50.0

    change = frontier.lower_frontier(lock, SCORED_SLOT, 44.25, "replacement box is 12% slower", slow.path, rounds)
    assert (change.before, change.after) == (50.0, 44.25)
    s = load_lock(lock).slots[SCORED_SLOT]
    assert (s.value, s.round) == (44.25, slow.receipt["round_id"])
    last = ledger.read_entries(rounds)[-1]
    assert (last.kind, last.reason, last.slot, last.frontier_before, last.frontier_after) == (
        "frontier-lower", "replacement box is 12% slower", SCORED_SLOT, 50.0, 44.25)
    assert verify(lock, rounds).problems == []
    with pytest.raises(InputError, match="not below the frontier"):
        frontier.lower_frontier(lock, SCORED_SLOT, 44.25, "again", slow.path, rounds)


def test_interrupted_round_is_reported_and_resumed(env, monkeypatch):
    lock, rounds = env

    def crash(*_a, **_k):
        raise KeyboardInterrupt

    # crash after the frontier-raise ledger line, before the lock write
    monkeypatch.setattr(frontier, "apply", crash)
    with pytest.raises(KeyboardInterrupt):
        record_round(make_receipt(candidate_tps=50.0, **rid_kwargs()), rounds, lock)
    monkeypatch.undo()
    assert SCORED_SLOT not in slots(lock)  # the lock is untouched
    problems = verify(lock, rounds).problems
    assert any(p.field == f"slots.{SCORED_SLOT}.value" and "frontier resume" in p.message for p in problems)
    path = next(rounds.glob("*.json"))
    rec = resume_round(path, rounds, lock)
    assert len(rec.changes) == 4 and slots(lock)[SCORED_SLOT] == 50.0
    assert [e.kind for e in ledger.read_entries(rounds)] == ["round", "frontier-raise"]  # not repeated
    assert verify(lock, rounds).problems == []
    assert resume_round(path, rounds, lock).changes == []  # idempotent


def test_cli_frontier_lower_and_show(env):
    import subprocess

    from cli_helpers import scoreboard_command

    lock, rounds = env
    record_round(make_receipt(candidate_tps=50.0, **rid_kwargs(10)), rounds, lock)
    slow = record_round(make_receipt(candidate_tps=44.25, label="none", **rid_kwargs()), rounds, lock)
    cmd = scoreboard_command()
    base = [*cmd, "frontier", "lower", "--lock", str(lock), "--rounds", str(rounds), "--target", "rcpt-test",
            "--slot", SCORED_SLOT, "--value", "44.25", "--receipt", str(slow.path)]
    out = subprocess.run([*base, "--reason", ""], capture_output=True, text=True)
    assert out.returncode == 1 and "needs --reason" in out.stderr
    out = subprocess.run([*base, "--reason", "replacement box"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    out = subprocess.run([*cmd, "frontier", "show", "--lock", str(lock), "--json"], capture_output=True, text=True)
    row = next(r for r in json.loads(out.stdout)["slots"] if r["slot"] == SCORED_SLOT)
    assert (row["value"], row["round"], row["kind"]) == (44.25, slow.receipt["round_id"], "frontier")


def test_a_main_round_measured_by_an_edited_harness_moves_nothing(env):
    """A faster main number measured by uncommitted harness code (scoreboard/) is not a measurement a
    frontier may rest on; a clean harness's is."""
    lock, rounds = env
    record_round(make_receipt(candidate_tps=50.0, **rid_kwargs(10)), rounds, lock)
    before = slots(lock)
    edited = make_receipt(candidate_tps=70.0, **rid_kwargs(12))
    edited["environment"]["harness"] = {"commit": MAIN_COMMIT, "dirty": True}
    rec = record_round(edited, rounds, lock)
    assert rec.changes == [] and slots(lock) == before
    assert frontier.ineligible(parse_receipt(rec.receipt)) == \
        "the harness (scoreboard/) that measured had uncommitted changes"
    clean = make_receipt(candidate_tps=70.0, **rid_kwargs())
    clean["environment"]["harness"] = {"commit": MAIN_COMMIT, "dirty": False}
    assert record_round(clean, rounds, lock).changes != []
    assert verify(lock, rounds).problems == []
