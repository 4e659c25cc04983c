"""`scoreboard records status|restore`: the records' durable copy (a git ref) against the working tree."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape

from ..errors import NonCompliant
from .console import console, print_json

app = typer.Typer(help="The records' durable copy, refs/scoreboard/records: compare the working tree's rounds/ and "
                       "lock slots with it, restore what a git step lost (docs/nothing-lost.md).", no_args_is_help=True)

_LOCK = typer.Option(Path("reference.lock"), "--lock", help="path of reference.lock")
_ROUNDS = typer.Option(Path("rounds"), "--rounds", help="directory of receipts and ledger.jsonl")


@app.command("status")
def status(lock: Path = _LOCK, rounds: Path = _ROUNDS,
           json_out: bool = typer.Option(False, "--json", help="machine-readable output")) -> None:
    """Where the records were last saved, and how the working tree differs from it (exit 2 when it does)."""
    from ..history import durable

    store = durable.locate(rounds)
    tip = store.tip() if store.git_dir.exists() else None
    diff = durable.differences(rounds, lock)
    if json_out:
        print_json({"store": str(store.git_dir), "ref": store.ref, "tip": tip, "differences": diff})
    elif tip is None:
        console.print(f"no records saved yet in {escape(store.describe())} (the next sealed round saves them)",
                      highlight=False)
    else:
        console.print(f"records last saved: {escape(store.describe())} at {tip[:12]}", highlight=False)
        for d in diff:
            console.print(f"  differs: {escape(d)}", highlight=False)
        if not diff:
            console.print("[green]ok[/]: the working tree holds exactly the saved records", highlight=False)
    if diff:
        raise NonCompliant(f"{len(diff)} record(s) differ from {store.describe()}",
                           f"`scoreboard frontier resume --lock {lock} --rounds {rounds}` restores and re-chains them")


@app.command("restore")
def restore(lock: Path = _LOCK, rounds: Path = _ROUNDS) -> None:
    """Write back every record the working tree lost or changed since they were saved (nothing else is touched)."""
    from ..history import durable

    out = durable.restore(rounds, lock)
    for line in out.written:
        console.print(f"restored: {escape(line)}", highlight=False)
    for line in out.kept:
        console.print(f"[dim]kept: {escape(line)}[/]", highlight=False)
    console.print(f"{len(out.written)} file(s) restored from {escape(durable.locate(rounds).describe())}; next: "
                  f"`scoreboard frontier resume --lock {lock} --rounds {rounds}` chains them and brings the lock's "
                  "slots to the ledger", highlight=False)
