"""`scoreboard verify`: seals, signatures, the ledger chain and slot backing; exit 2 on any finding."""

from __future__ import annotations

from typing import Optional

import typer
from rich.table import Table

from ..errors import NonCompliant
from ..history.seal import PUBLIC_KEY_ENV
from ..history.verify import verify
from .console import console, print_json


def command(
    lock: str = typer.Option("reference.lock", "--lock", help="path of reference.lock"),
    rounds: str = typer.Option("rounds", "--rounds", help="directory of receipts and ledger.jsonl"),
    public_key: Optional[str] = typer.Option(None, "--public-key", envvar=PUBLIC_KEY_ENV,
                                             help="Ed25519 public key (PEM) every receipt must be signed by"),
    json_out: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """Verify every receipt's seal, the ledger chain, and that every slot is backed by a sealed receipt."""
    from .inputs import new_or_existing_dir

    # a misspelled one would read as an empty history (every slot "hand-edited"); a missing one with no near
    # name is a history that never was, and is reported as such
    new_or_existing_dir(rounds, "--rounds")
    report = verify(lock, rounds, public_key)
    if json_out:
        print_json(report.as_dict())
    else:
        console.print(f"checked {report.receipts} receipt(s), {report.ledger_lines} ledger line(s), "
                      f"{report.slots_checked} slot(s) in {report.lock}, {report.calibrations} calibration(s); "
                      f"signatures: {report.signatures}",
                      highlight=False)
        if report.problems:
            table = Table("file", "field", "problem", title="verify: problems found", show_lines=False)
            for p in report.problems:
                table.add_row(p.file, p.field, p.message)
            console.print(table)
        else:
            console.print("[green]ok[/]: history is intact and every slot is backed")
    if report.problems:
        raise NonCompliant(f"verify found {len(report.problems)} problem(s)",
                           "restore the named files from git (`git diff -- rounds reference.lock`); slots "
                           "change only through `scoreboard round run`, `scoreboard frontier lower` or `scoreboard frontier rebase`")
