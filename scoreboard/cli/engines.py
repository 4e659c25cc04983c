"""`scoreboard engines`: list the registered engine plugins."""

from __future__ import annotations

import typer

from .. import registry
from .console import console, print_json


def command(json_out: bool = typer.Option(False, "--json", help="machine-readable output")) -> None:
    """List registered engines (entry point group scoreboard.engines)."""
    names = registry.available()
    if json_out:
        print_json({"engines": names})
        return
    for n in names:
        console.print(n)
