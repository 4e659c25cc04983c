"""`scoreboard fit <target>`: the per-rank memory budget as a table; refuses what does not fit or would offload."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from ..fit import check_fit, fit_budget
from ..lockfile import load_lock
from .console import console, pick_target, print_json


def command(
    target_arg: str = typer.Argument(None, metavar="[TARGET]", help="deprecated positional form of --target"),
    target: str = typer.Option(None, "--target", "-t", help="target id in the lock, e.g. kimi-k3-h200x8-iq1s"),
    ctx: int = typer.Option(0, "--ctx", help="price the KV cache at this many tokens (default: the target's n_ctx)"),
    ranks: int = typer.Option(None, "--ranks", help="what-if: number of ranks (default: devices present, else node)"),
    usable_gib: float = typer.Option(None, "--usable-gib", help="what-if: usable GiB per rank"),
    node_class: bool = typer.Option(False, "--node-class",
                                    help="price against the lock's node class, not the devices present"),
    dir: Path = typer.Option(None, "--dir", help="weights directory: read the architecture from the GGUF header"),
    lock: str = typer.Option("reference.lock", "--lock", help="path of reference.lock"),
    json_out: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """Per-rank memory budget: weights (sharded + replicated), KV at the context, KDA state, scratch."""
    from .inputs import positive

    target = pick_target(target, target_arg, "fit")
    positive(ctx, "--ctx", "tokens", zero_means="the target's n_ctx")
    positive(ranks, "--ranks", "ranks")
    positive(usable_gib, "--usable-gib", "GiB per rank")
    rep = fit_budget(load_lock(lock), target, n_ctx=ctx or None, ranks=ranks, usable_gib=usable_gib,
                     detect=not node_class, weights_dir=dir)
    if json_out:
        print_json(rep.as_dict())
    else:
        table = Table(title=f"{target}: per-rank budget, {rep.ranks} rank(s), n_ctx {rep.n_ctx:,}")
        table.add_column("item")
        table.add_column("GiB / rank", justify="right")
        table.add_column("how")
        for line in rep.lines:
            table.add_row(line.item, f"{line.gib:,.2f}", line.detail)
        table.add_section()
        table.add_row("total", f"{rep.need_gib:,.2f}", "")
        table.add_row(f"usable per {rep.device_kind}", f"{rep.usable_gib:,.2f}", rep.usable_source)
        table.add_row("headroom", f"{rep.headroom_gib:,.2f}", "fits" if rep.fits else "DOES NOT FIT")
        console.print(table)
    check_fit(rep)
