"""`scoreboard compare A B`: two sealed receipts per metric, depth and arm, B/A with its CI from the raw samples."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from ..errors import InputError
from .console import console, err_console, print_json
from .formats import flat, pick_format

COLUMNS = ("metric", "arm", "A value", "B value", "B/A", "ci low", "ci high", "A median", "B median", "A blocks",
           "B blocks")


def _rows(pairs: list[Any]) -> list[list[Any]]:
    return [[p.metric, p.arm, round(p.a_value, 4), round(p.b_value, 4), round(p.b_value / p.a_value, 4),
             None if p.ratio is None else round(p.ratio.low, 4), None if p.ratio is None else round(p.ratio.high, 4),
             round(p.a_median, 4), round(p.b_median, 4), p.a_blocks, p.b_blocks] for p in pairs]


def _table(a: Any, b: Any, pairs: list[Any]) -> None:
    t = Table(title=f"B/A: A = {a.round_id} ({a.candidate.label} {a.candidate.commit[:12]}), B = {b.round_id} "
                    f"({b.candidate.label} {b.candidate.commit[:12]}); tok/s, value = geomean of block medians",
              title_justify="left")
    for col in ("metric", "arm", "A", "B", "B/A [95% CI]", "A median", "B median", "blocks A/B"):
        t.add_column(col, justify="left" if col in ("metric", "arm") else "right")
    last = ""
    for p in pairs:
        ci = "" if p.ratio is None else f" [{p.ratio.low:.3f}, {p.ratio.high:.3f}]"
        t.add_row(p.metric if p.metric != last else "", p.arm, f"{p.a_value:.4g}", f"{p.b_value:.4g}",
                  f"{p.b_value / p.a_value:.3f}{ci}", f"{p.a_median:.4g}", f"{p.b_median:.4g}",
                  f"{p.a_blocks}/{p.b_blocks}")
        last = p.metric
    console.print(t)


def command(
    a: str = typer.Argument(..., metavar="A", help="a receipt: a round id (or a unique part of one) or a .json path"),
    b: str = typer.Argument(..., metavar="B", help="the other receipt, compared against A (B/A)"),
    rounds: Path = typer.Option(Path("rounds"), "--rounds", help="receipts directory for round ids"),
    fmt: Optional[str] = typer.Option(None, "--format", metavar="table|json|csv|md",
                                      help="output format (md: a table to paste, as llama-bench -o md)"),
    json_out: bool = typer.Option(False, "--json", help="machine-readable output (= --format json)"),
    plot: Optional[Path] = typer.Option(None, "--plot", metavar="FILE",
                                        help="also write both receipts' decode tok/s against depth, every arm (SVG)"),
) -> None:
    """Compare two sealed receipts: per metric and depth, each arm's value and median in A and in B, and B/A with
    its 95% CI (blocks of two rounds are not paired: each resampled on its own). Refused, naming the field, when
    they are not of one target on one node class. Exit 2 when either receipt is edited or unsealed."""
    from ..compare import compare
    from ..depth import receipt_curves, write_profile
    from ..history.sealed import read_sealed
    from .inputs import receipt_path

    out_fmt = pick_format(fmt, json_out)
    if plot is not None and not plot.parent.is_dir():
        raise InputError(f"--plot {plot}: directory {plot.parent} not found", "create it or pick another path")
    ra = read_sealed(receipt_path(a, rounds, "A")).receipt
    rb = read_sealed(receipt_path(b, rounds, "B")).receipt
    pairs, alone = compare(ra, rb)
    if out_fmt == "json":
        print_json({"a": ra.round_id, "b": rb.round_id, "target": ra.target, "rows": [p.as_dict() for p in pairs],
                    "unmatched": alone})
    elif out_fmt in ("csv", "md"):
        print(flat(COLUMNS, _rows(pairs), out_fmt))
    else:
        _table(ra, rb, pairs)
        for x in alone:
            console.print(f"[dim]{x}[/]", highlight=False)
    if plot is not None:
        curves = receipt_curves(ra, "A ", 0.6, dash="2 3") + receipt_curves(rb, "B ")
        written = write_profile(curves, plot, "decode throughput against depth: A dotted, B solid",
                                f"A {ra.round_id}, B {rb.round_id} (target {ra.target})")
        (console if out_fmt == "table" else err_console).print(f"plot: {written}", highlight=False)
