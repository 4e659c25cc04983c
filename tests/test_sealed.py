"""scoreboard.history.sealed: the one way a recorded receipt file is read (format, seal, typed model), and
the one refusal of an unknown major format wherever a receipt is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import run_cli
from receipt_factory import make_receipt

from scoreboard.errors import InputError, NonCompliant
from scoreboard.history.receipt import Receipt, normalize
from scoreboard.history.records import file_bytes
from scoreboard.history.seal import make_seal, sha256_hex
from scoreboard.history.sealed import inspect_receipt, read_sealed
from scoreboard.tiers import verdict_from_receipt


def _write(tmp_path: Path, r: dict, name: str = "r.json") -> Path:
    """`r` sealed over exactly its content (valid or not), written as a round writes a receipt."""
    p = tmp_path / name
    p.write_bytes(file_bytes({**r, "seal": make_seal(r, "")}))
    return p


def _cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    return run_cli(monkeypatch, capsys, *args)


def test_a_sealed_receipt_is_read_as_the_typed_model_next_to_its_raw_json(tmp_path):
    p = _write(tmp_path, normalize(make_receipt()))
    got = read_sealed(p)
    assert isinstance(got.receipt, Receipt)
    assert got.raw == json.loads(p.read_bytes()) and got.file_sha256 == sha256_hex(p.read_bytes())
    assert got.receipt.round_id == got.raw["round_id"]
    assert got.receipt.speed is not None and got.receipt.speed.metrics[0].frontier == got.raw["speed"]["metrics"][0][
        "frontier"]
    assert inspect_receipt(p).state == "sealed"


def test_a_mistyped_field_is_refused_with_its_path(tmp_path):
    """A receipt whose seal holds but whose content the model refuses is never read as if it were valid:
    the refusal names each bad field by its path."""
    r = normalize(make_receipt())
    r["speed"]["metrics"][0]["depth"] = "deep"
    r["candidate"]["dirty"] = "maybe"
    p = _write(tmp_path, r)
    with pytest.raises(InputError) as info:
        read_sealed(p)
    msg = info.value.message
    assert msg.startswith(f"{p}: 2 problem(s)")
    assert "  speed.metrics.0.depth: Input should be a valid integer" in msg
    assert "  candidate.dirty: Input should be a valid boolean" in msg
    f = inspect_receipt(p)
    assert f.state == "UNREADABLE" and f.sealed is None and "speed.metrics.0.depth" in f.problems[0][1]


def test_an_edited_receipt_is_refused_before_it_is_parsed(tmp_path):
    p = _write(tmp_path, normalize(make_receipt()))
    data = json.loads(p.read_bytes())
    data["verdict"]["label"] = "XL"
    p.write_bytes(file_bytes(data))
    with pytest.raises(NonCompliant, match="TAMPERED receipt .*verdict.label"):
        read_sealed(p)
    assert inspect_receipt(p).state == "TAMPERED"


UNKNOWN_MAJOR = ("format_version '2.0' has unknown major version 2; this scoreboard reads receipt format 1.x",
                 "upgrade scoreboard (`git pull && pip install -e .`), then run the command again")


def test_an_unknown_major_is_refused_in_one_wording_wherever_a_receipt_is_read(tmp_path, monkeypatch, capsys):
    r = {**normalize(make_receipt()), "format_version": "2.0"}
    p = _write(tmp_path, r)
    with pytest.raises(InputError) as info:
        read_sealed(p)
    assert (info.value.message, info.value.hint) == (f"{p}: {UNKNOWN_MAJOR[0]}", UNKNOWN_MAJOR[1])
    with pytest.raises(InputError) as info:
        verdict_from_receipt(r)  # a receipt dict in memory: named by its round id
    assert (info.value.message, info.value.hint) == (f"receipt {r['round_id']}: {UNKNOWN_MAJOR[0]}", UNKNOWN_MAJOR[1])
    for args in (["tier", "--receipt", str(p)], ["round", "show", str(p)]):
        code, out, err = _cli(monkeypatch, capsys, *args)
        text = " ".join(err.split())
        assert code == 1 and out == ""
        assert f"{p}: {UNKNOWN_MAJOR[0]}" in text and "git pull && pip install -e ." in text
    # a newer minor of the same major is read
    assert read_sealed(_write(tmp_path, {**normalize(make_receipt()), "format_version": "1.9"}, "m.json")).receipt
