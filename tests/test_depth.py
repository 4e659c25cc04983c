"""Decode tok/s against depth (scoreboard/depth.py): read from a receipt's existing fields only, every arm, every
decode metric it holds (a depth profile of four, or today's one), drawn on a log2 depth axis."""

from __future__ import annotations

import copy
import re

import pytest
from receipt_factory import make_receipt

from scoreboard.depth import decode_profile, profile_rows, profile_svg, receipt_curves
from scoreboard.history.receipt import parse_receipt

PROFILE = (1024, 16384, 65536, 131072)


def profile_receipt(values: dict[int, float] | None = None) -> dict:
    """A sealed-shape receipt whose target scores decode at four depths (1024 scored, the rest guards) beside the
    prefill guard: the candidate falls with depth as `values` says, the reference at 0.8x of it."""
    from scoreboard.lockfile import Metric, Target

    values = values or {1024: 50.0, 16384: 40.0, 65536: 25.0, 131072: 16.0}
    r = make_receipt(candidate_tps=values[1024], reference_tps=values[1024] * 0.8, block_drift=True)
    lt = r["lock_target"]
    dec_metric = next(m for m in lt["metrics"] if m["phase"] == "decode")
    lt["metrics"] = [{**dec_metric, "depth": d, "role": "scored" if d == 1024 else "guard"} for d in PROFILE] + \
        [m for m in lt["metrics"] if m["phase"] != "decode"]
    lt["geometry"]["n_ctx"] = 131072 + 64
    lt["gate"]["depths"] = [1024]
    target = Target.model_validate(lt)
    dec = r["speed"]["metrics"][0]
    dec["depth"] = 1024
    dec["slot"] = target.slot("sparkinfer", Metric(phase="decode", depth=1024, n_tokens=32, role="scored"))
    for depth in PROFILE[1:]:
        m = copy.deepcopy(dec)
        scale = values[depth] / values[1024]
        for arm in m["arms"].values():
            for b in arm["blocks"]:
                b["samples_ns"] = [round(ns / scale) for ns in b["samples_ns"]]
        m.update(depth=depth, role="guard",
                 slot=target.slot("sparkinfer", Metric(phase="decode", depth=depth, n_tokens=32, role="guard")))
        r["speed"]["metrics"].insert(-1, m)
    return r


def test_every_decode_metric_of_every_arm_by_depth():
    r = parse_receipt(profile_receipt())
    prof = decode_profile(r)
    assert list(prof) == ["candidate", "reference"]  # the candidate first, the reference last
    assert [p.depth for p in prof["candidate"]] == list(PROFILE)
    assert [p.value for p in prof["candidate"]] == pytest.approx([50.0, 40.0, 25.0, 16.0], rel=0.01)
    assert [p.value for p in prof["reference"]] == pytest.approx([40.0, 32.0, 20.0, 12.8], rel=0.01)
    assert [p.role for p in prof["candidate"]] == ["scored", "guard", "guard", "guard"]
    keys, table = profile_rows(r)
    assert keys == [(d, 32) for d in PROFILE] and table["reference"][(65536, 32)] == pytest.approx(20.0, rel=0.01)


def test_the_plot_has_a_log2_depth_axis_and_a_point_per_arm_and_depth():
    svg = profile_svg(receipt_curves(parse_receipt(profile_receipt())), "t")
    pts = re.findall(r'data-arm="(\w+)" data-depth="(\d+)" cx="([\d.]+)" cy="([\d.]+)"', svg)
    assert sorted((a, int(d)) for a, d, _, _ in pts) == sorted((a, d) for a in ("candidate", "reference")
                                                               for d in PROFILE)
    x = {int(d): float(cx) for a, d, cx, _ in pts if a == "candidate"}
    # log2: 1K -> 16K is 4 doublings, 16K -> 64K 2, 64K -> 128K 1
    assert (x[16384] - x[1024]) / (x[131072] - x[65536]) == pytest.approx(4.0, rel=1e-3)
    assert (x[65536] - x[16384]) / (x[131072] - x[65536]) == pytest.approx(2.0, rel=1e-3)
    y = {int(d): float(cy) for a, d, _, cy in pts if a == "candidate"}
    assert y[1024] < y[16384] < y[65536] < y[131072]  # falls with depth (SVG y grows downward)
    for label in (">1K<", ">16K<", ">64K<", ">128K<", "context depth (tokens in the cache, log scale)",
                  "decode (tok/s, higher is better)"):
        assert label in svg, label


def test_one_decode_metric_still_draws():
    r = parse_receipt(make_receipt())
    prof = decode_profile(r)
    assert {a: [p.depth for p in pts] for a, pts in prof.items()} == {"candidate": [512], "reference": [512]}
    svg = profile_svg(receipt_curves(r), "t")
    assert svg.count('class="depth-point"') == 2 and ">512<" in svg and "<polyline" not in svg


def test_a_receipt_without_speed_says_so():
    r = parse_receipt(make_receipt(gate_pass=False, label="REJECT"))
    assert decode_profile(r) == {}
    assert "no decode metric in this receipt" in profile_svg(receipt_curves(r), "t")
