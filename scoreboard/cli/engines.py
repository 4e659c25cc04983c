"""`scoreboard engines`: the registered engine plugins, each checked in a fresh interpreter."""

from __future__ import annotations

import typer
from rich.table import Table

from .. import probe, registry
from .console import console, err_console, print_json

FIX = ("reinstall the plugin (`pip install -e PATH` or `pip install PACKAGE`) or fix the entry point it declares "
       "under [project.entry-points.\"scoreboard.engines\"], then run `scoreboard engines` again")


def command(json_out: bool = typer.Option(False, "--json", help="machine-readable output")) -> None:
    """List registered engines (entry point group scoreboard.engines): each imported, resolved and instantiated
    in its own interpreter, with the distribution that registers it. Exit 1 when one is broken."""
    found = registry.registered()
    specs = [r for r in found if r.spec]
    checks = {c.name: c for c in probe.check_entries([(r.name, r.spec) for r in specs])}
    rows = []
    for r in found:
        c = checks.get(r.name)
        rows.append({"name": r.name, "entry_point": r.spec or "(factory)", "distribution": r.distribution,
                     "version": r.version, "ok": c.ok if c else True, "error": c.error if c else "",
                     "engine_class": c.engine_class if c else ""})
    broken = [row for row in rows if not row["ok"]]
    if json_out:
        print_json({"engines": rows})
    else:
        _table(rows)
    if broken:
        for row in broken:
            err_console.print(f"[bold red]broken[/] {row['name']} ({row['entry_point']}, from "
                              f"{row['distribution'] or 'an unknown distribution'}): {row['error']}", highlight=False)
        err_console.print(f"next: {FIX}", highlight=False)
        raise typer.Exit(1)


def _table(rows: list[dict]) -> None:
    t = Table(title="engines (entry point group scoreboard.engines), each checked in a fresh interpreter")
    for col in ("engine", "entry point", "distribution", "version", "status"):
        t.add_column(col, overflow="fold")
    for row in rows:
        t.add_row(row["name"], row["entry_point"], row["distribution"], row["version"],
                  "[green]ok[/]" if row["ok"] else "[red]broken[/]")
    console.print(t)
