"""`scoreboard frontier show|lower|rebase|resume`: the slots with provenance, the logged hatches, recovery."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from ..history import frontier as fr
from ..lockfile import load_lock
from ..errors import NonCompliant
from ..history.records import recover
from .console import console, print_json
from .written import ledger_kinds, records_note, written_since

app = typer.Typer(help="Frontier and baseline slots: show them, lower or re-base them (logged), finish an interrupted "
                       "round.", no_args_is_help=True)

_LOCK = typer.Option("reference.lock", "--lock", help="path of reference.lock")
_ROUNDS = typer.Option("rounds", "--rounds", help="directory of receipts and ledger.jsonl")


@app.command("show")
def show(lock: str = _LOCK, json_out: bool = typer.Option(False, "--json", help="machine-readable output")) -> None:
    """Every slot in the lock with its provenance (0 = not measured)."""
    lk = load_lock(lock)
    expected = lk.expected_slots()
    rows: list[dict[str, Any]] = []
    for name in sorted(set(expected) | set(lk.slots)):
        s = lk.slots.get(name)
        tid = expected[name][0] if name in expected else ""
        rows.append({"slot": name, "target": tid, "kind": s.kind if s else "", "value": s.value if s else 0.0,
                     "unit": s.unit if s else "tok/s", "reps": s.reps if s else 0, "round": s.round if s else "",
                     "commit": s.commit if s else "", "measured_at": s.measured_at if s else ""})
    if json_out:
        print_json({"lock": lock, "slots": rows})
        return
    for tid in sorted({r["target"] for r in rows}):
        table = Table(title=f"{lock}: target {tid or '(none)'}", title_justify="left", show_lines=True)
        table.add_column("slot / provenance", overflow="fold")
        table.add_column("kind", no_wrap=True)
        table.add_column("tok/s", justify="right", no_wrap=True)
        for r in (r for r in rows if r["target"] == tid):
            cell, value = r["slot"], "[dim]0 (none)[/]"
            if r["value"]:
                value = f"{r['value']:.4f}" + ("" if r["unit"] == "tok/s" else f" {r['unit']}")
                cell += (f"\n[dim]round {r['round']}, {r['reps']} reps\n"
                         f"commit {r['commit'][:12]}, measured {r['measured_at']}[/]")
            table.add_row(cell, r["kind"], value)
        console.print(table)


@app.command("lower")
def lower(
    target: str = typer.Option(..., "--target", "-t", help="target id in the lock"),
    slot: str = typer.Option(..., "--slot", help="frontier slot name (see `scoreboard frontier show`)"),
    value: float = typer.Option(..., "--value", help="the value the sealed receipt measured for the slot"),
    reason: str = typer.Option(..., "--reason", help="why (a slower replacement box, a real regression on main)"),
    receipt: str = typer.Option(..., "--receipt", help="the sealed main receipt under rounds/ that measured it"),
    lock: str = _LOCK,
    rounds: str = _ROUNDS,
) -> None:
    """Lower a frontier slot: the explicit, reasoned, logged escape hatch (never done by a round)."""
    from ..history import durable
    from .inputs import existing_dir, positive

    existing_dir(rounds, "--rounds")
    positive(value, "--value", "tok/s")
    durable.refuse_unsettled(rounds, lock)  # never log a lowering onto records a git step rolled back
    before = len(ledger_kinds(Path(rounds)))
    change = fr.lower_frontier(lock, slot, value, reason, receipt, rounds_dir=rounds, target=target)
    saved = durable.save(rounds, lock, f"frontier lower {slot}")
    console.print(f"lowered {slot}: {change.before} -> {change.after} tok/s; logged with its reason as a "
                  f"frontier-lower line in {rounds}/ledger.jsonl; records saved: {saved.describe()}", highlight=False)
    _note(written_since(Path(rounds), Path(lock), before, changes=[change]), f"records: {target}: frontier lowered "
          f"({slot} {change.before:g} -> {change.after:g}): {reason.strip()}")


@app.command("rebase")
def rebase(
    target: str = typer.Option(..., "--target", "-t", help="target id in the lock"),
    receipt: str = typer.Option(..., "--receipt", help="the sealed main receipt under rounds/ to re-base to: a round "
                                "scored against the pinned slot because the slot's commit could not be re-measured"),
    reason: str = typer.Option(..., "--reason", help="why (e.g. the frontier commit speaks an older engine contract, "
                               "and this is the box its target is measured on now)"),
    lock: str = _LOCK,
    rounds: str = _ROUNDS,
) -> None:
    """Re-base a frontier whose commit this harness cannot run to what a sealed main round measured (either
    direction; the target's baselines too), logged as a frontier-rebase ledger line; `verify` checks it."""
    from ..history import durable
    from ..history.rebase import rebase_frontier
    from ..round.candidate import remeasure_problem
    from .inputs import existing_dir

    existing_dir(rounds, "--rounds")
    durable.refuse_unsettled(rounds, lock)  # never log a re-base onto records a git step rolled back
    before = len(ledger_kinds(Path(rounds)))
    changes = rebase_frontier(lock, receipt, reason, rounds, target, remeasure_problem)
    saved = durable.save(rounds, lock, f"frontier rebase {target}")
    for c in changes:
        console.print(f"re-based {c.kind} {c.slot}: {c.before:g} -> {c.after:g} tok/s ({c.reps} reps, "
                      f"{c.commit[:12]})", highlight=False)
    console.print(f"logged with its reason as a frontier-rebase line in {rounds}/ledger.jsonl; the next main round "
                  f"re-measures the new frontier's commit in the same round; records saved: {saved.describe()}",
                  highlight=False)
    _note(written_since(Path(rounds), Path(lock), before, changes=changes),
          f"records: {target}: frontier re-based to round {Path(receipt).stem}: {reason.strip()}")


def _note(written, subject: str) -> None:
    for line in records_note(written, subject):
        console.print(line, highlight=False, soft_wrap=True)


@app.command("resume")
def resume(
    receipt: Optional[str] = typer.Option(None, "--receipt", help="receipt of the interrupted round, "
                                          "rounds/<id>.json (default: every receipt the ledger lacks)"),
    lock: Optional[str] = _LOCK,
    rounds: str = _ROUNDS,
) -> None:
    """Restore records a git step lost (from the records ref), then finish a round interrupted after sealing, or
    re-chain every receipt the ledger lost whose place in the chain its seal proves (with the frontier-raise lines
    between them, and every raise an interrupt cut off); the records are saved again."""
    from .inputs import existing_dir

    existing_dir(rounds, "--rounds")
    before = len(ledger_kinds(Path(rounds)))
    rec = recover(rounds, lock or "reference.lock", receipt)
    for line in rec.restored.written:
        console.print(f"restored from the records ref: {line}", highlight=False)
    for line in rec.restored.kept:
        console.print(f"[dim]kept: {line}[/]", highlight=False)
    if rec.resumed is not None:
        done = ", ".join(f"{c.slot} {c.before} -> {c.after}" for c in rec.resumed.changes) or "no slot changes"
        console.print(f"round {rec.resumed.receipt['round_id']}: ledger line present; {done}", highlight=False)
        console.print(f"records saved: {rec.saved.describe()}", highlight=False)
        _note(written_since(Path(rounds), Path(lock) if lock else None, before, changes=rec.resumed.changes),
              f"records: round {rec.resumed.receipt['round_id']} resumed")
        return
    out = rec.rechained
    if out is None:  # recover re-chains whenever no receipt is given
        return
    for line in out.appended:
        console.print(f"appended: {line}", highlight=False)
    for c in out.lock_changes:
        console.print(f"lock: {c.slot} {c.before} -> {c.after}", highlight=False)
    console.print(f"re-chained: {len(out.appended)} ledger line(s) appended, {len(out.lock_changes)} slot(s) "
                  f"written, {len(out.orphaned)} receipt(s) left off", highlight=False)
    console.print(f"records saved: {rec.saved.describe()}", highlight=False)
    if out.appended or out.lock_changes:
        _note(written_since(Path(rounds), Path(lock) if lock else None, before, changes=out.lock_changes),
              f"records: {len(out.appended)} ledger line(s) re-chained")
    if out.orphaned:
        for path, why in out.orphaned:
            console.print(f"[yellow]not re-chained:[/] {path}: {why}", highlight=False)
        raise NonCompliant(f"{len(out.orphaned)} receipt(s) could not be re-chained",
                           f"run `scoreboard verify --lock {lock} --rounds {rounds}` for the full report")
