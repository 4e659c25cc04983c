"""`scoreboard frontier rebase`: a frontier whose commit this harness cannot run is re-based from a sealed main
receipt through a logged, verified ledger line, never by hand; every way around it is refused or found.

Real parts: sealed receipts, a real ledger and lock (history through records.record_round), the harness's own git
history for the contract check (922ce13e, the commit that set k3-mini-cpu's frontier on 2026-11-29, speaks
engine contract 1; HEAD speaks this harness's), `scoreboard verify` and the round's history loader.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from cli_helpers import run_cli
from receipt_factory import GUARD_SLOT, REF_SCORED_SLOT, SCORED_SLOT, TARGET, lock_with_test_target, make_receipt

from scoreboard.engine import CONTRACT_VERSION
from scoreboard.errors import InputError
from scoreboard.history import ledger
from scoreboard.history.held import load_history
from scoreboard.history.rebase import rebase_frontier
from scoreboard.history.records import record_round
from scoreboard.history.seal import make_seal
from scoreboard.history.verify import verify
from scoreboard.lockfile import load_lock
from scoreboard.round.candidate import HARNESS_ROOT, remeasure_problem

OLD = "922ce13e287f8b95cb63c8e3fc0e6d5369365eec"  # contract 1: this harness cannot run its engines
HEAD = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HARNESS_ROOT, capture_output=True, text=True).stdout.strip()


def _history(tmp_path: Path, frontier_commit: str = OLD) -> tuple[Path, Path]:
    """A BASELINE of the test target at `frontier_commit` (the pinned slots: 50 / 900 tok/s, baselines 40 / 800)."""
    lock = lock_with_test_target(tmp_path)
    rounds = tmp_path / "rounds"
    record_round(make_receipt(label="BASELINE", commit=frontier_commit, created_at="2026-11-29T10:00:00Z",
                              round_hex="00000001", block_drift=True), rounds, lock)
    assert load_lock(lock).slots[SCORED_SLOT].commit == frontier_commit
    return lock, rounds


def _main_round(rounds: Path, lock: Path, hex_: str = "00000002", at: str = "2026-12-02T10:00:00Z",
                frontier_arm: bool = False, **kw) -> Path:
    """A sealed main round scored against the pinned slots as the lock holds them (no frontier arm), on a
    slower box."""
    s = load_lock(lock).slots
    args = dict(label="inconclusive", candidate_tps=20.0, reference_tps=16.0, guard_tps=400.0, ref_guard_tps=350.0,
                created_at=at, round_hex=hex_, frontier_at_start=s[SCORED_SLOT].value,
                guard_frontier_at_start=s[GUARD_SLOT].value, baselines_at_start=(s[REF_SCORED_SLOT].value, 800.0),
                block_drift=True)
    args.update(kw)
    r = make_receipt(**args)
    if frontier_arm:
        for m in r["speed"]["metrics"]:
            m["arms"]["frontier"] = m["arms"]["candidate"]
    return record_round(r, rounds, lock).path


def _state(lock: Path, rounds: Path) -> tuple[bytes, bytes]:
    return lock.read_bytes(), ledger.ledger_path(rounds).read_bytes()


def test_rebase_through_the_cli_is_logged_verified_and_held(tmp_path, monkeypatch, capsys):
    lock, rounds = _history(tmp_path)
    r = _main_round(rounds, lock)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)  # the records live in a checkout
    code, out, err = run_cli(monkeypatch, capsys, "frontier", "rebase", "-t", TARGET, "--receipt", str(r),
                             "--reason", "frontier commit speaks engine contract 1; the new box", "--lock", str(lock),
                             "--rounds", str(rounds))
    assert code == 0, err
    text = " ".join(out.split())
    assert f"re-based frontier {SCORED_SLOT}: 49.98" in text and f"re-based baseline {REF_SCORED_SLOT}: 39.9" in text
    assert "records: " in text and "+1 line(s): frontier-rebase" in text
    keep = next(line for line in out.splitlines() if line.startswith("next (commit them"))
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "PATH": "/usr/bin:/bin"}
    subprocess.run(keep.split("checkout): ", 1)[1], shell=True, check=True, env=env, cwd="/")  # as printed
    committed = subprocess.run(["git", "-C", str(tmp_path), "show", "--name-only", "--format=%s", "HEAD"],
                               capture_output=True, text=True, check=True).stdout.split()
    assert "rounds/ledger.jsonl" in committed and "reference.lock" in committed, committed
    slots = load_lock(lock).slots
    assert (slots[SCORED_SLOT].value, slots[SCORED_SLOT].round) == (pytest.approx(20.0, rel=0.01), r.stem)
    assert slots[GUARD_SLOT].value == pytest.approx(400.0, rel=0.01)
    last = json.loads(ledger.read_lines(rounds)[-1])
    assert last["kind"] == "frontier-rebase" and last["round_id"] == r.stem
    assert f"speaks engine contract 1, this harness {CONTRACT_VERSION}" in last["reason"] and "the new box" in last["reason"]
    assert {c["slot"] for c in last["changes"]} >= {SCORED_SLOT, GUARD_SLOT, REF_SCORED_SLOT}
    assert verify(lock, rounds).ok, verify(lock, rounds).problems
    held = load_history(rounds, load_lock(lock), TARGET, lock)  # what the next round is judged against
    assert held.scored_frontier is not None and held.scored_frontier.round_id == r.stem
    code, out, _ = run_cli(monkeypatch, capsys, "ladder", "--rounds", str(rounds), "--json", "--lock", str(lock))
    assert code == 0 and any(s["kind"] == "frontier-rebase" for s in json.loads(out)["steps"])


def test_rebase_goes_either_direction(tmp_path):
    lock, rounds = _history(tmp_path)
    r = _main_round(rounds, lock, candidate_tps=60.0, reference_tps=48.0)  # a faster box: above the slot
    changes = rebase_frontier(lock, r, "faster box", rounds, TARGET, remeasure_problem)
    assert next(c for c in changes if c.slot == SCORED_SLOT).after > 50.0
    assert verify(lock, rounds).ok


@pytest.mark.parametrize("case,match", [
    ("remeasurable", "can be re-measured by this harness"),
    ("pr", "not measured on a clean main"),
    ("frontier_arm", "re-measured the frontier's commit in the same round"),
    ("gate_failed", "the round has no speed numbers"),  # a failed gate times nothing
    ("zero_variance", "no measurement"),
    ("moved_since", "the slot moved since that round"),
    ("other_target", "round is for target 'rcpt-test', not 'k3-mini-cpu'"),
    ("no_reason", "needs --reason"),
])
def test_rebase_refusals_write_nothing(tmp_path, case, match):
    lock, rounds = _history(tmp_path, HEAD if case == "remeasurable" else OLD)
    kw: dict = {}
    if case == "pr":
        kw = dict(is_main=False, label="none")
    elif case == "frontier_arm":
        kw = dict(frontier_arm=True)
    elif case == "gate_failed":
        kw = dict(gate_pass=False)
    elif case == "zero_variance":
        kw = dict(block_drift=False)
    r = _main_round(rounds, lock, **kw)
    if case == "moved_since":  # a later main round raised the slot: the older round was judged against 50, not 52
        s = load_lock(lock).slots
        record_round(make_receipt(label="S", candidate_tps=52.0, created_at="2026-12-03T10:00:00Z", commit=OLD,
                                  round_hex="00000003", frontier_at_start=s[SCORED_SLOT].value,
                                  guard_frontier_at_start=s[GUARD_SLOT].value, block_drift=True), rounds, lock)
        assert load_lock(lock).slots[SCORED_SLOT].value > 51
    before = _state(lock, rounds)
    with pytest.raises(InputError, match=match):
        rebase_frontier(lock, r, "" if case == "no_reason" else "because", rounds,
                        "k3-mini-cpu" if case == "other_target" else TARGET, remeasure_problem)
    assert _state(lock, rounds) == before


def test_an_edited_receipt_cannot_rebase(tmp_path, monkeypatch, capsys):
    lock, rounds = _history(tmp_path)
    r = _main_round(rounds, lock)
    data = json.loads(r.read_text())
    for m in data["speed"]["metrics"]:
        m["arms"]["candidate"]["blocks"][0]["samples_ns"][0] //= 2
    r.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    before = _state(lock, rounds)
    code, _, err = run_cli(monkeypatch, capsys, "frontier", "rebase", "--target", TARGET, "--receipt", str(r),
                           "--reason", "x", "--lock", str(lock), "--rounds", str(rounds))
    assert code == 2 and "seal" in err
    assert _state(lock, rounds) == before


def _forge_rebase_line(lock: Path, rounds: Path, receipt: Path) -> None:
    """What a hand edit would do: a chained frontier-rebase line and the lock to match, past every check."""
    from scoreboard.history import frontier
    from scoreboard.history.frontier import measured_slots
    from scoreboard.history.ledger import SlotChange
    from scoreboard.history.receipt import parse_receipt

    data = parse_receipt(json.loads(receipt.read_text()))
    lk = load_lock(lock)
    changes = [SlotChange(slot=m.slot, kind=m.kind, before=lk.slots[m.slot].value, after=m.value, reps=m.reps,
                          commit=m.commit) for m in measured_slots(data) if m.slot == SCORED_SLOT]
    ledger.append(rounds, frontier._slot_entry("frontier-rebase", data, receipt, changes, lk, "hand-made"))
    frontier.apply(lock, changes, data, "hand-made", "re-based")


def test_verify_finds_a_forged_rebase_from_a_round_that_re_measured_the_frontier(tmp_path):
    lock, rounds = _history(tmp_path)
    r = _main_round(rounds, lock, frontier_arm=True)
    _forge_rebase_line(lock, rounds, r)
    problems = [str(p) for p in verify(lock, rounds).problems]
    assert any("may not write slots" in p and "re-measured the frontier's commit" in p for p in problems), problems


def test_verify_finds_a_rebase_line_without_a_reason(tmp_path):
    lock, rounds = _history(tmp_path)
    r = _main_round(rounds, lock)
    rebase_frontier(lock, r, "because", rounds, TARGET, remeasure_problem)
    assert verify(lock, rounds).ok
    lines = ledger.read_lines(rounds)
    last = json.loads(lines[-1])
    last["reason"] = " "
    lines[-1] = ledger.line_bytes(last)
    ledger.ledger_path(rounds).write_bytes(b"".join(x + b"\n" for x in lines))
    problems = [str(p) for p in verify(lock, rounds).problems]
    assert any("a re-base needs a reason" in p for p in problems), problems


def test_rebase_needs_the_receipt_recorded_on_the_ledger(tmp_path):
    """A receipt sealed by hand and dropped into rounds/ without its round line is no record."""
    lock, rounds = _history(tmp_path)
    s = load_lock(lock).slots
    r = make_receipt(label="inconclusive", candidate_tps=20.0, created_at="2026-12-02T10:00:00Z", round_hex="0000abcd",
                     frontier_at_start=s[SCORED_SLOT].value, guard_frontier_at_start=s[GUARD_SLOT].value,
                     block_drift=True)
    from scoreboard.history.receipt import normalize
    from scoreboard.history.records import file_bytes

    body = normalize(r)
    path = rounds / f"{r['round_id']}.json"
    path.write_bytes(file_bytes({**body, "seal": make_seal(body, ledger.head_sha256(rounds))}))
    before = _state(lock, rounds)
    with pytest.raises(Exception, match="has no ledger line"):
        rebase_frontier(lock, path, "because", rounds, TARGET, remeasure_problem)
    assert _state(lock, rounds) == before
