"""A small sealed history for display tests (ladder, report, round show): real receipts, real seals, a real
ledger and real frontier raises, built with receipt_factory + records.record_round.

Two slots move (decode 512 and prefill 256 of the test target), over three main rounds (BASELINE, S, M);
a PR round and an aborted round sit in between.
"""

from __future__ import annotations

from pathlib import Path

from receipt_factory import lock_with_test_target, make_receipt
from scoreboard.history.records import record_round

ROUNDS = [
    dict(label="BASELINE", candidate_tps=50.0, guard_tps=900.0, created_at="2026-11-29T10:00:00Z",
         round_hex="00000001", commit="a" * 40),
    dict(label="S", candidate_tps=52.0, guard_tps=950.0, created_at="2026-11-30T10:00:00Z", round_hex="00000002",
         commit="b" * 40),
    dict(label="none", is_main=False, candidate_tps=51.0, created_at="2026-11-30T12:00:00Z", round_hex="00000003"),
    dict(label="M", candidate_tps=56.0, guard_tps=1000.0, reference_tps=41.0, created_at="2026-12-01T10:00:00Z",
         round_hex="00000004", commit="c" * 40),
    dict(status="aborted", created_at="2026-12-01T11:00:00Z", round_hex="00000005"),
]


def build_history(dest: Path) -> tuple[Path, Path, list[str]]:
    """(lock, rounds dir, round ids in order)."""
    dest.mkdir(parents=True, exist_ok=True)
    lock = lock_with_test_target(dest)
    rounds = dest / "rounds"
    ids = [record_round(make_receipt(**kw), rounds, lock).receipt["round_id"] for kw in ROUNDS]
    return lock, rounds, ids
