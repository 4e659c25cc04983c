"""History read and verified before a round (scoreboard.history.held), the same-round frontier basis and
zero-variance flags in the verdict (scoreboard.tiers), and `frontier resume` re-chaining receipts the
ledger lost. Synthetic receipts (receipt_factory), real lock copies, real rounds/ directories."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from receipt_factory import SCORED_SLOT, TARGET, lock_with_test_target, make_receipt

from scoreboard.history import ledger
from scoreboard.errors import InputError, NonCompliant
from scoreboard.history.held import load_history
from scoreboard.lockfile import load_lock
from scoreboard.history.receipt import parse_receipt, utc_now
from scoreboard.history.records import rechain, record_round, resume_round, write_receipt
from scoreboard.tiers import verdict_from_receipt
from scoreboard.history.verify import verify

_n = iter(range(1, 10_000))


def rid(**kw) -> dict:
    """A fresh round id stamped now (the ledger's raise lines are stamped with the real clock)."""
    return {"round_hex": f"{next(_n):08x}", "created_at": utc_now(), **kw}


@pytest.fixture
def env(tmp_path: Path) -> tuple[Path, Path]:
    return lock_with_test_target(tmp_path), tmp_path / "rounds"


def noisy(receipt: dict, seed: int = 0) -> dict:
    """Give every rep its own time (the factory repeats one pattern per block): a real clock's samples."""
    import numpy as np

    rng = np.random.default_rng(seed)
    for m in (receipt.get("speed") or {}).get("metrics", []):
        for arm in m["arms"].values():
            for b in arm["blocks"]:
                b["samples_ns"] = [max(1, int(ns * rng.lognormal(0.0, 0.004))) for ns in b["samples_ns"]]
                b["wall_ns"] = sum(b["samples_ns"]) + 1000
    return receipt


def frontier_arm(receipt: dict, tps: dict[str, float], seed: int = 1) -> dict:
    """Add a main round's "frontier" arm at `tps` per metric phase (shared per-block box drift)."""
    from receipt_factory import _blocks

    for m in receipt["speed"]["metrics"]:
        cand = m["arms"]["candidate"]["blocks"]
        m["arms"]["frontier"] = {"blocks": _blocks(tps[m["phase"]], m["n_tokens"], len(cand), len(cand[0]["samples_ns"]),
                                                   True)}
    return noisy(receipt, seed)


# ----------------------------------------------------------------------------------------------
# history at preflight

def test_history_holds_ratchet_basis_frontier_and_tip(env):
    lock, rounds = env
    first = record_round(make_receipt(candidate_tps=50.0, **rid()), rounds, lock)
    record_round(make_receipt(is_main=False, label="none", **rid()), rounds, lock)  # a PR: never the basis
    h = load_history(rounds, load_lock(lock), TARGET, lock)
    assert h.ratchet.round_id == first.receipt["round_id"] and h.ratchet_baselines() == {512: 1e-4}
    fs = h.scored_frontier
    assert (fs.slot, fs.value, fs.round_id, fs.commit) == (SCORED_SLOT, 50.0, first.receipt["round_id"],
                                                           first.receipt["candidate"]["commit"])
    assert h.tip == ledger.head_sha256(rounds) and len(h.lines) == 3
    assert [r["round_id"] for r in h.recent_receipts()][-1] == first.receipt["round_id"]  # newest first
    held = h.recent_receipts(1)[0]
    held["gate"]["depths"][0]["kl_mean"] = 9.0  # a caller's copy: the held bytes never change
    assert h.recent_receipts(1)[0]["gate"]["depths"][0]["kl_mean"] == 1e-4
    # hiding the receipts afterwards changes nothing the round holds
    for p in rounds.glob("*.json"):
        p.rename(p.with_suffix(".hidden"))
    assert h.ratchet_baselines() == {512: 1e-4} and h.scored_frontier == fs


def test_no_history_is_an_empty_history(env):
    lock, rounds = env
    h = load_history(rounds, load_lock(lock), TARGET, lock)
    assert (h.ratchet, h.frontier, h.tip, h.receipts) == (None, (), "", ())
    assert not rounds.exists()  # reading never creates rounds/


def _damage(kind: str, rounds: Path, path: Path, lock: Path) -> str:
    if kind == "missing":
        path.unlink()
        return "missing, but"
    if kind == "edited":  # the ratchet basis rewritten with its seal recomputed: file bytes differ from the line
        data = json.loads(path.read_bytes())
        data["gate"]["depths"][0]["kl_mean"] = 1.0
        path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        return "not the ones"
    if kind == "chain":
        lines = (rounds / "ledger.jsonl").read_bytes().split(b"\n")
        (rounds / "ledger.jsonl").write_bytes(b"\n".join(lines[1:]))  # first line deleted
        return "chain is broken"
    if kind == "slot":  # a hand-raised frontier
        text = lock.read_text().replace("value = 50.0", "value = 99.0", 1)
        assert text != lock.read_text()
        lock.write_text(text)
        return "but the ledger's last change of it"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["missing", "edited", "chain", "slot"])
def test_broken_history_is_refused_naming_the_file_and_the_fix(env, kind):
    lock, rounds = env
    rec = record_round(make_receipt(candidate_tps=50.0, **rid()), rounds, lock)
    want = _damage(kind, rounds, rec.path, lock)
    with pytest.raises(InputError) as exc:
        load_history(rounds, load_lock(lock), TARGET, lock)
    assert want in exc.value.message
    assert "scoreboard verify" in exc.value.hint or "frontier resume" in exc.value.hint


def test_a_seal_that_does_not_verify_is_refused(env):
    """Bytes matching the ledger line but not the seal cannot happen by accident: the line and file were
    rewritten together. Refused on the seal."""
    lock, rounds = env
    rec = record_round(make_receipt(candidate_tps=50.0, **rid()), rounds, lock)
    data = json.loads(rec.path.read_bytes())
    data["gate"]["depths"][0]["kl_mean"] = 1.0  # seal left as it was
    raw = (json.dumps(data, indent=1, sort_keys=True) + "\n").encode()
    rec.path.write_bytes(raw)
    lines = [json.loads(x) for x in (rounds / "ledger.jsonl").read_bytes().splitlines()]
    from scoreboard.history.seal import sha256_hex

    lines[0]["receipt_sha256"] = sha256_hex(raw)
    out, prev = [], ""
    for obj in lines:  # re-hash the chain after the edit, as a careful forger would
        obj["prev_sha256"] = prev
        b = ledger.line_bytes(obj)
        out.append(b)
        prev = sha256_hex(b)
    (rounds / "ledger.jsonl").write_bytes(b"".join(x + b"\n" for x in out))
    with pytest.raises(InputError, match="seal does not verify .*gate.depths"):
        load_history(rounds, load_lock(lock), TARGET, lock)


def test_ledger_replaced_during_the_round_refuses_to_seal(env):
    lock, rounds = env
    record_round(make_receipt(candidate_tps=50.0, **rid()), rounds, lock)
    h = load_history(rounds, load_lock(lock), TARGET, lock)
    h.check_extends()  # unchanged: fine
    write_receipt(make_receipt(is_main=False, label="none", **rid()), rounds)
    h.check_extends()  # appended by someone else: still begins with what was verified
    (rounds / "ledger.jsonl").rename(rounds / "ledger.hidden")  # hidden: a new chain would start
    with pytest.raises(NonCompliant, match="no longer begins with the"):
        h.check_extends()


# ----------------------------------------------------------------------------------------------
# the verdict: same-round frontier basis, old receipts, zero variance

def test_main_round_gain_is_the_paired_ratio_against_the_frontier_arm():
    """The box ran 20% faster than when the slot was set: against the slot it reads +20% (XL), against
    the frontier commit measured in the same blocks it reads ~0."""
    r = frontier_arm(make_receipt(candidate_tps=60.0, guard_tps=1080.0, frontier_at_start=50.0, blocks=6),
                     {"decode": 60.0, "prefill": 1080.0})
    parse_receipt(r)
    v = verdict_from_receipt(r)
    assert v.basis == "frontier-same-round" and v.label in ("none", "inconclusive"), v
    assert abs(v.gain) < 0.01 and v.frontier == pytest.approx(60.0, rel=0.01)
    # the slot recorded in the receipt plays no part in it
    r2 = copy.deepcopy(r)
    for m in r2["speed"]["metrics"]:
        m["frontier"] = 5.0
    assert verdict_from_receipt(r2).gain == v.gain and verdict_from_receipt(r2).gain_ci == v.gain_ci
    # and a real gain against the frontier arm is a tier
    r3 = frontier_arm(make_receipt(candidate_tps=60.0, guard_tps=1080.0, frontier_at_start=50.0, blocks=6),
                      {"decode": 52.0, "prefill": 1080.0})
    v3 = verdict_from_receipt(r3)
    assert (v3.basis, v3.label) == ("frontier-same-round", "L") and v3.gain == pytest.approx(60 / 52 - 1, abs=0.01)
    assert "re-measured in the same round" in v3.explanation


def test_old_main_receipts_still_score_against_the_slot():
    r = noisy(make_receipt(candidate_tps=60.0, frontier_at_start=50.0, blocks=6))
    v = verdict_from_receipt(r)
    assert v.basis == "frontier-slot" and v.label == "XL" and v.gain == pytest.approx(0.2, abs=0.01)


def test_a_frontier_arm_belongs_to_main_rounds_only():
    r = frontier_arm(make_receipt(is_main=False, candidate_tps=60.0), {"decode": 50.0, "prefill": 900.0})
    with pytest.raises(InputError, match="a PR round has no 'frontier' arm"):
        parse_receipt(r)


def _fixed(receipt: dict, arm: str, phase: str = "decode", per_block: bool = False) -> dict:
    for m in receipt["speed"]["metrics"]:
        if m["phase"] != phase:
            continue
        first = m["arms"][arm]["blocks"][0]["samples_ns"][0]
        for b in m["arms"][arm]["blocks"]:  # per block: one time repeated; else one time for every rep
            b["samples_ns"] = [(b["samples_ns"][0] if per_block else first)] * len(b["samples_ns"])
    return receipt


@pytest.mark.parametrize("arm, per_block, want", [
    ("candidate", False, "all 18 timed reps took exactly"),
    ("candidate", True, "every rep of block 0 took the same"),
    ("reference", False, "arm reference: all 18 timed reps"),
    ("frontier", False, "arm frontier: all 18 timed reps"),
])
def test_zero_variance_samples_are_flagged_not_scored(arm, per_block, want):
    r = frontier_arm(make_receipt(candidate_tps=60.0, guard_tps=1080.0, frontier_at_start=50.0, blocks=6, reps=3),
                     {"decode": 40.0, "prefill": 1080.0})
    assert verdict_from_receipt(r).label == "XL"  # +50%: a tier when honest
    v = verdict_from_receipt(_fixed(r, arm, per_block=per_block))
    assert (v.label, v.speed_label) == ("inconclusive", "inconclusive")
    assert v.flags and want in v.flags[0] and any(x.startswith("not scored: ") for x in v.reasons)
    assert "zero variance" in v.explanation


def test_identical_block_values_are_a_zero_width_ci_and_flagged():
    """One rep per block, every block the same number: the factory's own samples, a zero-width CI."""
    r = make_receipt(candidate_tps=60.0, frontier_at_start=50.0, blocks=4, reps=3)
    v = verdict_from_receipt(r)
    assert v.label == "inconclusive" and "block values are identical" in v.flags[0]


def test_zero_variance_never_sets_a_baseline_and_a_flagged_guard_cannot_hide_a_regression():
    base = _fixed(noisy(make_receipt(candidate_tps=60.0, blocks=6)), "candidate")
    v = verdict_from_receipt(base)
    assert v.label == "inconclusive" and v.basis == "none"  # not BASELINE: a fixed number never becomes the basis
    # a guard that regresses 30% (honest samples) still REJECTs even with the scored metric flagged
    r = frontier_arm(make_receipt(is_main=True, candidate_tps=60.0, guard_tps=600.0, blocks=6), {"decode": 60.0,
                                                                                                 "prefill": 900.0})
    r["candidate"]["is_main"] = False  # judged as a PR: guards convict
    r["candidate"]["label"] = "pr-7"
    for m in r["speed"]["metrics"]:
        m["arms"]["main"] = m["arms"].pop("frontier")
    r["main"] = dict(r["candidate"], label="main", is_main=True)
    v = verdict_from_receipt(_fixed(r, "candidate"))
    assert v.label == "REJECT" and v.speed_label == "inconclusive" and v.flags
    # and a flagged guard is not judged (its fixed numbers neither convict nor clear)
    v = verdict_from_receipt(_fixed(r, "candidate", phase="prefill"))
    assert v.label != "REJECT" and any("prefill" in f for f in v.flags)


# ----------------------------------------------------------------------------------------------
# frontier resume: receipts sealed after a lost frontier-raise line

def same_history(now: bytes, before: bytes) -> bool:
    """Byte-identical, except the time of a final frontier-raise line: no later seal fixes it, so it is
    rewritten with the time of the resume."""
    a, b = now.splitlines(), before.splitlines()
    if a[:-1] != b[:-1] or len(a) != len(b):
        return False
    x, y = json.loads(a[-1]), json.loads(b[-1])
    return x["kind"] == "frontier-raise" and {**x, "date": ""} == {**y, "date": ""}


def _history_of_16(lock: Path, rounds: Path) -> list[Path]:
    """16 rounds: main rounds that raise (each followed by a frontier-raise line), PRs and a REJECT."""
    paths, tps = [], 50.0
    for i in range(16):
        if i % 3 == 2:
            r = make_receipt(is_main=False, label="none", candidate_tps=tps, **rid())
        elif i == 7:
            r = make_receipt(gate_pass=False, **rid())
        else:
            tps += 1.0
            r = make_receipt(candidate_tps=tps, reference_tps=40.0 + i, label="S", **rid())
        paths.append(record_round(r, rounds, lock).path)
    assert verify(lock, rounds).problems == []
    return paths


@pytest.mark.parametrize("lost", ["whole ledger", "all but the first line"])
def test_resume_rechains_receipts_sealed_after_frontier_raise_lines(env, lost):
    lock, rounds = env
    paths = _history_of_16(lock, rounds)
    full = (rounds / "ledger.jsonl").read_bytes()
    n_raise = sum(1 for e in ledger.read_entries(rounds) if e.kind == "frontier-raise")
    assert n_raise >= 9
    lines = full.split(b"\n")
    (rounds / "ledger.jsonl").write_bytes(b"" if lost == "whole ledger" else lines[0] + b"\n")
    # `frontier resume --receipt` receipt by receipt, oldest first (what an operator would run)
    orphaned = []
    for p in paths:
        try:
            resume_round(p, rounds, lock)
        except NonCompliant:
            orphaned.append(p)
    assert orphaned == [], f"{len(orphaned)} of {len(paths)} receipts orphaned"
    # every line rebuilt byte for byte, and the history verifies
    assert same_history((rounds / "ledger.jsonl").read_bytes(), full)
    assert verify(lock, rounds).problems == []


def test_rechain_rebuilds_the_lock_too_and_reports_what_it_cannot_prove(env):
    lock, rounds = env
    lock_before = lock.read_text()
    paths = _history_of_16(lock, rounds)
    lock_after = load_lock(lock).slots
    full = (rounds / "ledger.jsonl").read_bytes()
    (rounds / "ledger.jsonl").unlink()
    lock.write_text(lock_before)  # the lock lost its slots too (restored from an old copy)
    out = rechain(rounds, lock)
    assert same_history((rounds / "ledger.jsonl").read_bytes(), full) and out.orphaned == []
    assert {k: v.value for k, v in load_lock(lock).slots.items()} == {k: v.value for k, v in lock_after.items()}
    assert verify(lock, rounds).problems == []
    assert rechain(rounds, lock).appended == []  # idempotent
    # a receipt sealed after a line that no receipt can rebuild stays off, and is named
    stray = make_receipt(is_main=False, label="none", **rid())
    from scoreboard.history.records import _seal_and_write

    p, _, _ = _seal_and_write(stray, rounds, "ab" * 32, None)
    out = rechain(rounds, lock)
    assert out.appended == [] and [x for x, _ in out.orphaned] == [p]
    with pytest.raises(NonCompliant, match="cannot be re-chained"):
        resume_round(p, rounds, lock)


def test_cli_frontier_resume_without_receipt_rechains_everything(env):
    import subprocess
    import sys

    lock, rounds = env
    _history_of_16(lock, rounds)
    full = (rounds / "ledger.jsonl").read_bytes()
    (rounds / "ledger.jsonl").unlink()
    cmd = [sys.executable, "-m", "scoreboard.cli.main", "frontier", "resume", "--lock", str(lock), "--rounds",
           str(rounds)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "re-chained" in out.stdout and same_history((rounds / "ledger.jsonl").read_bytes(), full)


def test_a_comparison_arms_fault_is_no_sound_basis_never_the_candidates_reject():
    """The frontier arm is another commit in its own sandbox: its failed output check or its reps above the
    ceiling leave the metric unscored (inconclusive); its outputs varying while each passes is a note."""
    def case() -> dict:
        return frontier_arm(make_receipt(candidate_tps=60.0, guard_tps=1080.0, frontier_at_start=50.0, blocks=6),
                            {"decode": 52.0, "prefill": 1080.0})

    assert verdict_from_receipt(case()).label == "L"
    r = case()
    dec = next(m for m in r["speed"]["metrics"] if m["phase"] == "decode")
    dec["arms"]["frontier"]["output_check"] = {"ok": False, "reasons": ["variant 1: the timed output fails the "
                                                                        "reference check"], "notes": []}
    v = verdict_from_receipt(r)
    assert v.label == "inconclusive" and v.speed_label == "inconclusive", v
    assert any("no sound basis" in f and "fails the reference check" in f for f in v.flags)
    assert "The candidate is not at fault" in v.explanation
    r = case()
    dec = next(m for m in r["speed"]["metrics"] if m["phase"] == "decode")
    r["speed"]["ceiling"] = {"decode_max_tok_s": 70.0, "memory_bandwidth_gbs": 4800, "devices": 1,
                             "decode_bytes_per_token": 1}  # the candidate's 60 tok/s is under it
    for b in dec["arms"]["frontier"]["blocks"]:  # the frontier arm at ~5,200 tok/s: above it
        b["samples_ns"] = [max(1, x // 100) for x in b["samples_ns"]]
    v = verdict_from_receipt(r)
    assert v.label == "inconclusive" and any("frontier arm" in f and "no sound basis" in f for f in v.flags), v
    # outputs that vary across blocks, the check passed (each graded by the reference): scored, with a note
    r = case()
    dec = next(m for m in r["speed"]["metrics"] if m["phase"] == "decode")
    for i, b in enumerate(dec["arms"]["frontier"]["blocks"]):
        b["variants"] = [0] * len(b["samples_ns"])
        b["token_ids"] = [[1, 2, 3 + i % 2]] * len(b["samples_ns"])
    dec["arms"]["frontier"]["output_check"] = {"ok": True, "reasons": [], "notes": ["variant 0 gave 2 different "
                                                                                    "outputs across blocks"]}
    v = verdict_from_receipt(r)
    assert v.label == "L" and not v.flags
    assert any("outputs varied across blocks (variant 0: 2 outputs)" in x for x in v.reasons), v.reasons


def test_an_unsound_main_arm_on_a_guard_never_lets_a_regressing_pr_earn_a_tier():
    """The attack: a PR whose prefill regressed 30% (the guard would REJECT it) and a main arm whose prefill
    outputs failed their check. The unjudged guard must not leave the scored gain free to earn a tier: any
    metric without a sound basis makes the verdict inconclusive."""
    r = frontier_arm(make_receipt(is_main=True, candidate_tps=60.0, guard_tps=600.0, blocks=6),
                     {"decode": 50.0, "prefill": 900.0})
    r["candidate"]["is_main"] = False  # judged as a PR: guards convict
    r["candidate"]["label"] = "pr-9"
    for m in r["speed"]["metrics"]:
        m["arms"]["main"] = m["arms"].pop("frontier")
    r["main"] = dict(r["candidate"], label="main", is_main=True)
    assert verdict_from_receipt(r).label == "REJECT"  # honest main arm: the guard convicts
    pre = next(m for m in r["speed"]["metrics"] if m["phase"] == "prefill")
    pre["arms"]["main"]["output_check"] = {"ok": False, "reasons": ["variant 0: the timed output fails the "
                                                                    "reference check"], "notes": []}
    v = verdict_from_receipt(r)
    assert v.label == "inconclusive" and v.label not in ("XS", "S", "M", "L", "XL"), v
    assert any("no sound basis" in f for f in v.flags)
