"""`scoreboard compare A B` and `round show --format`: what users of llama-bench, pyperf and asv reach for, on
real sealed receipts (history_factory, records.write_receipt) through the real entry point."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import pytest
from cli_helpers import run_cli
from history_factory import build_history
from receipt_factory import lock_with_test_target, make_receipt
from test_depth import profile_receipt

from scoreboard.history.records import write_receipt
from scoreboard.stats import unpaired_ratio_ci


@pytest.fixture
def history(tmp_path):
    return build_history(tmp_path / "h")


def _cli(monkeypatch, capsys, *args):
    monkeypatch.setenv("COLUMNS", "200")
    return run_cli(monkeypatch, capsys, *args)


def test_unpaired_ratio_ci_covers_the_ratio_of_geomeans():
    a = [100.0, 102.0, 98.0, 101.0, 99.0]
    b = [2 * x for x in (99.0, 101.5, 100.5, 98.5)]
    ci = unpaired_ratio_ci(b, a, seed=1)
    assert ci.point == pytest.approx(math.exp(sum(map(math.log, b)) / 4 - sum(map(math.log, a)) / 5))
    assert ci.low < ci.point < ci.high and ci.low > 1.9 and ci.high < 2.1
    same = unpaired_ratio_ci(a, list(reversed(a)), seed=1)
    assert same.low <= 1.0 <= same.high
    with pytest.raises(ValueError, match="at least 2 blocks per arm"):
        unpaired_ratio_ci([1.0], a)


def test_compare_two_main_rounds_per_metric_and_arm(history, monkeypatch, capsys):
    lock, rounds, ids = history
    code, out, err = _cli(monkeypatch, capsys, "compare", ids[1], ids[3], "--rounds", str(rounds), "--json")
    assert code == 0, err
    data = json.loads(out)
    rows = {(r["metric"], r["arm"]): r for r in data["rows"]}
    dec = rows[("decode 32 tok @ depth 512", "candidate")]
    assert (dec["a_value"], dec["b_value"]) == (pytest.approx(52.0), pytest.approx(56.0))
    assert dec["b_over_a"] == pytest.approx(56 / 52) and dec["ci"]["low"] <= dec["b_over_a"] <= dec["ci"]["high"]
    assert rows[("decode 32 tok @ depth 512", "reference")]["b_over_a"] == pytest.approx(41 / 40)
    assert rows[("prefill 256 tok @ depth 0", "candidate")]["b_over_a"] == pytest.approx(1000 / 950)
    assert list(rows)[0][0].startswith("decode")  # decode first, by depth
    code, out, _ = _cli(monkeypatch, capsys, "compare", ids[1], ids[3], "--rounds", str(rounds))
    text = " ".join(out.split())
    assert code == 0 and "B/A [95% CI]" in text and "1.077 [" in text and "geomean of block medians" in text


def test_compare_gives_an_interval_from_the_raw_blocks(tmp_path, monkeypatch, capsys):
    rounds = tmp_path / "rounds"
    a = write_receipt(make_receipt(candidate_tps=50.0, block_drift=True, round_hex="0000000a"), rounds)
    b = write_receipt(make_receipt(candidate_tps=55.0, block_drift=True, round_hex="0000000b",
                                   created_at="2026-11-30T14:15:00Z"), rounds)
    code, out, _ = _cli(monkeypatch, capsys, "compare", str(a), str(b), "--format", "csv")
    assert code == 0
    rows = list(csv.DictReader(out.strip().splitlines()))
    cand = next(r for r in rows if r["arm"] == "candidate" and r["metric"].startswith("decode"))
    lo, ratio, hi = float(cand["ci low"]), float(cand["B/A"]), float(cand["ci high"])
    assert lo < ratio < hi and ratio == pytest.approx(1.1, rel=0.01) and hi - lo > 0.001
    code, out, _ = _cli(monkeypatch, capsys, "compare", str(a), str(b), "--format", "md")
    lines = out.strip().splitlines()
    assert lines[0].startswith("| metric | arm | A value | B value | B/A |") and "---:" in lines[1]


@pytest.mark.parametrize("field,edit,says", [
    ("node", lambda r: r["lock_target"].update(node="cpu-x86_64"),
     "not comparable: lock_target.node: A has 'rcpt-test-cpu', B has 'cpu-x86_64'"),
    ("weights", lambda r: r["weights"]["files"][0].update(sha256="cd" * 32),
     "not comparable: weights.files[].sha256: different shard hashes"),
    ("geometry", lambda r: r["lock_target"]["geometry"].update(n_ctx=2048), "not comparable: lock_target.geometry"),
])
def test_compare_refuses_receipts_that_are_not_of_one_target_and_node_class(tmp_path, monkeypatch, capsys, field,
                                                                           edit, says):
    rounds = tmp_path / "rounds"
    a = write_receipt(make_receipt(round_hex="0000000a"), rounds)
    other = make_receipt(round_hex="0000000b", created_at="2026-11-30T14:15:00Z")
    edit(other)
    b = write_receipt(other, rounds)
    code, out, err = _cli(monkeypatch, capsys, "compare", str(a), str(b))
    assert code == 1 and says in " ".join(err.split()) and out == ""


def test_compare_refuses_an_edited_receipt(history, monkeypatch, capsys):
    lock, rounds, ids = history
    path = rounds / f"{ids[3]}.json"
    data = json.loads(path.read_text())
    data["speed"]["metrics"][0]["arms"]["candidate"]["blocks"][0]["samples_ns"][0] //= 2
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    code, out, err = _cli(monkeypatch, capsys, "compare", ids[1], ids[3], "--rounds", str(rounds))
    assert code == 2 and "TAMPERED" in err and out == ""


def test_compare_and_round_show_draw_decode_against_depth(tmp_path, monkeypatch, capsys):
    """A depth profile (decode at 1K, 16K, 64K, 128K): both receipts' every arm at every depth."""
    rounds = tmp_path / "rounds"
    lock_with_test_target(tmp_path)  # the lock of the records' checkout: it pins the session's signer
    monkeypatch.chdir(tmp_path)  # `round show` judges by the checkout it runs in
    a = write_receipt(profile_receipt(), rounds)
    slower = profile_receipt({1024: 45.0, 16384: 35.0, 65536: 20.0, 131072: 11.0})
    slower.update(round_id=slower["round_id"][:-8] + "0000000b", created_at="2026-11-29T14:15:00Z")
    b = write_receipt(slower, rounds)
    plot = tmp_path / "cmp.svg"
    code, out, _ = _cli(monkeypatch, capsys, "compare", str(a), str(b), "--plot", str(plot))
    assert code == 0 and "decode 32 tok @ depth 131072" in out
    svg = plot.read_text()
    points = re.findall(r'data-arm="(\w+)" data-depth="(\d+)"', svg)
    assert len(points) == 16 and {int(d) for _, d in points} == {1024, 16384, 65536, 131072}
    assert "A candidate" in svg and "B reference" in svg
    show = tmp_path / "show.svg"
    code, out, _ = _cli(monkeypatch, capsys, "round", "show", str(b), "--plot", str(show))
    text = " ".join(out.split())
    assert code == 0 and "decode by depth" in text and "131072" in text
    assert show.read_text().count('class="depth-point"') == 8


@pytest.mark.parametrize("fmt", ["md", "csv"])
def test_round_show_in_markdown_and_csv(history, monkeypatch, capsys, fmt):
    lock, rounds, ids = history
    code, out, _ = _cli(monkeypatch, capsys, "round", "show", ids[3], "--rounds", str(rounds), "--format", fmt,
                        "--lock", str(lock))  # the history's own lock: it pins the session's signer
    assert code == 0
    if fmt == "md":
        assert out.startswith("| metric | role | arm | value tok/s (geomean of block medians) |")
        assert "verdict **M**" in out
    else:
        rows = list(csv.DictReader(out.strip().splitlines()))
        assert {(r["arm"], r["metric"]) for r in rows} >= {("candidate", "decode 32 tok @ depth 512"),
                                                            ("reference", "prefill 256 tok @ depth 0")}
        assert float(next(r for r in rows if r["arm"] == "candidate" and "decode" in r["metric"])["value tok/s "
                     "(geomean of block medians)"]) == pytest.approx(56.0)


def test_round_show_names_the_near_round_id(history, monkeypatch, capsys):
    lock, rounds, ids = history
    code, _, err = _cli(monkeypatch, capsys, "round", "show", ids[3][:-1] + "x", "--rounds", str(rounds))
    assert code == 1 and f"did you mean {ids[3]}?" in " ".join(err.split())
    assert Path(rounds).is_dir()


def test_round_show_reads_each_depth_against_the_sealed_bandwidth_bound(tmp_path, monkeypatch, capsys):
    """The wide model's goal is a share of its bandwidth ceiling at depth (weights plus the f16 cache rows one token
    reads): `round show` prints that bound per depth from the receipt's sealed ceiling, and each arm's share of it.
    The ceiling here is chosen so the bound is 64 tok/s with no cache and exactly 32 at depth 131072."""
    from scoreboard.depth import profile_rows
    from scoreboard.history.receipt import parse_receipt

    rounds = tmp_path / "rounds"
    lock_with_test_target(tmp_path)
    monkeypatch.chdir(tmp_path)
    data = profile_receipt()
    # bandwidth 131.072 GB/s; 1/64 s of weights per token; 15,625 B a cached row: 131072 rows add another 1/64 s
    data["speed"]["ceiling"] = {"memory_bandwidth_gbs": 131.072, "devices": 1, "decode_max_tok_s": 64.0,
                                "decode_bytes_per_token": 2_048_000_000, "kv_bytes_per_row_f16": 15625,
                                "kv_floor_bytes_per_row": 7812}
    path = write_receipt(data, rounds)
    code, out, _ = _cli(monkeypatch, capsys, "round", "show", str(path))
    assert code == 0, out
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.replace("│", "|").split("|")[1:-1]]
        if len(cells) > 5 and cells[0] in ("1024", "131072"):
            rows[int(cells[0])] = cells
    _, table = profile_rows(parse_receipt(json.loads(path.read_text())))
    cand = table["candidate"][(131072, 32)]
    assert rows[131072][4] == "32", rows  # depth, tokens, candidate, reference, bound, candidate / bound, ...
    assert rows[131072][5] == f"{cand / 32:.1%}" and rows[1024][4] == "63.5", rows
    assert "131 GB/s x 1" in " ".join(out.split())
    # a receipt without a ceiling (an older one) shows the arms alone
    del data["speed"]["ceiling"]
    data.update(round_id=data["round_id"][:-8] + "0000000c", created_at="2026-11-29T14:20:00Z")
    code, out, _ = _cli(monkeypatch, capsys, "round", "show", str(write_receipt(data, rounds)))
    assert code == 0 and "decode by depth" in " ".join(out.split()) and "bound" not in out
