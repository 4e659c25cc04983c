"""`scoreboard env`: print this box's environment fingerprint and whether it matches a target's node class."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from .. import environment
from ..errors import ScoreboardError
from ..lockfile import load_lock
from .console import console, print_json


def command(
    target: str = typer.Option(None, "--target", "-t", help="check against this target's node class"),
    lock: Path = typer.Option(Path("reference.lock"), "--lock", help="path to reference.lock"),
    json_out: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """Show the environment fingerprint recorded in receipts (and node-class mismatches for --target)."""
    fp = environment.fingerprint()
    mismatches: list[str] = []
    if target:
        lk = load_lock(lock)
        t = lk.target(target)
        mismatches = environment.node_mismatches(fp, lk.nodes[t.node])
    if json_out:
        print_json({"fingerprint": fp, "node_mismatches": mismatches})
        _refuse(target, mismatches)
        return
    table = Table(title="environment fingerprint", show_header=False)
    cpu, gpu = fp.get("cpu", {}), fp.get("gpu", {})
    table.add_row("cpu", f"{cpu.get('model')} ({cpu.get('arch')}, {cpu.get('cores')} cores)")
    table.add_row("cpu flags", " ".join(cpu.get("flags", [])))
    table.add_row("ram", f"{fp.get('ram_gib')} GiB")
    for i, d in enumerate(gpu.get("devices", [])):
        table.add_row(f"gpu{i}", f"{d.get('name')} {d.get('memory_mib')} MiB, sm {d.get('clock_sm_mhz')} MHz "
                                 f"(max {d.get('clock_sm_max_mhz')}), driver {d.get('driver')}")
    table.add_row("kernel / python", f"{fp.get('kernel')} / {fp.get('python')}")
    table.add_row("packages", ", ".join(f"{k} {v}" for k, v in fp.get("packages", {}).items()))
    h = fp.get("harness", {})
    table.add_row("harness", f"{h.get('commit', '')[:12]}{' (dirty)' if h.get('dirty') else ''}")
    console.print(table)
    if target:
        if mismatches:
            for m in mismatches:
                console.print(f"[red]mismatch[/] {m}")
        else:
            console.print(f"[green]matches[/] node class of {target}")
    _refuse(target, mismatches)


def _refuse(target: str | None, mismatches: list[str]) -> None:
    """A box that is not the target's node class cannot run it: an error (exit 1), as `round run` says."""
    if target and mismatches:
        raise ScoreboardError(f"this box is not of target {target}'s node class ({len(mismatches)} mismatch(es))",
                              "run the target on a box of its node class (see the mismatches above)")
