"""`scoreboard ladder`: the frontier history from the ledger, with compounding arithmetic and a plot."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from ..ladder import compounding, ladder_steps, write_svg
from ..ledger import read_ledger
from .console import console, print_json


def command(
    target: str = typer.Option(None, "--target", "-t", help="only this target"),
    rounds: Path = typer.Option(Path("rounds"), "--rounds", help="receipts + ledger directory"),
    plot: Path = typer.Option(Path("ladder.svg"), "--plot", help="SVG file to write the plot to"),
    json_out: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """Frontier history from the ledger: table, compounding (product, geometric mean per step), SVG plot."""
    steps = ladder_steps(read_ledger(rounds), target)
    comp = compounding(steps)
    if json_out:
        print_json({"steps": [s.__dict__ | {"ratio": s.ratio} for s in steps], "compounding": comp})
        return
    if not steps:
        console.print("no frontier has moved yet (next: `scoreboard round run` on main sets the BASELINE)")
        return
    t = Table(title="frontier ladder")
    for col in ("date", "round", "slot", "commit", "before", "after", "step"):
        t.add_column(col)
    for s in steps:
        t.add_row(s.date, s.round_id, s.slot, s.commit[:12], f"{s.before:.4g}", f"{s.after:.4g}",
                  "BASELINE" if s.ratio is None else f"x{s.ratio:.4f}" + (" (lowered)" if s.kind == "frontier-lower" else ""))
    console.print(t)
    if comp["total_ratio"] is not None:
        console.print(f"compounded: x{comp['total_ratio']:.4f} over {comp['steps']} step(s); "
                      f"geometric mean per step x{comp['geomean_step']:.4f}")
    out = write_svg(steps, plot, f"frontier ladder{' - ' + target if target else ''}")
    console.print(f"plot: {out}")
