"""Sealing, write-once receipts, the hash-chained ledger, and Ed25519 signatures (real files, real keys)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from receipt_factory import make_receipt

from scoreboard.history import ledger
from scoreboard.errors import InputError, NonCompliant
from scoreboard.history.records import read_receipt, receipt_files, write_receipt
from scoreboard.history.seal import (
    check_seal, check_signature, generate_keypair, load_private_key, load_public_key, seal_sha256, sha256_hex,
    verify_sealed,
)


@pytest.fixture
def rounds(tmp_path: Path) -> Path:
    return tmp_path / "repo" / "rounds"


@pytest.fixture
def keypair(tmp_path: Path) -> tuple[Path, Path]:
    return generate_keypair(tmp_path / "keys" / "signing.key")


def test_write_seals_writes_once_and_chains_the_ledger(rounds: Path):
    p1 = write_receipt(make_receipt(), rounds)
    p2 = write_receipt(make_receipt(round_hex="00000002", created_at="2026-11-29T15:00:00Z", is_main=False), rounds)
    r1, r2 = read_receipt(p1), read_receipt(p2)
    assert check_seal(r1) == [] and r1["seal"]["sha256"] == seal_sha256(r1)
    lines = ledger.read_lines(rounds)
    assert len(lines) == 2 and ledger.chain_problems(lines) == []
    e1, e2 = (json.loads(x) for x in lines)
    assert (e1["prev_sha256"], e2["prev_sha256"]) == ("", sha256_hex(lines[0]))
    assert r1["seal"]["prev_ledger_sha256"] == "" and r2["seal"]["prev_ledger_sha256"] == sha256_hex(lines[0])
    assert e1["receipt_sha256"] == sha256_hex(p1.read_bytes()) and e2["is_main"] is False
    # write-once: the same round id again is refused and the file is untouched
    before = p1.read_bytes()
    with pytest.raises(InputError, match="already exists; receipts are write-once"):
        write_receipt(make_receipt(candidate_tps=99.0), rounds)
    assert p1.read_bytes() == before and len(ledger.read_lines(rounds)) == 2
    assert sorted(os.listdir(rounds)) == sorted([p1.name, p2.name, "ledger.jsonl"])  # no temp files left


def test_aborted_round_gets_a_receipt_and_a_ledger_line(rounds: Path):
    p = write_receipt(make_receipt(status="aborted"), rounds)
    entry = ledger.read_entries(rounds)[0]
    assert (entry.kind, entry.status, entry.verdict, entry.value, entry.changes) == ("round", "aborted", "aborted",
                                                                                      None, [])
    assert read_receipt(p)["aborted"]["stage"] == "preflight"


def test_an_already_sealed_or_invalid_receipt_is_not_written(rounds: Path):
    r = make_receipt()
    r["seal"] = {"sha256": "0" * 64, "prev_ledger_sha256": ""}
    with pytest.raises(InputError, match="already sealed"):
        write_receipt(r, rounds)
    bad = make_receipt()
    bad["verdict"]["label"] = "XXL"
    with pytest.raises(InputError, match=r"verdict.label: "):
        write_receipt(bad, rounds)
    no_target = make_receipt()
    no_target["lock_target"] = {"model": "x"}  # slot names cannot be derived: refused before writing
    with pytest.raises(InputError, match="lock_target is not a valid target"):
        write_receipt(no_target, rounds)
    assert receipt_files(rounds) == [] and ledger.read_lines(rounds) == []


def test_broken_chain_refuses_new_receipts(rounds: Path):
    write_receipt(make_receipt(), rounds)
    write_receipt(make_receipt(round_hex="00000002"), rounds)
    lp = ledger.ledger_path(rounds)
    lines = lp.read_bytes().split(b"\n")
    lp.write_bytes(b"\n".join([lines[1], lines[0], b""]))  # reorder
    with pytest.raises(NonCompliant, match="prev_sha256"):
        write_receipt(make_receipt(round_hex="00000003"), rounds)
    assert len(receipt_files(rounds)) == 2  # nothing written


def test_tampered_receipt_fails_verify_sealed_naming_the_field(rounds: Path):
    p = write_receipt(make_receipt(), rounds)
    data = json.loads(p.read_bytes())
    data["speed"]["metrics"][0]["arms"]["candidate"]["blocks"][0]["samples_ns"][0] //= 2
    with pytest.raises(NonCompliant, match=r"speed.metrics: does not match seal.sha256"):
        verify_sealed(data)
    with pytest.raises(NonCompliant, match=r"seal: missing"):
        verify_sealed(make_receipt())


def test_signature_sign_verify_and_tamper(rounds: Path, keypair, tmp_path: Path, monkeypatch):
    priv, pub = keypair
    assert oct(priv.stat().st_mode & 0o777) == "0o600"
    p = write_receipt(make_receipt(), rounds, signing_key=priv)
    data = json.loads(p.read_bytes())
    trusted = load_public_key(pub)
    assert data["seal"]["algorithm"] == "ed25519"
    assert check_signature(data, trusted) == [] and check_signature(data) == []
    # the signature binds the seal digest and the ledger position
    moved = json.loads(p.read_bytes())
    moved["seal"]["prev_ledger_sha256"] = "f" * 64
    assert check_signature(moved, trusted) == [("seal.signature",
                                                "does not verify over seal.sha256 + seal.prev_ledger_sha256")]
    forged = json.loads(p.read_bytes())
    forged["seal"]["sha256"] = "0" * 64
    assert check_signature(forged, trusted)
    # another key is not the trusted key, even when the receipt embeds it
    other_priv, _ = generate_keypair(tmp_path / "keys" / "other.key")
    p2 = write_receipt(make_receipt(round_hex="00000002"), rounds, signing_key=other_priv)
    assert check_signature(json.loads(p2.read_bytes()), trusted) == [
        ("seal.public_key", "signed by a key other than the trusted public key")]
    # an unsigned receipt is fine without a trust anchor, and a finding with one
    monkeypatch.delenv("SCOREBOARD_SIGNING_KEY")  # the session's key would sign it
    p3 = write_receipt(make_receipt(round_hex="00000003"), rounds)
    assert check_signature(json.loads(p3.read_bytes())) == []
    assert check_signature(json.loads(p3.read_bytes()), trusted) == [("seal.signature",
                                                                       "missing (receipt is not signed)")]


def test_signing_key_must_live_outside_the_checkout_and_be_private(tmp_path: Path, monkeypatch):
    repo = tmp_path / "repo"
    with pytest.raises(InputError, match="inside .* a tree the candidate can read"):
        generate_keypair(repo / "keys" / "k", forbidden_roots=[repo])
    priv, _ = generate_keypair(tmp_path / "outside" / "k")
    with pytest.raises(InputError, match="inside"):
        load_private_key(priv, forbidden_roots=[tmp_path])
    monkeypatch.setenv("SCOREBOARD_SIGNING_KEY", str(priv))
    assert load_private_key(None, forbidden_roots=[repo]) is not None
    priv.chmod(0o644)
    with pytest.raises(InputError, match="readable by group/others"):
        load_private_key(None, forbidden_roots=[repo])
    with pytest.raises(InputError, match="already exists"):
        generate_keypair(priv)
    # the round writer applies the same rule with its defaults (cwd and the rounds dir's parent)
    priv.chmod(0o600)
    with pytest.raises(InputError, match="inside"):
        write_receipt(make_receipt(), tmp_path / "outside" / "rounds")
