"""`scoreboard tier`: re-derive a receipt's verdict from its raw samples, or label a claimed number."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ..errors import InputError
from ..history.receipt import Receipt
from ..lockfile import DEFAULT_LOCK, Target, load_lock
from ..tiers import ESTIMATOR, POOLED_MEDIAN, Verdict, receipt_target, score_claim, summarize_speed, verdict_from_receipt
from .console import console, print_json

_STYLE = {"REJECT": "bold red", "regression": "bold red", "inconclusive": "yellow", "none": "white",
          "BASELINE": "cyan"}


def _show(v: Verdict) -> None:
    style = _STYLE.get(v.label, "bold green")
    tag = " (claim)" if v.claim else ""
    console.print(f"[{style}]{v.label}[/]{tag}", highlight=False)
    console.print(v.explanation, highlight=False)
    for r in v.reasons:
        console.print(f"  - {r}", highlight=False)


def _speed_table(receipt: Receipt, target: Target) -> None:
    for s in summarize_speed(receipt, target):
        table = Table(title=f"{s.name} ({s.role})", title_justify="left")
        for col in ("arm", f"value tok/s ({ESTIMATOR})", POOLED_MEDIAN, "MAD", "CV", "reps"):
            table.add_column(col, justify="left" if col == "arm" else "right")
        for arm, a in s.arms.items():
            table.add_row(arm, f"{a.value:.4g}", f"{a.median:.4g}", f"{a.mad:.3g}", f"{a.cv * 100:.2f}%", str(a.n))
        console.print(table)
        if s.vs_reference is not None:
            r = s.vs_reference
            console.print(f"  candidate/reference (same round, paired blocks) {r.point:.4f} ({r.confidence * 100:.0f}% CI {r.low:.4f}-{r.high:.4f},"
                          f" {r.n_blocks} blocks)", highlight=False)


def command(
    receipt: Optional[Path] = typer.Option(None, "--receipt", help="a round receipt (rounds/<round_id>.json)"),
    claim: Optional[float] = typer.Option(None, "--claim", help="a claimed value (tok/s) to label as a claim"),
    target: Optional[str] = typer.Option(None, "--target", "-t", help="target id (with --claim)"),
    metric: str = typer.Option("scored", "--metric", help="with --claim: `scored`, `phase@depth` or a slot name"),
    lock: Optional[Path] = typer.Option(None, "--lock", help="score with this lock's current policy and judge "
                                        "the receipt's signer by its pins (default: the policy recorded in the "
                                        "receipt, the pins of this checkout's reference.lock, never one that merely "
                                        "lies beside the receipt; --claim reads reference.lock)"),
    json_out: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """Score a receipt (recomputed from raw samples) or a claimed number against the frontier. Exit 2 on REJECT
    or regression."""
    from rich.markup import escape

    from ..history.sealed import read_sealed
    from ..history.trust import near
    from .inputs import judging_lock

    if (receipt is None) == (claim is None):
        raise InputError("pass exactly one of --receipt FILE or --claim VALUE",
                         "scoreboard tier --receipt rounds/<id>.json  |  scoreboard tier --claim 12.3 --target T")
    out: dict[str, object]
    if claim is not None:
        if not target:
            raise InputError("--claim needs --target", "scoreboard tier --claim VALUE --target <target id>")
        verdict = score_claim(claim, load_lock(lock or DEFAULT_LOCK), target, metric)
        out = {"verdict": verdict.as_dict(), "policy": "lock"}
    elif receipt is not None:
        # an unknown major is not ours to judge (exit 1); an edited or unsealed receipt is never scored as
        # if measured (exit 2); one no pinned key vouches for is scored as a claim, said so, exit 2
        sealed = read_sealed(receipt)
        r = sealed.receipt
        judging_lock(lock, "the receipt")
        standing = near(receipt.parent, lock).standing(sealed.raw, "round")  # --lock, else this checkout's pins
        tgt = load_lock(lock).target(r.target) if lock is not None else receipt_target(r)
        verdict = verdict_from_receipt(r, tgt)
        recorded = r.verdict.label if r.verdict else None
        out = {"verdict": verdict.as_dict(), "policy": "lock" if lock else "receipt", "trusted": standing.trusted,
               "sealed_by": standing.describe(),
               "recorded_label": recorded, "matches_recorded": None if recorded is None else recorded == verdict.label}
    if json_out:
        print_json(out)
    else:
        if receipt is not None and not out["trusted"]:
            console.print(f"[bold red]UNTRUSTED receipt[/]: {escape(str(out['sealed_by']))}; the label below is "
                          "recomputed from a claim, not from a measurement", highlight=False)
        if receipt is not None:
            _speed_table(r, tgt)
        _show(verdict)
        if receipt is not None and out["matches_recorded"] is False:
            console.print(f"[yellow]note:[/] the receipt records {out['recorded_label']!r}; recomputed "
                          f"{verdict.label!r} under the {out['policy']} policy", highlight=False)
    if not verdict.compliant or out.get("trusted") is False:
        raise typer.Exit(2)
