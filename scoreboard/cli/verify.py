"""`scoreboard verify`: seals, signers, the ledger chain and slot backing; with --base, the policy changes against a
base commit and whether history backs them; exit 2 on any finding."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from ..errors import InputError, NonCompliant
from ..history.seal import PUBLIC_KEY_ENV
from ..history.policy import PolicyReport
from ..history.verify import Problem, Report, verify
from .console import console, print_json


def command(
    lock: str = typer.Option("reference.lock", "--lock", help="path of reference.lock"),
    rounds: str = typer.Option("rounds", "--rounds", help="directory of receipts and ledger.jsonl"),
    public_key: Optional[str] = typer.Option(None, "--public-key", envvar=PUBLIC_KEY_ENV,
                                             help="also require every record to be signed by this Ed25519 key"),
    base: Optional[str] = typer.Option(None, "--base", help="a base commit (a pull request's target, e.g. "
                                       "origin/main): list every policy change against it, and refuse one that "
                                       "history signed by a key pinned there does not back"),
    markdown: Optional[Path] = typer.Option(None, "--markdown", metavar="FILE",
                                            help="with --base: also write the policy report as markdown (CI posts it)"),
    json_out: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """Verify every receipt's seal and signer, the ledger chain, and that every slot is backed by a trusted receipt."""
    if markdown is not None and base is None:
        raise InputError("--markdown needs --base REV", "scoreboard verify --base origin/main --markdown policy.md")
    from .inputs import new_or_existing_dir

    # a misspelled one would read as an empty history (every slot "hand-edited"); a missing one with no near
    # name is a history that never was, and is reported as such
    new_or_existing_dir(rounds, "--rounds")
    report = verify(lock, rounds, public_key)
    policy = None
    if base is not None:
        from ..history.policy import policy_report

        policy = policy_report(base, lock, rounds)
        report.problems += [Problem(f, k, m) for f, k, m in policy.problems]
        if markdown is not None:
            markdown.write_text(_markdown(policy), encoding="utf-8")
    if json_out:
        print_json({**report.as_dict(), "policy": policy.as_dict() if policy else None})
    else:
        _print(report, policy)
    if report.problems:
        raise NonCompliant(f"verify found {len(report.problems)} problem(s)",
                           "restore the named files from git (`git diff -- rounds reference.lock`); slots "
                           "change only through `scoreboard round run`, `scoreboard frontier lower` or `scoreboard frontier rebase`, records only "
                           "as a pinned key seals them (docs/signing.md)")


def _print(report: Report, policy: PolicyReport | None) -> None:
    console.print(f"checked {report.receipts} receipt(s), {report.ledger_lines} ledger line(s), "
                  f"{report.slots_checked} slot(s) in {report.lock}, {report.calibrations} calibration(s); "
                  f"signatures: {escape(report.signatures)}", highlight=False)
    for note in report.notes:
        console.print(f"[dim]note: {escape(note)}[/]", highlight=False)
    if policy is not None:
        console.print(f"[bold]policy changes against {escape(policy.base)} ({policy.commit[:12]}): "
                      f"{len(policy.changes)}[/]", highlight=False)
        if policy.changes:
            table = Table("field", "base", "this tree", title="policy changes (review each)", show_lines=False)
            for c in policy.changes:
                table.add_row(escape(c.field), escape(_short(c.before)), escape(_short(c.after)))
            console.print(table)
        for b in policy.backing:
            console.print(f"  backed: {escape(b)}", highlight=False)
    if report.problems:
        table = Table("file", "field", "problem", title="verify: problems found", show_lines=False)
        for p in report.problems:
            table.add_row(escape(p.file), escape(p.field), escape(p.message))
        console.print(table)
    else:
        console.print("[green]ok[/]: history is intact and every slot is backed", highlight=False)


def _short(v: str, n: int = 90) -> str:
    return v if len(v) <= n else v[: n - 1] + "…"


def _markdown(policy: PolicyReport) -> str:
    out = [f"## Policy changes against `{policy.base}` ({policy.commit[:12]}): {len(policy.changes)}", ""]
    if policy.changes:
        out += ["| field | base | this tree |", "|---|---|---|"]
        out += [f"| `{c.field}` | `{_short(c.before)}` | `{_short(c.after)}` |" for c in policy.changes]
        out.append("")
    out += [f"- backed: {b}" for b in policy.backing]
    if policy.problems:
        out += ["", f"### Not backed: {len(policy.problems)}", ""]
        out += [f"- `{f}`: {k}: {m}" for f, k, m in policy.problems]
    return "\n".join(out) + "\n"
