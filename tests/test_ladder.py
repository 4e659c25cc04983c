"""Ladder: frontier steps from ledger lines, compounding arithmetic, SVG output."""

from __future__ import annotations

import math

from scoreboard.ladder import compounding, ladder_steps, write_svg


def _line(kind, changes, target="t", rid="r"):
    return {"kind": kind, "round_id": rid, "date": "2026-11-29T00:00:00Z", "target": target, "changes": changes}


def _ch(before, after, kind="frontier", slot="S"):
    return {"slot": slot, "kind": kind, "before": before, "after": after, "reps": 3, "commit": "c" * 40}


def test_steps_only_from_frontier_changes():
    lines = [_line("round", []), _line("frontier-raise", [_ch(0, 10), _ch(0, 5, kind="baseline", slot="B")]),
             _line("frontier-raise", [_ch(10, 12)]), _line("frontier-lower", [_ch(12, 11)]),
             _line("frontier-raise", [_ch(0, 1)], target="other")]
    steps = ladder_steps(lines, "t")
    assert [(s.before, s.after, s.kind) for s in steps] == [(0, 10, "frontier-raise"), (10, 12, "frontier-raise"),
                                                            (12, 11, "frontier-lower")]
    assert steps[0].ratio is None  # BASELINE has no ratio
    comp = compounding(steps)["S"]
    assert math.isclose(comp.total_ratio, 11 / 10) and comp.steps == 2  # the BASELINE is not a step
    assert math.isclose(comp.geomean_step, (11 / 10) ** 0.5)  # over exactly the count it states
    assert (comp.first, comp.last) == (10, 11)


def test_compounding_never_multiplies_slots_together():
    lines = [_line("frontier-raise", [_ch(0, 100, slot="DEC"), _ch(0, 4000, slot="PRE")]),
             _line("frontier-raise", [_ch(100, 120, slot="DEC"), _ch(4000, 4400, slot="PRE")])]
    comp = compounding(ladder_steps(lines))
    assert set(comp) == {"DEC", "PRE"}
    assert math.isclose(comp["DEC"].total_ratio, 1.2) and math.isclose(comp["PRE"].total_ratio, 1.1)
    assert comp["DEC"].steps == comp["PRE"].steps == 1


def test_svg_is_written_atomically(tmp_path):
    steps = ladder_steps([_line("frontier-raise", [_ch(0, 10)]), _line("frontier-raise", [_ch(10, 12)])])
    out = write_svg(steps, tmp_path / "ladder.svg", "t")
    text = out.read_text()
    assert text.startswith("<svg") and "polyline" in text and text.rstrip().endswith("</svg>")
    assert text.count('class="slot-panel"') == 1 and "tok/s" in text
    assert [p.name for p in tmp_path.iterdir()] == ["ladder.svg"]


def test_held_steps_show_main_rounds_that_moved_nothing_and_compound_nothing():
    """The tiers as they came: a main round's REJECT or none is a held step at the frontier it left standing;
    a PR round and a round before any BASELINE are not; the compounding counts only the moves."""
    def rnd(rid, verdict, before, main=True, slot="S"):
        return {"kind": "round", "round_id": rid, "date": f"2026-12-01T00:0{rid[-1]}:00Z", "target": "t",
                "slot": slot, "is_main": main, "verdict": verdict, "frontier_before": before,
                "candidate_commit": rid * 8, "changes": []}

    lines = [rnd("r0", "BASELINE", 0.0), _line("frontier-raise", [_ch(0, 10)], rid="r0"),
             rnd("r1", "REJECT", 10.0), rnd("r2", "XL", 10.0, main=False),
             rnd("r3", "M", 10.0), _line("frontier-raise", [_ch(10, 11)], rid="r3"), rnd("r4", "none", 11.0),
             rnd("r5", "aborted", 0.0)]
    assert [s.round_id for s in ladder_steps(lines, "t")] == ["r0", "r3"]
    steps = ladder_steps(lines, "t", held=True)
    assert [(s.round_id, s.kind, s.tier, s.before, s.after) for s in steps] == [
        ("r0", "frontier-raise", "", 0.0, 10.0), ("r1", "held", "REJECT", 10.0, 10.0),
        ("r3", "frontier-raise", "", 10.0, 11.0), ("r4", "held", "none", 11.0, 11.0)]
    assert steps[1].ratio is None and steps[3].ratio is None
    comp = compounding(steps)["S"]
    assert comp.steps == 1 and math.isclose(comp.total_ratio, 1.1) and comp.last == 11.0


def test_a_rebase_starts_the_compounding_afresh():
    lines = [_line("frontier-raise", [_ch(0, 100)]), _line("frontier-raise", [_ch(100, 120)]),
             _line("frontier-rebase", [_ch(120, 30)]), _line("frontier-raise", [_ch(30, 33)])]
    steps = ladder_steps(lines)
    assert [s.kind for s in steps][2] == "frontier-rebase" and steps[2].ratio is None  # a new basis, not a step
    comp = compounding(steps)["S"]
    assert (comp.first, comp.last, comp.steps) == (30, 33, 1) and math.isclose(comp.total_ratio, 1.1)


def test_the_plot_draws_what_each_round_measured_and_the_held_frontier_apart(tmp_path):
    """A loaded main job measured 6.1 tok/s while the frontier held at 147: the ladder plotted it at 147 beside a
    reference line at what was measured. Each round is drawn at what it measured; the frontier is its own line."""
    from scoreboard.ladder import Step, slot_panel_svg

    steps = [Step("r1", "2026-11-29T00:00:00Z", "S", "a" * 40, 0.0, 147.3, "frontier-raise", "BASELINE", 803.1,
                  147.3),
             Step("r2", "2026-12-02T00:00:00Z", "S", "b" * 40, 147.3, 147.3, "held", "inconclusive", 25.0, 6.1)]
    svg = slot_panel_svg("S", steps)
    assert "inconclusive 6.1<" in svg and "measured 6.1 tok/s (inconclusive); frontier held at 147" in svg
    assert "frontier held" in svg and "candidate, measured" in svg
    import re

    ys = {m.group(1): float(m.group(2)) for m in re.finditer(r'data-round="(r\d)" cx="[\d.]+" cy="([\d.]+)"', svg)}
    assert ys["r2"] > ys["r1"] + 20  # drawn below the frontier it held (147), where it measured (6.1)
