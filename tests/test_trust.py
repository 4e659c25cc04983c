"""Pinned signers: a record is trusted only when a key pinned in the lock signed it, or when the lock lists it
(id and seal) as sealed before the signer pin. Real keys, real seals, real ledgers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomlkit
from receipt_factory import SCORED_SLOT, lock_with_test_target, make_receipt
from signer_fixtures import SIGNER_ID, pin_in, session_public_key

from scoreboard.errors import InputError, LockError
from scoreboard.history.records import record_round, write_receipt
from scoreboard.history.seal import generate_keypair, load_public_key, public_key_b64
from scoreboard.history.trust import PRE_PIN, Trust, near, own_lock, pinned_signing_key
from scoreboard.history.verify import verify
from scoreboard.lockfile import load_lock, parse_lock

REPO = Path(__file__).resolve().parent.parent


def _lock_text(extra: str) -> str:
    return "schema = 1\n" + extra


@pytest.mark.parametrize("extra, problem", [
    ('[signers.box]\npublic_key = "abc"\nadded = "2026-12-02"\n',
     "signers.box.public_key: the base64 of a raw 32-byte Ed25519 public key"),
    (f'[signers.box]\npublic_key = "{"A" * 43}="\nadded = "2 Dec"\n', "signers.box.added: a UTC date YYYY-MM-DD, got '2 Dec'"),
    (f'[signers.a]\npublic_key = "{"A" * 43}="\nadded = "2026-12-02"\n'
     f'[signers.b]\npublic_key = "{"A" * 43}="\nadded = "2026-12-02"\n', "signers.b.public_key: the same key as signers.a"),
    ('[sealed_before_pin]\nrounds = [{ id = "r", seal_sha256 = "' + "a" * 64 + '" }, { id = "r", seal_sha256 = "'
     + "b" * 64 + '" }]\n', "sealed_before_pin.rounds[1].id: 'r' is listed twice"),
    ('[sealed_before_pin]\ncalibrations = [{ id = "c", seal_sha256 = "x" }]\n',
     "sealed_before_pin.calibrations[0].seal_sha256: a seal sha256 must be 64"),
])
def test_the_lock_refuses_a_malformed_pin_naming_the_field(extra, problem):
    with pytest.raises(LockError) as exc:
        parse_lock(_lock_text(extra))
    assert any(p.startswith(problem) for p in exc.value.problems), exc.value.problems


def test_the_repository_pins_its_unsigned_records_as_sealed_before_the_pin():
    """Every unsigned record in rounds/ is listed by id and seal as sealed before the pin; every signed one is
    signed by a key the lock pins; no record is both, and none is neither."""
    lock = load_lock(REPO / "reference.lock")
    trust = Trust.of(lock)
    listed = {r.id for r in lock.sealed_before_pin.rounds} | {r.id for r in lock.sealed_before_pin.calibrations}
    signed = 0
    for p in sorted((REPO / "rounds").glob("*.json")) + sorted((REPO / "rounds" / "calibrations").glob("*.json")):
        data = json.loads(p.read_bytes())
        kind = "calibration" if p.parent.name == "calibrations" else "round"
        st = trust.standing(data, kind)
        if data["seal"]["signature"] is None:
            assert data["seal"]["public_key"] is None and st.state == "pre-pin" and p.stem in listed, p
        else:
            assert st.trusted and st.state != "pre-pin" and p.stem not in listed, (p, st)
            assert trust.signer_of(data["seal"]["public_key"]) in lock.signers, p
            signed += 1
    assert signed >= 3  # the H200 lease of 2026-12-02 13:00Z: one calibration and two rounds, signed h200-lease


def test_standing_of_signed_unpinned_unsigned_listed_and_edited(tmp_path, tmp_path_factory, monkeypatch):
    lock, rounds = lock_with_test_target(tmp_path), tmp_path / "rounds"
    trust = Trust.of(load_lock(lock), lock)
    signed = json.loads(write_receipt(make_receipt(round_hex="00000001"), rounds).read_bytes())
    assert trust.standing(signed, "round").describe() == f"signed by pinned key {SIGNER_ID!r}"
    other, _ = generate_keypair(tmp_path_factory.mktemp("keys") / "other.key")
    foreign = json.loads(write_receipt(make_receipt(round_hex="00000002"), rounds, signing_key=other).read_bytes())
    st = trust.standing(foreign, "round")
    assert not st.trusted and "signed by a key" in st.why and foreign["seal"]["public_key"] in st.why
    monkeypatch.delenv("SCOREBOARD_SIGNING_KEY")
    bare = json.loads(write_receipt(make_receipt(round_hex="00000003"), rounds).read_bytes())
    assert "not signed, and not listed" in trust.standing(bare, "round").why
    # listed by id and seal: trusted as sealed before the pin; the same id with another seal is not
    doc = tomlkit.parse(lock.read_text())
    doc["sealed_before_pin"]["rounds"].append({"id": bare["round_id"], "seal_sha256": bare["seal"]["sha256"]})
    lock.write_text(tomlkit.dumps(doc))
    listed = Trust.of(load_lock(lock), lock)
    assert listed.standing(bare, "round").describe() == PRE_PIN
    other_seal = dict(bare, seal={**bare["seal"], "sha256": "0" * 64})
    assert "lists round" in listed.standing(other_seal, "round").why
    # a signature that does not verify is never trusted, whoever's key it names
    broken = dict(signed, seal={**signed["seal"], "prev_ledger_sha256": "f" * 64})
    assert "does not verify" in trust.standing(broken, "round").why


def test_history_sealed_by_a_key_the_lock_does_not_pin_is_a_finding_on_every_record_it_backs(tmp_path):
    lock, rounds = lock_with_test_target(tmp_path), tmp_path / "rounds"
    record_round(make_receipt(candidate_tps=50.0), rounds, lock)
    assert verify(lock, rounds).ok
    doc = tomlkit.parse(lock.read_text())
    del doc["signers"][SIGNER_ID]  # the key that sealed it is no longer pinned
    lock.write_text(tomlkit.dumps(doc))
    report = verify(lock, rounds)
    found = {(Path(p.file).name, p.field) for p in report.problems}
    rid = make_receipt()["round_id"]
    assert (f"{rid}.json", "seal") in found  # the receipt
    assert ("ledger.jsonl:1", "round_id") in found and ("ledger.jsonl:2", "round_id") in found  # its lines
    assert ("reference.lock", f"slots.{SCORED_SLOT}.value") in found  # the slot it set


def test_sealing_needs_a_key_that_the_lock_pins(tmp_path, monkeypatch):
    lock = load_lock(lock_with_test_target(tmp_path))
    assert pinned_signing_key(lock, "reference.lock", []) == SIGNER_ID
    assert lock.signers[SIGNER_ID].public_key == session_public_key()
    other, pub = generate_keypair(tmp_path / "keys" / "other.key")
    monkeypatch.setenv("SCOREBOARD_SIGNING_KEY", str(other))
    with pytest.raises(InputError) as exc:
        pinned_signing_key(lock, "reference.lock", [])
    assert public_key_b64(load_public_key(pub)) in exc.value.message and "scoreboard signer pin" in exc.value.hint
    pinned = load_lock(pin_in(tmp_path / "reference.lock", public_key_b64(load_public_key(pub)), "box-2"))
    assert pinned_signing_key(pinned, "reference.lock", []) == "box-2"
    monkeypatch.delenv("SCOREBOARD_SIGNING_KEY")
    with pytest.raises(InputError, match=r"\$SCOREBOARD_SIGNING_KEY is not set") as exc:
        pinned_signing_key(lock, "reference.lock", [])
    assert "scoreboard signer new" in exc.value.hint and "--no-seal" in exc.value.hint


def test_the_pins_are_the_checkouts_own_lock_never_the_one_beside_the_records(tmp_path, monkeypatch):
    """Without --lock, a display judges records by the reference.lock of the checkout it runs in: the working
    directory's, else the one at the root of its git working tree (not one in a directory between, and nothing
    outside a working tree); never the one beside the records, which whoever handed them over could have put
    there. That one is named as `--lock` in an untrusted record's reason. (The attack through the four commands:
    tests/test_exploits_records.py.)"""
    records = tmp_path / "records"
    records.mkdir()
    theirs = lock_with_test_target(records)  # pins the key the receipt is signed with (the session's)
    receipt = write_receipt(make_receipt(round_hex="0000000e"), records / "rounds")
    data = json.loads(receipt.read_bytes())
    mine = tmp_path / "mine"
    (mine / ".git").mkdir(parents=True)
    (mine / "a" / "b").mkdir(parents=True)
    (mine / "reference.lock").write_text((REPO / "reference.lock").read_text())  # pins no test key
    (mine / "a" / "reference.lock").write_text(theirs.read_text())  # between the two: not the checkout's
    monkeypatch.chdir(mine / "a" / "b")
    assert own_lock() == mine / "reference.lock" and own_lock(mine / "a") == mine / "a" / "reference.lock"
    trust = near(receipt.parent)
    st = trust.standing(data, "round")
    assert trust.source == str(mine / "reference.lock") and trust.other == str(theirs)
    assert not st.trusted and f"pass --lock {theirs}" in st.why, st.why
    # the user's explicit choice, and the records' own checkout, judge by the pins that came with them
    chosen = near(receipt.parent, theirs)
    assert chosen.standing(data, "round").trusted and chosen.other == "" and chosen.next_step() == ""
    monkeypatch.chdir(records)
    assert near(receipt.parent).standing(data, "round").trusted
    # a checkout with no lock of its own: nothing vouches, and the reason names both ways out
    (mine / "reference.lock").unlink()
    monkeypatch.chdir(mine / "a" / "b")
    assert own_lock() is None
    st = near(receipt.parent).standing(data, "round")
    assert not st.trusted and "pass --lock FILE" in st.why and f"pass --lock {theirs}" in st.why, st.why
    # outside any git working tree only the working directory's own lock counts, never a parent's
    loose = tmp_path / "loose"
    (loose / "x").mkdir(parents=True)
    (loose / "reference.lock").write_text(theirs.read_text())
    assert own_lock(loose / "x") is None and own_lock(loose) == loose / "reference.lock"
