"""scoreboard.tiers + `scoreboard tier`: the verdict rules, receipts re-derived, claims, golden incidents."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from cli_helpers import run_cli
import tomlkit

from scoreboard.errors import InputError
from scoreboard.lockfile import Metric, Target, TierPolicy, load_lock, parse_lock, set_slot
from scoreboard.stats import RatioCI
from scoreboard.tiers import (LABELS, Evidence, Verdict, decide, evidence, score_claim, summarize_speed,
                              verdict_from_receipt)

GOLDEN = Path(__file__).parent / "golden" / "tiers"
FLAGSHIP = "kimi-k3-h200x8-iq1s"
POLICY = TierPolicy(buckets={"XS": 0.02, "S": 0.035, "M": 0.06, "L": 0.10, "XL": 0.18}, max_ci_width=0.04,
                    guard_tolerance=0.01, confidence=0.95, bootstrap_resamples=500)
DEC = Metric(phase="decode", depth=512, n_tokens=32, role="scored")
LAT = Metric(phase="decode", depth=512, n_tokens=32, role="scored", higher_is_better=False)
GUARD = Metric(phase="prefill", depth=0, n_tokens=256, role="guard")


def _golden(name: str) -> dict:
    return json.loads((GOLDEN / f"{name}.json").read_text(encoding="utf-8"))


def _case(name: str, i: int = 0) -> dict:
    return copy.deepcopy(_golden(name)["cases"][i]["receipt"])


def _ev(ratio: float, low: float, high: float, metric: Metric = GUARD, frontier: float = 100.0) -> Evidence:
    """Evidence with an exact, hand-set interval (for boundary tests)."""
    return Evidence("m", metric.role, metric.higher_is_better, frontier * ratio, "main-same-round", frontier,
                    RatioCI(ratio, low, high, 0.95, 6, "BCa"))


def _scored(value: float, frontier: float = 100.0, metric: Metric = DEC, policy: TierPolicy = POLICY) -> Evidence:
    """Zero-width evidence: six identical blocks against a constant slot."""
    return evidence(metric, [value] * 6, policy, seed=1, frontier_slot=frontier)


# ----------------------------------------------------------------------------------------------
# the rules

def test_gain_direction_higher_and_lower_is_better():
    up = decide(True, [], _scored(110.0), [], POLICY)
    assert (up.label, up.gain) == ("L", pytest.approx(0.10))
    # latency-like metric: 90 against a frontier of 100 is a 10% gain, 110 is a 10% loss
    down = decide(True, [], _scored(90.0, metric=LAT), [], POLICY)
    assert (down.label, down.gain) == ("L", pytest.approx(0.10))
    worse = decide(True, [], _scored(110.0, metric=LAT), [], POLICY)
    assert (worse.label, worse.gain) == ("regression", pytest.approx(-0.10))
    assert worse.gain_ci == pytest.approx((-0.10, -0.10))


def test_thresholds_come_from_the_policy_not_from_code():
    steep = POLICY.model_copy(update={"buckets": {"XS": 0.2, "XL": 0.5}})
    assert decide(True, [], _scored(110.0), [], steep).label == "none"
    assert decide(True, [], _scored(125.0), [], steep).label == "XS"
    assert decide(True, [], _scored(150.0), [], steep).label == "XL"
    wide = POLICY.model_copy(update={"max_ci_width": 0.5})
    noisy = evidence(DEC, [100.0, 115.0, 108.0, 112.0, 104.0, 111.0], wide, seed=3, frontier_slot=100.0)
    assert decide(True, [], noisy, [], wide).label != "inconclusive"
    assert decide(True, [], noisy, [], POLICY).label == "inconclusive"


def test_gate_failure_rejects_without_speed_numbers():
    v = decide(False, ["gate depth 512: top-1 0.5 < 0.95"], _scored(150.0), [], POLICY)
    assert (v.label, v.speed_label, v.gain, v.gain_ci, v.value, v.basis) == ("REJECT", None, None, None, None, "none")
    assert "top-1 0.5" in v.explanation and not v.compliant


def test_guard_failure_rejects_but_reports_the_speed_label():
    v = decide(True, [], _scored(120.0), [_ev(0.8, 0.78, 0.82)], POLICY)
    assert (v.label, v.speed_label) == ("REJECT", "XL")
    assert v.gain == pytest.approx(0.20)
    assert "would have earned XL" in v.explanation
    assert v.reasons[0].startswith("guard m regressed")


@pytest.mark.parametrize("low,high,fails", [
    (0.97, 0.99, False),  # upper bound exactly at 1 - tolerance: not significantly worse
    (0.97, 0.9899, True),  # just below: the whole CI is worse than the tolerance
    (0.95, 1.01, False),  # a noisy guard whose CI reaches 1 does not fail
    (0.98, 0.995, False),  # worse, but within the tolerance
])
def test_guard_boundaries_higher_is_better(low, high, fails):
    point = (low + high) / 2
    v = decide(True, [], _scored(105.0), [_ev(point, low, high)], POLICY)
    assert (v.label == "REJECT") is fails
    assert v.speed_label == "S"


@pytest.mark.parametrize("low,fails", [(1.01, False), (1.0101, True)])
def test_guard_boundaries_lower_is_better(low, fails):
    # a latency guard: candidate/basis >= 1.0101 over the whole CI is > 1% worse
    lat_guard = Metric(phase="prefill", depth=0, n_tokens=256, role="guard", higher_is_better=False)
    v = decide(True, [], _scored(105.0), [_ev(low + 0.01, low, low + 0.02, metric=lat_guard)], POLICY)
    assert (v.label == "REJECT") is fails


def test_guard_without_basis_cannot_regress():
    g = evidence(GUARD, [50.0, 50.0], POLICY, seed=0, frontier_slot=0.0)
    v = decide(True, [], _scored(105.0), [g], POLICY)
    assert v.label == "S"
    assert any("no basis yet, cannot regress" in r for r in v.reasons)


def test_baseline_when_there_is_no_frontier():
    v = decide(True, [], evidence(DEC, [7.0, 7.2, 6.9], POLICY, seed=0, frontier_slot=0.0), [], POLICY)
    assert (v.label, v.basis, v.gain, v.frontier) == ("BASELINE", "none", None, None)
    assert v.value == pytest.approx((7.0 * 7.2 * 6.9) ** (1 / 3))


def test_inconclusive_names_the_blocks_to_add():
    ev = evidence(DEC, [100.0, 115.0, 96.0, 112.0, 104.0, 111.0], POLICY, seed=3, frontier_slot=100.0)
    v = decide(True, [], ev, [], POLICY)
    assert v.label == "inconclusive"
    width = v.gain_ci[1] - v.gain_ci[0]
    assert width > POLICY.max_ci_width
    assert "rerun with about" in v.reasons[0] and "(add " in v.reasons[0]


@pytest.mark.parametrize("low,high,label", [
    (0.97, 0.9899, "regression"),  # the whole CI below 1 - guard_tolerance (1%): significantly worse
    (0.97, 0.99, "none"),  # upper bound exactly at the tolerance: not significantly worse than it
    (0.975, 1.005, "none"),  # a drop whose CI reaches 1
    (0.985, 0.995, "none"),  # worse, but within the tolerance
])
def test_a_scored_metric_below_the_tolerance_is_a_regression(low, high, label):
    v = decide(True, [], _ev((low + high) / 2, low, high, metric=DEC), [], POLICY)
    assert (v.label, v.speed_label) == (label, label)
    assert v.compliant is (label != "regression")
    if label == "regression":
        assert "entirely below -1.00% (guard_tolerance)" in v.reasons[0]
        assert "that is a regression, not noise" in v.explanation


def test_a_noisy_drop_is_inconclusive_before_it_is_a_regression():
    v = decide(True, [], _ev(0.90, 0.85, 0.95, metric=DEC), [], POLICY)  # CI 10 points wide > max_ci_width 4
    assert v.label == "inconclusive"


def test_significance_needs_the_ci_lower_bound_above_zero():
    # point gain 2.5% (>= XS) but the CI reaches below zero: none, not XS
    v = decide(True, [], _ev(1.025, 0.999, 1.035, metric=DEC), [], POLICY)
    assert (v.label, v.gain) == ("none", pytest.approx(0.025))
    assert "not above 0" in v.reasons[0]
    # lower bound above zero but the point gain below the smallest bucket: none
    v = decide(True, [], _ev(1.015, 1.005, 1.025, metric=DEC), [], POLICY)
    assert v.label == "none" and "below the smallest bucket XS" in v.reasons[0]


def test_verdict_dict_has_the_receipt_layout_and_is_strict_json():
    v = decide(True, [], _scored(104.0), [], POLICY)
    d = v.as_dict()
    assert set(d) == {"label", "gain", "gain_ci", "basis", "frontier", "value", "speed_label", "reasons",
                      "explanation", "claim", "flags"}
    assert d["label"] in LABELS
    json.dumps(d, allow_nan=False)


# ----------------------------------------------------------------------------------------------
# claims

def _lock(slot_value: float | None = 98.80):
    doc = tomlkit.parse((GOLDEN.parent.parent.parent / "reference.lock").read_text(encoding="utf-8"))
    if slot_value is not None:
        set_slot(doc, "KIMI_K3_H200X8_IQ1S_SPARKINFER_DECODE_128K",
                 {"value": slot_value, "round": "r1", "commit": "a" * 40, "measured_at": "2026-08-06T00:00:00Z"})
    return tomlkit.dumps(doc)


def test_a_claim_is_labelled_as_a_claim():
    v = score_claim(116.584, parse_lock(_lock()), FLAGSHIP)
    assert (v.label, v.claim, v.basis, v.gain_ci) == ("XL", True, "frontier-slot", None)
    assert v.frontier == 98.80 and v.value == 116.584
    assert "claimed, not measured" in v.explanation and "moves nothing" in v.explanation
    assert score_claim(100.0, parse_lock(_lock()), FLAGSHIP).label == "none"


def test_a_claim_without_a_frontier_is_a_baseline_claim():
    v = score_claim(50.0, parse_lock(_lock(None)), FLAGSHIP)
    assert (v.label, v.claim, v.basis) == ("BASELINE", True, "none")


def test_claim_input_errors():
    lock = parse_lock(_lock())
    with pytest.raises(InputError, match="unknown target 'kimi-k3-h200x8-iq1'") as exc:
        score_claim(10.0, lock, "kimi-k3-h200x8-iq1")
    assert exc.value.hint == "did you mean 'kimi-k3-h200x8-iq1s'?"
    with pytest.raises(InputError, match="must be a positive number"):
        score_claim(-1.0, lock, FLAGSHIP)
    with pytest.raises(InputError, match="not a metric of this target"):
        score_claim(10.0, lock, FLAGSHIP, "decode@7")
    assert score_claim(10.0, lock, FLAGSHIP, "prefill@0").basis == "none"  # prefill slot is 0


# ----------------------------------------------------------------------------------------------
# receipts

def test_recorded_verdict_and_provenance_cannot_override():
    r = _case("hand_seeded_frontier", 0)  # #135: really -4.6%
    r["verdict"] = {"label": "XL", "gain": 0.254, "basis": "frontier-slot"}
    r["candidate"]["label"] = "XL"
    r["candidate"]["identity"] = {"label": "XL", "verdict": "XL"}
    v = verdict_from_receipt(r)
    assert v.label == "regression" and v.gain < 0


def test_recomputation_is_deterministic_and_seeded_by_the_receipt():
    r = _case("stale_frontier")
    assert verdict_from_receipt(r) == verdict_from_receipt(copy.deepcopy(r))
    r2 = copy.deepcopy(r)
    r2["seed"] += 1
    other = verdict_from_receipt(r2)
    assert other.gain == verdict_from_receipt(r).gain  # the point does not depend on the bootstrap
    assert other.label == "M"


def test_current_lock_policy_can_replace_the_recorded_one():
    r = _case("stale_frontier")
    recorded = Target.model_validate(r["lock_target"])
    assert verdict_from_receipt(r).label == "M"
    stricter = recorded.model_copy(update={"tiers": recorded.tiers.model_copy(
        update={"buckets": {"XS": 0.09, "XL": 0.5}})})
    assert verdict_from_receipt(r, stricter).label == "none"


def test_timed_outputs_must_match_the_checked_run():
    r = _case("guard_regression", 1)
    greedy = list(range(128))
    r["gate"]["greedy"] = {"decode@131072": greedy}
    scored = next(m for m in r["speed"]["metrics"] if m["phase"] == "decode")
    for b in scored["arms"]["candidate"]["blocks"]:
        b["token_ids"] = [greedy] * len(b["samples_ns"])
    assert verdict_from_receipt(r).label == "M"
    scored["arms"]["candidate"]["blocks"][2]["token_ids"][1] = greedy[:-1] + [7]
    v = verdict_from_receipt(r)
    assert (v.label, v.speed_label) == ("REJECT", None)
    assert "block 2 rep 1 produced tokens that differ" in v.reasons[0]
    r = _case("guard_regression", 1)
    r["speed"]["metrics"][1]["timed_output_ok"] = False
    assert verdict_from_receipt(r).label == "REJECT"


def test_timed_outputs_must_match_their_variant_and_beat_no_ceiling():
    """Per-variant receipts: each rep is compared with the checked output of the variant it was revealed,
    re-derived from the raw outputs (a forged timed_output_ok true does not help); a rep faster than the
    recorded ceiling refuses the metric."""
    r = _case("guard_regression", 1)
    outs = [[v] * 128 for v in range(4)]
    r["gate"]["checked"] = {"decode@131072": {"outputs": outs}}
    scored = next(m for m in r["speed"]["metrics"] if m["phase"] == "decode")
    for b in scored["arms"]["candidate"]["blocks"]:
        b["variants"] = [i % 4 for i in range(len(b["samples_ns"]))]
        b["token_ids"] = [outs[v] for v in b["variants"]]
    assert verdict_from_receipt(r).label == "M"
    blk = scored["arms"]["candidate"]["blocks"][1]
    blk["token_ids"][0] = outs[(blk["variants"][0] + 1) % 4]  # another variant's (right) answer
    v = verdict_from_receipt(r)
    assert v.label == "REJECT" and "checked run of its variant" in v.reasons[0]
    blk["token_ids"][0] = outs[blk["variants"][0]]
    fastest = min(x for b in scored["arms"]["candidate"]["blocks"] for x in b["samples_ns"])
    r["speed"]["ceiling"] = {"decode_max_tok_s": 128 / (fastest / 1e9) * 0.9, "memory_bandwidth_gbs": 4800,
                             "devices": 8, "decode_bytes_per_token": 1}
    v = verdict_from_receipt(r)
    assert v.label == "REJECT" and any("physical ceiling" in x for x in v.reasons)


def test_gate_flag_is_noted():
    r = _case("guard_regression", 1)
    r["gate"]["depths"][0].update(kl_mean=0.03, ratchet_baseline=0.02)  # > kl_prefer 0.02, < kl_max 0.05
    v = verdict_from_receipt(r)
    assert v.label == "M" and any("flagged" in x for x in v.reasons)
    r["gate"]["depths"][0]["ratchet_baseline"] = 0.01  # 0.03 > 2 x main's 0.01: the ratchet rejects
    v = verdict_from_receipt(r)
    assert v.label == "REJECT" and "(ratchet)" in v.reasons[0]


@pytest.mark.parametrize("mutate,match", [
    (lambda r: r.update(format_version="2.0"), "unknown major version"),
    (lambda r: r.update(status="aborted", aborted={"stage": "preflight", "reason": "oom"}), "aborted at stage"),
    (lambda r: r["speed"]["metrics"].pop(0), "speed: exactly one metric must have role 'scored', found 0"),
    (lambda r: r["speed"]["metrics"].pop(1), "no entry for the guard metric"),
    (lambda r: r.pop("seed"), "receipt seed: required field is missing"),
    (lambda r: r["speed"]["metrics"][0]["arms"]["main"]["blocks"].pop(), "are not paired"),
    (lambda r: r["speed"]["metrics"][0]["arms"]["candidate"]["blocks"][0]["n_tokens"].pop(),
     r"speed.metrics.0.arms.candidate.blocks.0: samples_ns \(3\) and n_tokens \(2\) must be non-empty and of equal"),
    (lambda r: r["gate"].update({"pass": "maybe"}), "gate.pass: Input should be a valid boolean"),
    (lambda r: r["lock_target"]["tiers"].pop("max_ci_width"), "lock_target.tiers.max_ci_width"),
    (lambda r: r.update(speed=None), "speed: null although the gate passed"),
])
def test_bad_receipts_are_input_errors(mutate, match):
    r = _case("stale_frontier")
    mutate(r)
    with pytest.raises(InputError, match=match):
        verdict_from_receipt(r)


def test_main_candidate_needs_the_recorded_frontier():
    r = _case("baseline")
    del r["speed"]["metrics"][0]["frontier"]
    with pytest.raises(InputError, match=r"speed.metrics\[0\].frontier: required field is missing"):
        verdict_from_receipt(r)


def test_speed_summary_reports_every_arm_and_the_reference_ratio():
    r = _case("stale_frontier")
    out = summarize_speed(r, Target.model_validate(r["lock_target"]))
    assert [s.role for s in out] == ["scored", "guard"]
    scored = out[0]
    assert set(scored.arms) == {"reference", "candidate", "main"}
    assert scored.arms["candidate"].n == 18
    assert scored.vs_reference.point == pytest.approx(10.30 / 18.44, rel=0.01)


# ----------------------------------------------------------------------------------------------
# golden incidents

GOLDEN_FILES = ["stale_frontier", "hand_seeded_frontier", "claim_vs_measurement", "guard_regression",
                "gate_failure", "baseline", "inconclusive", "scored_regression", "pinned_slot_drift"]


def _replay(case: dict) -> Verdict:
    if "receipt" in case:
        return verdict_from_receipt(case["receipt"])
    c = case["claim"]
    return score_claim(c["value"], parse_lock(c["lock_toml"]), FLAGSHIP, c["metric"])


@pytest.mark.parametrize("name", GOLDEN_FILES)
def test_golden_incidents(name):
    for case in _golden(name)["cases"]:
        v = _replay(case)
        e, rec = case["expect"], case["verdict"]
        where = f"{name}: {case['name']}"
        # the hand-written expectation from the incident's arithmetic
        for k in ("label", "speed_label", "basis", "claim"):
            assert getattr(v, k) == e[k], f"{where}: {k}"
        if e.get("gain") is None:
            assert v.gain is None, where
        else:
            assert v.gain == pytest.approx(e["gain"], abs=e["gain_tol"]), where
        if "value" in e:
            assert v.value == pytest.approx(e["value"], abs=e["value_tol"]), where
        for s in e.get("reasons_contain", []):
            assert any(s in r for r in v.reasons), f"{where}: no reason contains {s!r}: {v.reasons}"
        for s in e.get("explanation_contains", []):
            assert s in v.explanation, where
        # the recorded output (regression): exact where no bootstrap is involved
        d = v.as_dict()
        for k in ("label", "speed_label", "basis", "claim"):
            assert d[k] == rec[k], where
        for k in ("gain", "frontier", "value"):
            assert d[k] == (None if rec[k] is None else pytest.approx(rec[k], rel=1e-9)), f"{where}: {k}"
        if rec["gain_ci"] is None:
            assert d["gain_ci"] is None and d["explanation"] == rec["explanation"], where
            assert d["reasons"] == rec["reasons"], where
        else:
            assert d["gain_ci"] == pytest.approx(rec["gain_ci"], abs=2e-3), where


def test_golden_bucket_boundaries_with_zero_width_ci():
    doc = _golden("bucket_boundaries")
    f = doc["frontier"]
    for value, label in doc["rows"]:
        v = decide(True, [], _scored(value, f), [], POLICY)
        assert v.label == label, f"{value} vs {f}: {v.label} != {label}"
        assert v.gain_ci[1] - v.gain_ci[0] == pytest.approx(0.0, abs=1e-12)


# ----------------------------------------------------------------------------------------------
# CLI

def _cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    return run_cli(monkeypatch, capsys, "tier", *args)


# the envelope sections a golden incident leaves out (the verdict never reads them)
_ENVELOPE = {"weights": {"id": "w", "files": [], "fully_pinned": True}, "environment": {}, "geometry": None}


def _sealed(r: dict) -> dict:
    """`tier --receipt` scores only sealed, valid receipts: complete the golden case's envelope and seal it
    as a round would (signed by the session's key)."""
    from scoreboard.history.seal import load_private_key, make_seal

    r = {**_ENVELOPE, **r}
    return {**r, "seal": make_seal(r, "", load_private_key())}


def _write(tmp_path: Path, name: str, i: int = 0) -> Path:
    """The golden case sealed with the verdict its round recorded (the case's expected one): a receipt of
    status "verdict" carries its verdict section."""
    r = _case(name, i)
    if r.get("verdict") is None:
        r["verdict"] = _golden(name)["cases"][i]["verdict"]
    p = tmp_path / "rounds" / f"{name}-{i}.json"
    p.parent.mkdir(exist_ok=True)
    p.write_text(json.dumps(_sealed(r)), encoding="utf-8")
    _pinning_lock(tmp_path)
    return p


def _pinning_lock(d: Path) -> Path:
    """The lock of the records' checkout `d` (beside rounds/): it pins the session's key. `tier --receipt` reads
    the pinned signers from the checkout it runs in, never from the lock beside the receipt: a test that scores
    without --lock runs in `d` (`_in_checkout`)."""
    import tomlkit
    from receipt_factory import zero_slots

    lock = d / "reference.lock"
    if not lock.exists():
        repo_lock = Path(__file__).resolve().parent.parent / "reference.lock"
        lock.write_text(tomlkit.dumps(zero_slots(tomlkit.parse(repo_lock.read_text()))))
    return lock


def _in_checkout(monkeypatch, d: Path) -> None:
    """Run the command from the checkout `d` whose lock pins the session's key (the receipts are its own)."""
    _pinning_lock(d)
    monkeypatch.chdir(d)


def test_cli_receipt_prints_label_and_explanation(tmp_path, monkeypatch, capsys):
    _in_checkout(monkeypatch, tmp_path)
    code, out, _ = _cli(monkeypatch, capsys, "--receipt", str(_write(tmp_path, "stale_frontier")))
    assert code == 0
    assert "M: the candidate's decode 128 tok @ depth 131072" in " ".join(out.split())
    assert "candidate/reference" in out


def test_cli_receipt_json_and_current_lock(tmp_path, monkeypatch, capsys, lock_path):
    p = _write(tmp_path, "stale_frontier")
    lock = _pinning_lock(tmp_path)  # the repository's lock's policy, and the session's key pinned
    assert load_lock(lock).targets == load_lock(lock_path).targets
    code, out, _ = _cli(monkeypatch, capsys, "--receipt", str(p), "--json", "--lock", str(lock))
    assert code == 0
    data = json.loads(out)
    assert data["verdict"]["label"] == "M" and data["policy"] == "lock"
    assert data["recorded_label"] == "M" and data["matches_recorded"] is True


def test_cli_reports_a_recorded_verdict_that_the_data_does_not_support(tmp_path, monkeypatch, capsys):
    _in_checkout(monkeypatch, tmp_path)
    r = _case("hand_seeded_frontier", 0)
    r["verdict"] = {"label": "XL", "reasons": []}  # sealed so (an older policy): scored, with the disagreement noted
    p = tmp_path / "rounds" / "r.json"
    p.parent.mkdir()
    p.write_text(json.dumps(_sealed(r)), encoding="utf-8")
    _pinning_lock(tmp_path)
    code, out, _ = _cli(monkeypatch, capsys, "--receipt", str(p))
    assert code == 2 and "UNTRUSTED" not in out  # what it really is: a regression
    assert "the receipt records 'XL'; recomputed 'regression'" in " ".join(out.split())


@pytest.mark.parametrize("how", ["edited", "unsealed"])
def test_cli_refuses_an_edited_or_unsealed_receipt(tmp_path, monkeypatch, capsys, how):
    """An edited sealed receipt (or one with its seal deleted) is reported as such, exit 2, no verdict."""
    r = _sealed(_case("stale_frontier"))
    if how == "edited":
        r["verdict"] = {**(r.get("verdict") or {}), "label": "XL"}
    else:
        del r["seal"]
    p = tmp_path / "r.json"
    p.write_text(json.dumps(r), encoding="utf-8")
    for extra in ([], ["--json"]):
        code, out, err = _cli(monkeypatch, capsys, "--receipt", str(p), *extra)
        text = " ".join(err.split())
        assert code == 2
        assert ("TAMPERED" if how == "edited" else "UNSEALED") in text
        assert "verdict.label" in text if how == "edited" else "never sealed" in text
        assert "XL" not in out and "M:" not in out  # no verdict rendered


def test_cli_reject_exits_2(tmp_path, monkeypatch, capsys):
    _in_checkout(monkeypatch, tmp_path)
    code, out, _ = _cli(monkeypatch, capsys, "--receipt", str(_write(tmp_path, "guard_regression")), "--json")
    assert code == 2 and json.loads(out)["trusted"] is True  # exit 2 for the REJECT, not for who sealed it
    assert json.loads(out)["verdict"]["speed_label"] == "M"


def test_cli_regression_exits_2_and_says_so(tmp_path, monkeypatch, capsys):
    """k3-wide's main round of 2026-12-02 (-3.98%, CI -4.06% to -3.90%) was sealed as none, exit 0."""
    _in_checkout(monkeypatch, tmp_path)
    code, out, _ = _cli(monkeypatch, capsys, "--receipt", str(_write(tmp_path, "scored_regression")))
    text = " ".join(out.split())
    assert code == 2
    assert text.startswith("regression") or "\nregression" in out or " regression " in text
    assert "entirely below -2.00% (guard_tolerance)" in text
    code, out, _ = _cli(monkeypatch, capsys, "--receipt", str(_write(tmp_path, "scored_regression", 2)), "--json")
    assert code == 0 and json.loads(out)["verdict"]["label"] == "none"  # inside the tolerance


def test_cli_a_loaded_box_against_the_pinned_slot_is_inconclusive(tmp_path, monkeypatch, capsys):
    """The default target's main job on a loaded box sealed 'none, -95.85%' against the slot of 2026-11-29 (its
    frontier commit cannot run under this harness); the baseline the round recorded makes it inconclusive."""
    _in_checkout(monkeypatch, tmp_path)
    code, out, _ = _cli(monkeypatch, capsys, "--receipt", str(_write(tmp_path, "pinned_slot_drift")), "--json")
    v = json.loads(out)["verdict"]
    assert code == 0 and v["label"] == "inconclusive" and v["basis"] == "frontier-slot"
    assert any("beyond speed.reference_drift_max 25%" in f for f in v["flags"]), v["flags"]
    r = _case("pinned_slot_drift")
    for m in r["speed"]["metrics"]:  # the same round with its baseline at what the loaded box measured
        m["baseline"] = 25.0 if m["phase"] == "decode" else 400.0
    assert verdict_from_receipt(r).label == "regression"
    code, out, _ = _cli(monkeypatch, capsys, "--receipt", str(_write(tmp_path, "pinned_slot_drift", 1)), "--json")
    assert code == 2 and json.loads(out)["verdict"]["label"] == "regression"  # a quiet box: a real regression


def test_cli_claim(tmp_path, monkeypatch, capsys):
    lock = tmp_path / "reference.lock"
    lock.write_text(_lock(), encoding="utf-8")
    before = lock.read_bytes()
    code, out, _ = _cli(monkeypatch, capsys, "--claim", "169.72", "--target", FLAGSHIP, "--lock", str(lock))
    assert code == 0
    assert "XL (claim)" in out and "claimed, not measured" in " ".join(out.split())
    assert lock.read_bytes() == before  # a claim moves nothing


@pytest.mark.parametrize("args,match", [
    (["--receipt", "nope.json"], "receipt not found"),
    (["--claim", "10", "--target", "no-such-target", "--lock", "LOCK"], "unknown target 'no-such-target'"),
    ([], "pass exactly one of --receipt FILE or --claim VALUE"),
    (["--claim", "10"], "--claim needs --target"),
])
def test_cli_bad_input_exits_1(tmp_path, monkeypatch, capsys, lock_path, args, match):
    args = [str(lock_path) if a == "LOCK" else a for a in args]
    code, _, err = _cli(monkeypatch, capsys, *args)
    assert code == 1
    assert match in " ".join(err.split())


def test_cli_unknown_receipt_major_exits_1(tmp_path, monkeypatch, capsys):
    r = _sealed(_case("stale_frontier"))
    r["format_version"] = "2.0"
    p = tmp_path / "r.json"
    p.write_text(json.dumps(r), encoding="utf-8")
    code, _, err = _cli(monkeypatch, capsys, "--receipt", str(p))
    assert code == 1 and "unknown major version" in err


def test_too_few_blocks_is_inconclusive_and_cannot_convict_a_guard():
    """Two paired blocks say nothing about the noise: no tier is awarded and no guard is failed."""
    scored_m = Metric(phase="decode", depth=512, n_tokens=32, role="scored")
    guard_m = Metric(phase="prefill", depth=0, n_tokens=512, role="guard")
    fast = evidence(scored_m, [120.0, 121.0], POLICY, 0, main_blocks=[100.0, 100.0])  # +20% but 2 blocks
    slow = evidence(guard_m, [80.0, 81.0], POLICY, 0, main_blocks=[100.0, 100.0])  # -20% but 2 blocks
    v = decide(True, [], fast, [slow], POLICY)
    assert v.label == "inconclusive" and any("min_blocks" in r for r in v.reasons)
    four = evidence(guard_m, [80.0, 81.0, 80.5, 79.5], POLICY, 0, main_blocks=[100.0] * 4)
    fast4 = evidence(scored_m, [120.0, 121.0, 120.5, 119.5], POLICY, 0, main_blocks=[100.0] * 4)
    assert decide(True, [], fast4, [four], POLICY).label == "REJECT"  # with enough blocks the guard convicts


def test_main_is_never_rejected_for_speed_against_its_own_pinned_frontier():
    """A slower box (or a real regression on main) flags main's guard; it does not REJECT main."""
    scored_m = Metric(phase="decode", depth=512, n_tokens=32, role="scored")
    guard_m = Metric(phase="prefill", depth=0, n_tokens=512, role="guard")
    scored = evidence(scored_m, [100.0, 101.0, 99.0, 100.5], POLICY, 0, frontier_slot=100.0)
    slow = evidence(guard_m, [77.0, 76.0, 78.0, 77.5], POLICY, 0, frontier_slot=100.0)
    as_main = decide(True, [], scored, [slow], POLICY, guards_convict=False)
    assert as_main.label != "REJECT" and any(r.startswith("warning: guard") for r in as_main.reasons)
    assert decide(True, [], scored, [slow], POLICY).label == "REJECT"  # a PR is convicted
