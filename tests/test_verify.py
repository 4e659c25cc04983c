"""`scoreboard verify` through the real console script: any edit, deletion or reorder is found (exit 2)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from cli_helpers import scoreboard_command
from receipt_factory import SCORED_SLOT, lock_with_test_target, make_receipt

from scoreboard.history import ledger
from scoreboard.lockfile import set_slot, update_lock
from scoreboard.history.records import _seal_and_write, record_round
from scoreboard.history.seal import generate_keypair, load_public_key, public_key_b64
from signer_fixtures import pin_in

REPO = Path(__file__).resolve().parent.parent


def scoreboard(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*scoreboard_command(), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def verify_json(d: Path, *extra: str) -> tuple[int, dict]:
    out = scoreboard("verify", "--lock", str(d / "reference.lock"), "--rounds", str(d / "rounds"), "--json", *extra,
                     cwd=d)
    return out.returncode, json.loads(out.stdout)


def found(report: dict, file_part: str, fld: str) -> list[str]:
    return [p["message"] for p in report["problems"] if file_part in p["file"] and p["field"] == fld]


@pytest.fixture
def history(tmp_path: Path) -> Path:
    """main 50 (raises), a PR at 55 (moves nothing), main 52 (raises): 5 ledger lines."""
    lock, rounds = lock_with_test_target(tmp_path), tmp_path / "rounds"
    record_round(make_receipt(candidate_tps=50.0, round_hex="0000000a", created_at="2026-11-29T10:00:00Z"),
                 rounds, lock)
    record_round(make_receipt(candidate_tps=55.0, is_main=False, label="L", round_hex="0000000b",
                              created_at="2026-11-29T11:00:00Z"), rounds, lock)
    record_round(make_receipt(candidate_tps=52.0, round_hex="0000000c", created_at="2026-11-29T12:00:00Z"),
                 rounds, lock)
    return tmp_path


PR = "20261129T110000Z-rcpt-test-0000000b.json"


def test_committed_repository_state_verifies_clean():
    out = scoreboard("verify", cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ok" in out.stdout
    # with the signer pin in place: every record is signed by a pinned key or listed as sealed before the pin
    report = json.loads(scoreboard("verify", "--json", cwd=REPO).stdout)
    assert report["ok"] and len(report["pre_pin"]) + sum(report["signed"].values()) == report["receipts"] + \
        report["calibrations"]


def test_clean_history_verifies(history: Path):
    rc, report = verify_json(history)
    assert (rc, report["ok"], report["receipts"], report["ledger_lines"]) == (0, True, 3, 5)


def test_hand_edited_receipt_is_found_by_field(history: Path):
    p = history / "rounds" / PR
    p.write_text(p.read_text().replace('"label": "L"', '"label": "XL"'))
    rc, report = verify_json(history)
    assert rc == 2
    assert found(report, PR, "verdict.label") and "edited after sealing" in found(report, PR, "verdict.label")[0]
    assert found(report, "ledger.jsonl:3", "receipt_sha256")
    assert found(report, "ledger.jsonl:3", "verdict") == [f"'L' but {p} says 'XL'"]
    # the human output names the file and field too, and exits 2 with a hint
    out = scoreboard("verify", "--lock", "reference.lock", "--rounds", "rounds", cwd=history)
    assert out.returncode == 2
    assert "verdict.label" in out.stdout and "verify found" in out.stderr and "next:" in out.stderr


def test_deleted_ledger_line_is_found(history: Path):
    lp = history / "rounds" / "ledger.jsonl"
    lines = lp.read_bytes().split(b"\n")
    del lines[2]  # the PR's round line
    lp.write_bytes(b"\n".join(lines))
    rc, report = verify_json(history)
    assert rc == 2
    assert found(report, "ledger.jsonl:3", "prev_sha256")
    assert any("no round line" in m for m in found(report, PR, "<file>"))


def test_reordered_ledger_is_found(history: Path):
    lp = history / "rounds" / "ledger.jsonl"
    lines = lp.read_bytes().split(b"\n")
    lines[2], lines[3] = lines[3], lines[2]
    lp.write_bytes(b"\n".join(lines))
    rc, report = verify_json(history)
    assert rc == 2
    assert found(report, "ledger.jsonl:3", "prev_sha256") and found(report, "ledger.jsonl:4", "prev_sha256")


def test_hand_edited_frontier_slot_is_found(history: Path):
    update_lock(history / "reference.lock", lambda doc: set_slot(doc, SCORED_SLOT, {"value": 60.0}))
    rc, report = verify_json(history)
    assert rc == 2
    assert found(report, "reference.lock", f"slots.{SCORED_SLOT}.value") == [
        "60.0 but ledger line 5 (round 20261129T120000Z-rcpt-test-0000000c) set it to 52.0 (hand-edited, or an "
        f"interrupted round: `scoreboard frontier resume --receipt {history / 'rounds'}/"
        "20261129T120000Z-rcpt-test-0000000c.json`)"]


def test_hand_seeded_slot_without_history_is_found(tmp_path: Path):
    lock = lock_with_test_target(tmp_path)
    update_lock(lock, lambda doc: set_slot(doc, SCORED_SLOT, {
        "value": 40.35, "unit": "tok/s", "kind": "frontier", "reps": 3, "round": "seeded",
        "commit": "3b6a3f4" + "0" * 33, "measured_at": "2026-08-05T00:00:00Z"}))
    rc, report = verify_json(tmp_path)
    assert rc == 2
    assert "not backed by any ledger line" in found(report, "reference.lock", f"slots.{SCORED_SLOT}.value")[0]


def test_receipt_missing_its_ledger_line_is_found(history: Path):
    rounds = history / "rounds"
    _seal_and_write(make_receipt(round_hex="0000000d", created_at="2026-11-29T13:00:00Z"), rounds,
                    ledger.head_sha256(rounds), None)
    rc, report = verify_json(history)
    assert rc == 2
    assert any("no round line" in m for m in found(report, "0000000d.json", "<file>"))


def test_public_key_requires_signed_receipts(tmp_path: Path):
    """--public-key narrows the pinned signers to one: a record another pinned key signed is a finding too."""
    priv, pub = generate_keypair(tmp_path / "keys" / "signing.key")
    repo = tmp_path / "repo"
    repo.mkdir()
    lock = pin_in(lock_with_test_target(repo), public_key_b64(load_public_key(pub)), "box-2")
    record_round(make_receipt(round_hex="0000000a"), repo / "rounds", lock, signing_key=priv)
    assert verify_json(repo, "--public-key", str(pub))[0] == 0
    record_round(make_receipt(round_hex="0000000b", is_main=False), repo / "rounds", lock)  # the session's key
    assert verify_json(repo)[0] == 0  # both keys are pinned
    rc, report = verify_json(repo, "--public-key", str(pub))
    assert rc == 2 and found(report, "0000000b.json", "seal.public_key") == [
        "signed by a key other than the trusted public key"]
