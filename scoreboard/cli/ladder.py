"""`scoreboard ladder`: the frontier history per slot, with each step's tier, compounding per slot, a plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from ..errors import InputError, NonCompliant
from ..ladder import SlotCompounding, Step, compounding, depth_curves, ladder_from_history, write_svg
from .console import console, print_json
from .formats import flat, pick_format
from .inputs import existing_dir, judging_lock, known_target

COLUMNS = ("slot", "metric", "date", "round", "commit", "kind", "tier", "measured", "frontier before",
           "frontier after", "step", "reference")


def _step_word(s: Step) -> str:
    word = {"held": "held", "frontier-rebase": "re-based"}.get(s.kind)
    if word:
        return word
    return ("BASELINE" if s.ratio is None else f"x{s.ratio:.4f}") + (" (lowered)" if s.kind == "frontier-lower" else "")


def _rows(steps: list[Step]) -> list[list[Any]]:
    return [[s.slot, s.metric, s.date, s.round_id, s.commit[:12], s.kind, "UNVERIFIED" if s.receipt_problem else s.tier,
             s.measured, s.before, s.after, _step_word(s), s.reference] for s in steps]


def _table(steps: list[Step], comp: dict[str, SlotCompounding]) -> None:
    for slot, c in comp.items():
        t = Table(title=f"{slot}", title_justify="left")
        for col in ("date", "round", "commit", "tier", "measured", "frontier before", "after", "step",
                    "reference (same round)"):
            t.add_column(col)
        for s in (s for s in steps if s.slot == slot):
            t.add_row(s.date, s.round_id, s.commit[:12], "[red]UNVERIFIED[/]" if s.receipt_problem else s.tier,
                      "-" if s.measured is None else f"{s.measured:.4g}", f"{s.before:.4g}", f"{s.after:.4g}",
                      _step_word(s), "-" if s.reference is None else f"{s.reference:.4g}")
        console.print(t)
        if c.total_ratio is not None:
            console.print(f"  compounded x{c.total_ratio:.4f} ({c.first:.4g} -> {c.last:.4g} tok/s) over "
                          f"{c.steps} step(s) after the BASELINE; geometric mean per step "
                          f"x{c.geomean_step:.4f} over those {c.steps}", highlight=False)


def command(
    target: str = typer.Option(None, "--target", "-t", help="only this target"),
    rounds: Path = typer.Option(Path("rounds"), "--rounds", help="receipts + ledger directory"),
    lock: Optional[Path] = typer.Option(None, "--lock", help="the pinned signers each step's receipt is judged by, "
                                        "and the targets --target is checked against (with the ledger's); default: "
                                        "this checkout's reference.lock (./reference.lock or the working tree's "
                                        "root), never one that merely lies beside the receipts"),
    plot: Path = typer.Option(Path("ladder.svg"), "--plot", metavar="FILE",
                              help="SVG file to write the plot to (one panel per slot, then decode tok/s by depth)"),
    fmt: Optional[str] = typer.Option(None, "--format", metavar="table|json|csv|md",
                                      help="output format (default table; md: a table to paste, as llama-bench -o md)"),
    json_out: bool = typer.Option(False, "--json", help="machine-readable output (= --format json)"),
) -> None:
    """Frontier history per slot: every main round at what it measured, its tier (rounds that moved nothing shown
    as held, with their none, regression, REJECT or aborted), the frontier it left standing, compounding per slot
    over the moves (never across slots, restarting at a re-base), SVG plot.

    Exit 2 when a step's receipt is missing, unsealed, edited or vouched for by no pinned key (the step is shown
    as UNVERIFIED)."""
    from ..history.sealed import untrusted_hint
    from ..history.trust import near

    out_fmt = pick_format(fmt, json_out)
    existing_dir(rounds, "--rounds")
    judging_lock(lock)
    trust = near(rounds, lock)  # --lock, else this checkout's: never a lock that only lies beside the receipts
    known_target(target, trust.source or None, rounds)
    if out_fmt == "table" and not plot.parent.is_dir():
        raise InputError(f"--plot {plot}: directory {plot.parent} not found", "create it or pick another path")
    steps = ladder_from_history(rounds, target, trust=trust)
    comp = compounding(steps)
    bad = sorted({s.receipt_problem for s in steps if s.receipt_problem})
    if out_fmt == "json":
        print_json({"steps": [s.as_dict() for s in steps], "compounding": {k: c.as_dict() for k, c in comp.items()},
                    "unverified": bad})
    elif out_fmt in ("csv", "md"):
        print(flat(COLUMNS, _rows(steps), out_fmt))
    elif not steps:
        console.print("no frontier has moved yet (next: `scoreboard round run` on main sets the BASELINE)")
    else:
        _table(steps, comp)
        out = write_svg(steps, plot, f"frontier ladder{' - ' + target if target else ''}",
                        depth_curves(rounds, steps, trust))
        console.print(f"plot: {out}")
    if bad:
        untrusted = any(": UNTRUSTED" in b for b in bad)
        raise NonCompliant("ladder steps backed by receipts that do not verify: " + "; ".join(bad),
                           untrusted_hint(trust) if untrusted and trust.next_step() else
                           "run `scoreboard verify` and restore the named receipts from git")
