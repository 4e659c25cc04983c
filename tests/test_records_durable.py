"""Records no routine git step can lose: the durable copy under refs/scoreboard/records, the refusals at a round's
start, re-chaining at any position, interrupted raises, and PR commits that carry records. Real git repositories
(rounds/ and the lock tracked in them, as in this one), real seals and ledgers; the real-round reproduction of the
git sequence is tests/test_exploits_history.py."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from receipt_factory import SCORED_SLOT, lock_with_test_target, make_receipt

from scoreboard.errors import InputError, NonCompliant
from scoreboard.history import durable, ledger
from scoreboard.history.held import load_history
from scoreboard.history.records import recover, record_round, write_receipt
from scoreboard.history.verify import verify
from scoreboard.lockfile import load_lock
from scoreboard.round import candidate as cand

TARGET = "rcpt-test"
_n = iter(range(1, 10_000))


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def rid() -> dict:
    i = next(_n)
    return {"round_hex": f"{i:08x}", "created_at": f"2026-11-29T{10 + i // 60:02d}:{i % 60:02d}:00Z"}


def main_round(lock: Path, rounds: Path, tps: float, label: str = "S"):
    out = record_round(make_receipt(candidate_tps=tps, label=label, **rid()), rounds, lock)
    durable.save(rounds, lock, f"round {out.receipt['round_id']}")  # what a round's _finish does
    return out


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A repository tracking reference.lock and rounds/ on main, with one sealed BASELINE and its saved records."""
    r = tmp_path / "repo"
    r.mkdir()
    git(r, "init", "-q", "-b", "main")
    lock = lock_with_test_target(r)
    (r / "engines").mkdir()
    (r / "engines" / "e.py").write_text("x = 1\n")
    main_round(lock, r / "rounds", 50.0, "BASELINE")
    git(r, "add", "-A")
    git(r, "commit", "-qm", "records: BASELINE")
    return r


def _slots(lock: Path) -> dict[str, float]:
    return {k: v.value for k, v in load_lock(lock).slots.items() if v.value}


def test_the_records_ref_is_written_without_touching_the_index_or_the_work_tree(repo):
    lock, rounds = repo / "reference.lock", repo / "rounds"
    index = (repo / ".git" / "index").read_bytes()
    main_round(lock, rounds, 53.0)
    assert (repo / ".git" / "index").read_bytes() == index  # plumbing only
    assert git(repo, "status", "--porcelain") != ""  # the new records are the working tree's, uncommitted
    store = durable.locate(rounds)
    assert store.ref == "refs/scoreboard/records" and store.git_dir == (repo / ".git").resolve()
    files = git(repo, "ls-tree", "-r", "--name-only", store.ref).splitlines()
    assert "reference.lock" in files and "rounds/ledger.jsonl" in files
    assert sum(f.startswith("rounds/2026") for f in files) == 2
    assert git(repo, "rev-list", "--count", store.ref) == "2"  # one commit per save that changed something
    assert durable.save(rounds, lock, "again").changed is False
    assert durable.differences(rounds, lock) == []


def test_the_git_sequence_that_lost_a_raise_loses_nothing(repo):
    """The sequence of 2026-12-02: a main round's records uncommitted, then `git switch -c pr; edit; git commit
    -am; git switch main`. Before: the ledger line and the raise went into the PR's commit, the receipt stayed
    behind on no ledger line, the next round chained past it. Now the round refuses to start (nothing written),
    the PR's commit is refused as a candidate, and `frontier resume` restores everything."""
    lock, rounds = repo / "reference.lock", repo / "rounds"
    xl = main_round(lock, rounds, 59.0, "XL")
    sealed = {"ledger": (rounds / "ledger.jsonl").read_bytes(), "slots": _slots(lock)}
    assert sealed["slots"][SCORED_SLOT] == 59.0
    git(repo, "switch", "-qc", "pr")
    (repo / "engines" / "e.py").write_text("x = 2\n")
    git(repo, "commit", "-qam", "faster")
    git(repo, "switch", "-q", "main")
    assert xl.path.is_file()  # untracked: the only trace in the working tree
    assert (rounds / "ledger.jsonl").read_bytes() != sealed["ledger"] and _slots(lock)[SCORED_SLOT] == 50.0
    # the next round refuses, nothing written
    before = {p: p.read_bytes() for p in rounds.rglob("*") if p.is_file()}
    with pytest.raises(InputError) as exc:
        load_history(rounds, load_lock(lock), TARGET, lock)
    assert xl.path.name in exc.value.message and "scoreboard frontier resume" in exc.value.hint
    with pytest.raises(InputError) as exc:
        durable.refuse_unsettled(rounds, lock)
    assert "differ from their last sealed state" in exc.value.message and "frontier resume" in exc.value.hint
    assert {p: p.read_bytes() for p in rounds.rglob("*") if p.is_file()} == before
    # the PR's commit carries the ledger line and the raise: refused as a candidate, naming the paths
    with pytest.raises(InputError) as exc:
        cand.resolve("pr", repo / "scratch", repo, "main")
    assert "rounds/ledger.jsonl" in exc.value.message and "reference.lock" in exc.value.message
    # resume: everything back, verify clean, and the records saved again
    rec = recover(rounds, lock)
    assert any("rounds/ledger.jsonl" in w for w in rec.restored.written)
    assert (rounds / "ledger.jsonl").read_bytes() == sealed["ledger"] and _slots(lock) == sealed["slots"]
    assert verify(lock, rounds).ok and durable.differences(rounds, lock) == []
    load_history(rounds, load_lock(lock), TARGET, lock)


def test_a_sealed_receipt_on_no_ledger_line_refuses_the_round(repo):
    """`held.load_history` ignored it, so a round sealed over it and its round was lost for good."""
    lock, rounds = repo / "reference.lock", repo / "rounds"
    lines = (rounds / "ledger.jsonl").read_bytes()
    orphan = record_round(make_receipt(candidate_tps=61.0, label="XL", **rid()), rounds, lock)
    (rounds / "ledger.jsonl").write_bytes(lines)  # its lines lost, the receipt kept
    with pytest.raises(InputError) as exc:
        load_history(rounds, load_lock(lock), TARGET, lock)
    assert f"1 receipt(s) on no ledger line ({orphan.path.name})" in exc.value.message
    assert "scoreboard frontier resume" in exc.value.hint
    recover(rounds, lock)
    assert verify(lock, rounds).ok and _slots(lock)[SCORED_SLOT] == 61.0


def test_rechain_puts_a_receipt_back_at_any_position_and_finishes_its_raise(repo):
    """The fork the old harness left: an XL sealed after line N lost its lines, and the next round was sealed
    after line N too. Before: `rechain` only appended at the head, the XL stayed orphaned for good. Now it is
    re-chained as a round-late line and its raise written."""
    lock, rounds = repo / "reference.lock", repo / "rounds"
    lines, lock_text = (rounds / "ledger.jsonl").read_bytes(), lock.read_text()
    xl = record_round(make_receipt(candidate_tps=70.0, label="XL", **rid()), rounds, lock)
    (rounds / "ledger.jsonl").write_bytes(lines)  # lost: the XL's round and raise lines, and the lock's raise
    lock.write_text(lock_text)
    later = record_round(make_receipt(candidate_tps=52.0, label="XS", **rid()), rounds, lock)  # chained past it
    assert xl.receipt["seal"]["prev_ledger_sha256"] == later.receipt["seal"]["prev_ledger_sha256"]
    assert not verify(lock, rounds).ok
    out = recover(rounds, lock).rechained
    assert out.orphaned == [] and out.appended[0].startswith(f"round-late {xl.receipt['round_id']}")
    assert [c.after for c in out.raised[xl.receipt["round_id"]] if c.slot == SCORED_SLOT] == [70.0]
    entries = ledger.read_entries(rounds)
    assert [e.kind for e in entries[-2:]] == ["round-late", "frontier-raise"]
    assert verify(lock, rounds).ok, verify(lock, rounds).problems
    assert _slots(lock)[SCORED_SLOT] == 70.0
    load_history(rounds, load_lock(lock), TARGET, lock)  # a round may run on it


def test_an_interrupted_raise_is_found_and_finished_whatever_came_after(repo):
    """An interrupt between a main round's round line and its raise line, then more rounds. Before: the raise was
    lost silently (`resume_round` looked at the last round only) and `verify` said nothing."""
    lock, rounds = repo / "reference.lock", repo / "rounds"
    cut = write_receipt(make_receipt(candidate_tps=66.0, label="L", **rid()), rounds)  # round line, no raise
    record_round(make_receipt(candidate_tps=51.0, is_main=False, label="none", **rid()), rounds, lock)
    record_round(make_receipt(candidate_tps=50.5, label="none", **rid()), rounds, lock)
    report = verify(lock, rounds)
    found = [p.message for p in report.problems if p.field == "round_id"]
    assert any(cut.stem in m and "earned slot changes no frontier-raise line records" in m and f"{SCORED_SLOT} 50.0 -> "
               "66.0" in m for m in found), report.problems
    out = recover(rounds, lock).rechained
    assert out.raised[cut.stem] and any("an interrupted raise, finished now" in a for a in out.appended)
    assert verify(lock, rounds).ok and _slots(lock)[SCORED_SLOT] == 66.0


def test_a_raise_superseded_by_later_rounds_is_a_note_and_never_undoes_them(repo):
    lock, rounds = repo / "reference.lock", repo / "rounds"
    cut = write_receipt(make_receipt(candidate_tps=60.0, reference_tps=41.0, label="L", **rid()), rounds)
    record_round(make_receipt(candidate_tps=63.0, reference_tps=42.0, label="S", **rid()), rounds, lock)
    report = verify(lock, rounds)
    assert report.ok and any(cut.stem in n and "superseded" in n for n in report.notes)
    out = recover(rounds, lock).rechained
    assert cut.stem not in out.raised  # the later 63.0 and its baseline stand
    assert _slots(lock)[SCORED_SLOT] == 63.0


def test_an_untrusted_orphan_is_never_chained(repo, tmp_path_factory):
    from scoreboard.history.seal import generate_keypair

    lock, rounds = repo / "reference.lock", repo / "rounds"
    key, _ = generate_keypair(tmp_path_factory.mktemp("k") / "forger.key")
    forged = write_receipt(make_receipt(candidate_tps=99.0, label="XL", **rid()), rounds, signing_key=key)
    lines = (rounds / "ledger.jsonl").read_bytes().splitlines(keepends=True)
    (rounds / "ledger.jsonl").write_bytes(b"".join(lines[:-1]))  # dropped into rounds/ with no line
    out = recover(rounds, lock).rechained
    assert [(p.name, w.split(":")[0]) for p, w in out.orphaned] == [(forged.name, "UNTRUSTED")]
    assert SCORED_SLOT in _slots(lock) and _slots(lock)[SCORED_SLOT] == 50.0


def test_saving_never_drops_what_the_ref_holds(repo):
    lock, rounds = repo / "reference.lock", repo / "rounds"
    main_round(lock, rounds, 53.0)
    newest = sorted(rounds.glob("*.json"))[-1]
    os.rename(newest, repo / "elsewhere.json")
    with pytest.raises(InputError, match="saving would drop what its last state holds") as exc:
        durable.save(rounds, lock, "x")
    assert "scoreboard frontier resume" in exc.value.hint
    assert any("gone" in d for d in durable.differences(rounds, lock))
    assert any("restored" in w for w in durable.restore(rounds, lock).written)
    assert newest.read_bytes() == (repo / "elsewhere.json").read_bytes()


def test_a_pr_commit_that_changes_records_is_refused_naming_the_paths(repo):
    git(repo, "switch", "-qc", "pr")
    (repo / "engines" / "e.py").write_text("x = 3\n")
    git(repo, "commit", "-qam", "engine only")
    cand.refuse_records_change("pr", git(repo, "rev-parse", "pr"), repo, "main")  # engine code only: fine
    doc = json.loads(sorted((repo / "rounds").glob("*.json"))[0].read_text())
    (repo / "rounds" / "extra.json").write_text(json.dumps(doc))
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "and a record")
    with pytest.raises(InputError) as exc:
        cand.resolve("pr", repo / "scratch", repo, "main")
    assert "changes the harness's records relative to main" in exc.value.message
    assert "rounds/extra.json" in exc.value.message and "git checkout main -- rounds/extra.json" in exc.value.hint


def test_records_status_and_restore_through_the_cli(repo):
    import sys

    lock, rounds = repo / "reference.lock", repo / "rounds"

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "scoreboard", "records", *args, "--lock", str(lock), "--rounds",
                               str(rounds)], capture_output=True, text=True)

    assert cli("status").returncode == 0
    receipt = sorted(rounds.glob("*.json"))[0]
    receipt.unlink()
    out = cli("status")
    assert out.returncode == 2 and f"rounds/{receipt.name}: gone" in out.stdout
    out = cli("restore")
    assert out.returncode == 0 and f"rounds/{receipt.name}: restored" in out.stdout and receipt.is_file()
    assert cli("status").returncode == 0


def test_a_resume_that_cannot_chain_a_receipt_still_names_it(repo):
    lock, rounds = repo / "reference.lock", repo / "rounds"
    from scoreboard.history.records import _seal_and_write, resume_round

    p, _, _ = _seal_and_write(make_receipt(is_main=False, label="none", **rid()), rounds, "ab" * 32, None)
    with pytest.raises(NonCompliant, match="cannot be re-chained"):
        resume_round(p, rounds, lock)
