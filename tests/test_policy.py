"""`scoreboard verify --base REV` on real git repositories: a pull request's hostile commit against the base it
would merge into. Trust is read from the base: a key the pull request pins itself vouches for nothing, changed
slots need a receipt and changed bars a calibration sealed by a key pinned at the base, and history is
append-only. Real keys, seals, ledgers and git; the CLI run as CI runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomlkit
from calibration_fixtures import synthetic
from receipt_factory import SCORED_SLOT, lock_with_test_target, make_receipt
from signer_fixtures import pin_in

from scoreboard.calibrate import write_record
from scoreboard.history.records import record_round
from scoreboard.history.seal import generate_keypair, load_public_key, public_key_b64

TARGET = "rcpt-test"


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def verify(repo: Path, *extra: str) -> tuple[int, dict]:
    out = subprocess.run([sys.executable, "-m", "scoreboard", "verify", "--json", *extra], cwd=repo,
                         capture_output=True, text=True, timeout=120)
    assert out.stdout, out.stderr
    return out.returncode, json.loads(out.stdout)


def problems(report: dict) -> list[tuple[str, str, str]]:
    return [(Path(p["file"]).name, p["field"], p["message"]) for p in report["problems"]]


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """main: the test target's lock (the session's key pinned) and a history of two main rounds it signed."""
    r = tmp_path / "repo"
    r.mkdir()
    lock = lock_with_test_target(r)
    record_round(make_receipt(candidate_tps=50.0, round_hex="0000000a", created_at="2026-11-29T10:00:00Z"),
                 r / "rounds", lock)
    record_round(make_receipt(candidate_tps=53.0, round_hex="0000000b", created_at="2026-11-29T11:00:00Z"),
                 r / "rounds", lock)
    git(r, "init", "-q", "-b", "main")
    git(r, "add", "-A")
    git(r, "commit", "-qm", "history")
    git(r, "switch", "-qc", "pr")
    return r


@pytest.fixture
def attacker(tmp_path_factory) -> tuple[Path, str]:
    """A freshly made key, outside every checkout: (private key path, base64 public key)."""
    priv, pub = generate_keypair(tmp_path_factory.mktemp("attacker") / "signing.key")
    return priv, public_key_b64(load_public_key(pub))


def test_a_forged_main_round_is_refused_even_when_the_pull_request_pins_its_own_key(repo, attacker):
    """The 2026-12-02 attack: a forged XL (+40%) sealed with a fresh key, its ledger lines and raised slots
    committed. Before: `verify` passed (embedded keys only). Now: the key is not pinned, a finding; pinned by the
    same pull request, plain `verify` passes, and `verify --base main` refuses the record and the slot it raised."""
    priv, pub = attacker
    lock, rounds = repo / "reference.lock", repo / "rounds"
    forged = record_round(make_receipt(candidate_tps=74.2, label="XL", round_hex="0000000c",
                                       created_at="2026-11-29T12:00:00Z"), rounds, lock, signing_key=priv)
    assert forged.changes  # the slot raised from the forged receipt
    git(repo, "commit", "-qam", "records: XL")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "records: XL (receipt)")
    code, report = verify(repo)
    assert code == 2
    assert any(f == f"{forged.receipt['round_id']}.json" and k == "seal" and "signed by a key" in m and pub in m
               for f, k, m in problems(report))
    assert any(f == "reference.lock" and k == f"slots.{SCORED_SLOT}.value" for f, k, _ in problems(report))
    # the pull request pins the key it forged with: plain verify is satisfied, the base is not
    pin_in(lock, pub, "h200-2")
    git(repo, "commit", "-qam", "signers: pin the H200 box's key")
    assert verify(repo)[0] == 0
    code, report = verify(repo, "--base", "main")
    assert code == 2
    found = problems(report)
    assert any(f == f"{forged.receipt['round_id']}.json" and k == "seal" and "no key pinned at main signed it" in m
               for f, k, m in found), found
    assert any(k == f"slots.{SCORED_SLOT}" and "no key pinned at main vouches for" in m for _, k, m in found), found
    changed = {c["field"] for c in report["policy"]["changes"]}
    assert "signers.h200-2.public_key" in changed and f"slots.{SCORED_SLOT}.value" in changed


def test_a_round_the_pinned_key_sealed_is_listed_as_a_policy_change_and_backed(repo):
    lock, rounds = repo / "reference.lock", repo / "rounds"
    rec = record_round(make_receipt(candidate_tps=58.0, label="M", round_hex="0000000c",
                                    created_at="2026-11-29T12:00:00Z"), rounds, lock)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "records: M")
    code, report = verify(repo, "--base", "main")
    assert code == 0, report["problems"]
    policy = report["policy"]
    assert any(c["field"] == f"slots.{SCORED_SLOT}.value" and c["after"] == "58.0" for c in policy["changes"])
    assert any(rec.receipt["round_id"] in b and "signed by pinned key 'test-session'" in b for b in policy["backing"])


def test_bars_moved_with_a_forged_calibration_are_refused(repo, attacker):
    """kl_max x50 plus a calibration record made against the new bars, sealed with a fresh key: before, `verify`,
    `gate show` and `round run` accepted it. Now the record is untrusted (plain verify), and with the key pinned by
    the same pull request `verify --base main` still refuses the bars."""
    priv, pub = attacker
    lock, rounds = repo / "reference.lock", repo / "rounds"
    doc = tomlkit.parse(lock.read_text())
    doc["targets"][TARGET]["gate"]["kl_max"] = doc["targets"][TARGET]["gate"]["kl_max"] * 50
    lock.write_text(tomlkit.dumps(doc))
    write_record(synthetic(lock, target=TARGET), rounds, signing_key=priv)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "gate: kl_max as calibrated")
    code, report = verify(repo)
    assert code == 2 and any(f.startswith("cal-") and k == "seal" and "UNTRUSTED" in m
                             for f, k, m in problems(report))
    pin_in(lock, pub, "h200-2")
    git(repo, "commit", "-qam", "signers: pin")
    assert verify(repo)[0] == 0
    code, report = verify(repo, "--base", "main")
    found = problems(report)
    assert code == 2
    assert any(k == f"targets.{TARGET}" and "bars changed (gate.kl_max: 0.05 -> 2.5" in m and "not trusted at main" in m
               for _, k, m in found), found
    assert any(c["field"] == f"targets.{TARGET}.gate.kl_max" for c in report["policy"]["changes"])


def test_bars_moved_with_a_calibration_the_pinned_key_sealed_are_backed(repo):
    lock, rounds = repo / "reference.lock", repo / "rounds"
    doc = tomlkit.parse(lock.read_text())
    doc["targets"][TARGET]["gate"]["kl_max"] = 0.04
    lock.write_text(tomlkit.dumps(doc))
    write_record(synthetic(lock, target=TARGET), rounds)  # the session's key, pinned at main
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "gate: kl_max 0.04, calibrated")
    code, report = verify(repo, "--base", "main")
    assert code == 0, report["problems"]
    assert any(b.startswith(f"targets.{TARGET} bars (gate.kl_max: 0.05 -> 0.04)") for b in report["policy"]["backing"])


@pytest.mark.parametrize("edit", ["receipt deleted", "ledger truncated", "receipt rewritten"])
def test_history_the_base_holds_is_append_only(repo, edit, monkeypatch):
    rounds = repo / "rounds"
    receipt = sorted(rounds.glob("*.json"))[-1]
    if edit == "receipt deleted":
        receipt.unlink()
    elif edit == "ledger truncated":
        lines = (rounds / "ledger.jsonl").read_bytes().splitlines(keepends=True)
        (rounds / "ledger.jsonl").write_bytes(b"".join(lines[:-1]))
    else:
        receipt.write_text(receipt.read_text().replace('"explanation": "synthetic"', '"explanation": "edited"'))
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", edit)
    code, report = verify(repo, "--base", "main")
    assert code == 2
    name = "ledger.jsonl" if edit == "ledger truncated" else receipt.name
    assert any(f == name and k == "<file>" and ("append-only" in m or "written once" in m)
               for f, k, m in problems(report)), problems(report)


def test_a_base_that_is_not_a_commit_is_an_error_naming_the_fetch(repo):
    out = subprocess.run([sys.executable, "-m", "scoreboard", "verify", "--base", "origin/main"], cwd=repo,
                         capture_output=True, text=True)
    assert out.returncode == 1 and "--base origin/main: not a commit of" in out.stderr and "git fetch" in out.stderr


def test_ci_runs_verify_against_the_base_on_every_pull_request():
    import yaml

    ci = yaml.safe_load((Path(__file__).resolve().parent.parent / ".github" / "workflows" / "ci.yml").read_text())
    job = ci["jobs"]["history"]
    assert job["if"] == "github.event_name == 'pull_request'"
    assert job["steps"][0]["with"]["fetch-depth"] == 0
    step = next(s for s in job["steps"] if 'verify --base "origin/${GITHUB_BASE_REF}"' in s.get("run", ""))
    # judged by the base branch's harness: installed from its own checkout, run as the console script from the
    # pull request's tree (`python -m scoreboard` there would import the pull request's own package)
    assert step["working-directory"] == "pr" and step["run"].startswith("scoreboard verify")
    base = next(s for s in job["steps"] if s.get("with", {}).get("path") == "base")
    assert base["with"]["ref"] == "${{ github.base_ref }}"
    assert any(s.get("run", "").endswith("pip install -q -e ./base") for s in job["steps"])
    assert all(s["with"].get("persist-credentials") is False for s in job["steps"] if "checkout" in s.get("uses", ""))
