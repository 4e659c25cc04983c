"""`scoreboard ladder`: the frontier history per slot, with each step's tier, compounding per slot, a plot."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from ..errors import InputError, NonCompliant
from ..ladder import compounding, ladder_from_history, write_svg
from .console import console, print_json


def command(
    target: str = typer.Option(None, "--target", "-t", help="only this target"),
    rounds: Path = typer.Option(Path("rounds"), "--rounds", help="receipts + ledger directory"),
    plot: Path = typer.Option(Path("ladder.svg"), "--plot", metavar="FILE",
                              help="SVG file to write the plot to (one panel per slot)"),
    json_out: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """Frontier history per slot: tier of each step (main rounds that moved nothing shown as held, with their
    none, REJECT or aborted), compounding per slot over the moves (never across slots), SVG plot.

    Exit 2 when a step's receipt is missing, unsealed or edited (the step is shown as UNVERIFIED)."""
    if not json_out and not plot.parent.is_dir():
        raise InputError(f"--plot {plot}: directory {plot.parent} not found", "create it or pick another path")
    steps = ladder_from_history(rounds, target)
    comp = compounding(steps)
    bad = sorted({s.receipt_problem for s in steps if s.receipt_problem})
    if json_out:
        print_json({"steps": [s.as_dict() for s in steps], "compounding": {k: c.as_dict() for k, c in comp.items()},
                    "unverified": bad})
    elif not steps:
        console.print("no frontier has moved yet (next: `scoreboard round run` on main sets the BASELINE)")
    else:
        for slot, c in comp.items():
            t = Table(title=f"{slot}", title_justify="left")
            for col in ("date", "round", "commit", "tier", "before", "after", "step", "reference (same round)"):
                t.add_column(col)
            for s in (s for s in steps if s.slot == slot):
                step = "held" if s.kind == "held" else "BASELINE" if s.ratio is None else f"x{s.ratio:.4f}"
                t.add_row(s.date, s.round_id, s.commit[:12], "[red]UNVERIFIED[/]" if s.receipt_problem else s.tier,
                          f"{s.before:.4g}", f"{s.after:.4g}",
                          step + (" (lowered)" if s.kind == "frontier-lower" else ""),
                          "-" if s.reference is None else f"{s.reference:.4g}")
            console.print(t)
            if c.total_ratio is not None:
                console.print(f"  compounded x{c.total_ratio:.4f} ({c.first:.4g} -> {c.last:.4g} tok/s) over "
                              f"{c.steps} step(s) after the BASELINE; geometric mean per step "
                              f"x{c.geomean_step:.4f} over those {c.steps}", highlight=False)
        out = write_svg(steps, plot, f"frontier ladder{' - ' + target if target else ''}")
        console.print(f"plot: {out}")
    if bad:
        raise NonCompliant("ladder steps backed by receipts that do not verify: " + "; ".join(bad),
                           "run `scoreboard verify` and restore the named receipts from git")
