"""The round's typed working form: the shared log, the typed environment sub-models, the one verdict type."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scoreboard.errors import InputError
from scoreboard.history.receipt import EnvironmentRec, Verdict, normalize, parse_receipt, receipt_target
from scoreboard.round.context import RoundLog

REPO = Path(__file__).resolve().parents[1]
COMMITTED = sorted((REPO / "rounds").glob("*.json")) + [REPO / "tests" / "golden" / "receipt-1.0.json"]


def test_the_log_keeps_each_ranks_largest_peak_and_each_command_once():
    log = RoundLog()
    assert log.peak_memory() is None  # no launch yet: no peak_memory key in the receipt
    log.record_peaks([])
    assert log.peak_memory() == []  # a launch that reported nothing still says so
    log.record_peaks([{"rank": 1, "host_rss_gib": 2.0, "device_gib": None},
                      {"rank": 0, "host_rss_gib": 1.0, "device_gib": 3.0}])
    log.record_peaks([{"rank": 0, "host_rss_gib": 0.5, "device_gib": 4.0},
                      {"rank": 1, "host_rss_gib": 2.5, "device_gib": 1.0}])
    got = [p.model_dump(mode="json") for p in log.peak_memory()]
    assert got == [{"rank": 0, "host_rss_gib": 1.0, "device_gib": 4.0},
                   {"rank": 1, "host_rss_gib": 2.5, "device_gib": 1.0}]
    log.command(["a", "<gate>"])
    log.command(["a", "<gate>"])
    log.command(["ref"], once=False)
    log.command(["ref"], once=False)
    assert log.commands == [["a", "<gate>"], ["ref"], ["ref"]]


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.name)
def test_committed_receipts_parse_and_normalize_to_their_own_bytes(path):
    data = json.loads(path.read_text(encoding="utf-8"))
    assert normalize(data) == data
    env = parse_receipt(data).environment
    assert isinstance(env, EnvironmentRec)
    if "fit" in data["environment"]:
        assert env.fit is not None and env.fit.need_gib_per_rank == data["environment"]["fit"]["need_gib_per_rank"]
    if "peak_memory" in data["environment"]:
        assert [p.rank for p in env.peak_memory] == [p["rank"] for p in data["environment"]["peak_memory"]]


def test_the_verdict_reads_back_what_it_writes():
    v = Verdict(label="M", gain=0.1, gain_ci=(0.05, 0.15), basis="main-same-round", frontier=10.0, value=11.0,
                speed_label="M", reasons=["x"], explanation="e", flags=[])
    d = v.as_dict()
    assert d["gain_ci"] == [0.05, 0.15] and v.compliant
    assert Verdict.model_validate(d) == v
    with pytest.raises(ValueError):
        Verdict(label="XXL", reasons=[])


def test_receipt_target_names_the_bad_field():
    with pytest.raises(InputError, match=r"lock_target is not a valid target: lock_target\.\w+"):
        receipt_target({"round_id": "r", "lock_target": {"model": "x"}})
    with pytest.raises(InputError, match="lock_target: required field is missing"):
        receipt_target({"round_id": "r"})
