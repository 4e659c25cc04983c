"""Receipt format 1.0: canonical JSON, the typed model, provenance vs verdict, arithmetic, golden file."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from receipt_factory import TARGET, make_receipt

from scoreboard.errors import InputError
from scoreboard.history.ledger import LedgerEntry, chain_problems
from scoreboard.history.receipt import (
    FORMAT_VERSION, SpeedMetric, add_provenance, arm_value, new_round_id, normalize, parse_receipt,
    validation_problems,
)
from scoreboard.history.records import file_bytes
from scoreboard.history.seal import canonical_bytes, changed_fields, check_seal, seal_sha256, sha256_hex

GOLDEN = Path(__file__).parent / "golden"
GOLDEN_SEAL = "a0f32451536d16871fa85ae16927600152007cf7c8c8dd8e8587ea8fb74b758f"

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63) | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20)


@settings(max_examples=100, deadline=None)
@given(json_values)
def test_canonical_bytes_round_trip_identity(value):
    data = canonical_bytes(value)
    assert canonical_bytes(json.loads(data)) == data
    assert json.loads(data) == value


def test_canonical_form_is_sorted_compact_utf8():
    assert canonical_bytes({"b": 1, "a": [1.5, "é"], "c": None}) == '{"a":[1.5,"é"],"b":1,"c":null}'.encode()


@pytest.mark.parametrize("bad, where", [({"speed": {"x": [1.0, math.nan]}}, "speed.x[1]"),
                                        ({"v": math.inf}, "v")])
def test_nan_and_inf_are_refused_with_their_path(bad, where):
    with pytest.raises(InputError, match=rf"^{re.escape(where)}: .* not allowed"):
        canonical_bytes(bad)


def test_non_string_keys_are_refused():
    with pytest.raises(InputError, match=r"key 1 is not a string"):
        canonical_bytes({"a": {1: 2}})


def test_factory_receipt_validates_and_normalize_is_the_identity_after_one_pass():
    r = normalize(make_receipt())
    assert validation_problems(r) == []
    assert normalize(r) == r
    assert parse_receipt(r).model_dump(mode="json", by_alias=True, exclude_unset=True) == r


def test_aborted_receipt_validates():
    r = make_receipt(status="aborted")
    assert validation_problems(r) == []
    assert r["verdict"] is None and r["speed"] is None


def test_unknown_major_version_is_refused_minor_is_read():
    r = make_receipt()
    assert validation_problems({**r, "format_version": "1.7"}) == []
    assert validation_problems({**r, "format_version": "2.0"}) == [
        "format_version: '2.0' has unknown major version 2; this scoreboard reads receipt format 1.x"]
    with pytest.raises(InputError, match="'2.0' has unknown major version 2"):
        parse_receipt({**r, "format_version": "2.0"})


def test_unknown_top_level_key_and_bad_fields_are_all_reported_with_paths():
    r = make_receipt()
    r["tps"] = 999.0
    r["candidate"]["commit"] = "xyz"
    r["speed"]["metrics"][0]["arms"]["candidate"]["blocks"][0]["samples_ns"][0] = 0
    problems = validation_problems(r)
    assert "tps: unknown key (not in receipt format 1.x; see docs/receipt-format.md)" in problems
    assert any(p.startswith("candidate.commit: ") and "40 lowercase hex" in p for p in problems)
    assert any(p.startswith("speed.metrics.0.arms.candidate.blocks.0: ") and "positive" in p for p in problems)


def test_verdict_must_agree_with_the_gate_and_round_id_with_the_target():
    r = make_receipt()
    r["gate"]["pass"] = False  # verdict stays "S"
    assert any("gate.pass is false but verdict.label is 'S'" in p for p in validation_problems(r))
    r = make_receipt()
    r["round_id"] = r["round_id"].replace(TARGET, "other-target")
    assert any("round_id names target 'other-target'" in p for p in validation_problems(r))


def test_provenance_can_never_carry_verdict_fields():
    r = make_receipt()
    with pytest.raises(InputError, match=r"provenance may not set verdict fields: \['provenance.label'\]"):
        add_provenance(r, {"label": "XL"})
    with pytest.raises(InputError, match=r"provenance.ci.gain"):
        add_provenance(r, {"ci": {"gain": 0.5}})
    merged = add_provenance(r, {"pr": 148, "ci_run": "https://ci/1"})
    assert merged["provenance"] == {"host": "test-box", "pr": 148, "ci_run": "https://ci/1"}
    assert merged["verdict"] == r["verdict"]
    # direct construction cannot smuggle them in either
    r["provenance"] = {"box": {"value": 169.72}}
    assert any("provenance may not use verdict keys: ['provenance.box.value']" in p for p in validation_problems(r))


def test_provenance_is_refused_on_a_sealed_receipt():
    r = make_receipt()
    r["seal"] = {"sha256": "0" * 64, "prev_ledger_sha256": ""}
    with pytest.raises(InputError, match="sealed receipt"):
        add_provenance(r, {"pr": 1})


def test_arm_value_is_the_geomean_of_block_medians_from_raw_ns():
    blocks = [
        {"samples_ns": [1_000_000_000, 2_000_000_000, 500_000_000], "n_tokens": [10, 10, 10]},  # 10, 5, 20 -> 10
        {"samples_ns": [1_000_000_000], "n_tokens": [30]},  # 30
        {"samples_ns": [1_000_000_000, 1_000_000_000], "n_tokens": [11, 13]},  # median 12
    ]
    arm = {"blocks": [{**b, "block": i, "wall_ns": 1, "command": ["x"]} for i, b in enumerate(blocks)]}
    metric = SpeedMetric.model_validate({"phase": "decode", "depth": 0, "n_tokens": 10, "role": "scored", "slot": "S",
                                         "timed_output_ok": True, "arms": {"candidate": arm, "reference": arm}})
    assert arm_value(metric, "candidate") == pytest.approx((10 * 30 * 12) ** (1 / 3), rel=1e-12)


def test_new_round_id_shape():
    rid = new_round_id("k3-mini-cpu", "2026-11-29T14:15:00Z")
    assert rid.startswith("20261129T141500Z-k3-mini-cpu-") and len(rid.rsplit("-", 1)[1]) == 8
    with pytest.raises(InputError):
        new_round_id("bad/target", "2026-11-29T14:15:00Z")


def test_field_digests_name_the_edited_field():
    r = normalize(make_receipt())
    from scoreboard.history.seal import field_digests

    digests = field_digests(r)
    r["verdict"]["label"] = "XL"
    assert changed_fields(r, digests) == ["verdict.label"]


# ----------------------------------------------------------------------------------------------
# golden files: the released 1.0 format, byte for byte

def test_golden_receipt_seal_and_round_trip():
    raw = (GOLDEN / "receipt-1.0.json").read_bytes()
    data = json.loads(raw)
    assert data["format_version"] == "1.0"  # the released 1.0 golden stays readable under 1.x
    assert seal_sha256(data) == data["seal"]["sha256"] == GOLDEN_SEAL
    assert check_seal(data) == []
    assert validation_problems(data) == []
    assert parse_receipt(data).model_dump(mode="json", by_alias=True, exclude_unset=True) == data
    assert file_bytes(data) == raw  # the on-disk form is stable too


def test_golden_ledger_line_backs_the_golden_receipt():
    lines = (GOLDEN / "ledger-1.0.jsonl").read_bytes().split(b"\n")[:-1]
    assert chain_problems(lines) == []
    entry = LedgerEntry.model_validate(json.loads(lines[0]))
    assert entry.receipt_sha256 == sha256_hex((GOLDEN / "receipt-1.0.json").read_bytes())
    assert entry.seal_sha256 == GOLDEN_SEAL
    assert (entry.kind, entry.verdict, entry.value, entry.changes) == ("round", "S", 52.5, [])
