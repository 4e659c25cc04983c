"""`scoreboard report`: the history as one self-contained static HTML page (link it from a PR)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..errors import InputError, NonCompliant
from ..lockfile import atomic_write_text
from .console import console, print_json


def command(
    out: Path = typer.Option(Path("scoreboard-report.html"), "--out", "-o", metavar="FILE",
                             help="HTML file to write (atomically)"),
    rounds: Path = typer.Option(Path("rounds"), "--rounds", help="receipts + ledger directory"),
    lock: Optional[Path] = typer.Option(None, "--lock", help="the pinned signers the receipts are judged by; "
                                        "`verify` also runs against it. Default: this checkout's reference.lock "
                                        "(./reference.lock or the working tree's root), never one that merely lies "
                                        "beside the receipts"),
    target: Optional[str] = typer.Option(None, "--target", "-t", help="only this target"),
    json_out: bool = typer.Option(False, "--json", help="print a summary as JSON instead of a sentence"),
) -> None:
    """Static HTML report: receipts verified, the ladder per slot, every round's gate, samples and verdict.

    Exit 2 when a receipt does not match its seal or `verify` finds a problem (the page still shows it)."""
    from ..history.sealed import untrusted_hint
    from ..history.trust import own_lock
    from ..report import build_report

    if not out.parent.is_dir():
        raise InputError(f"--out {out}: directory {out.parent} not found", "create it or pick another path")
    from .inputs import existing_dir, judging_lock, known_target

    existing_dir(rounds, "--rounds")
    judging_lock(lock)
    lock = lock if lock is not None else own_lock()  # never a lock that only lies beside the receipts
    known_target(target, lock, rounds)  # a misspelled one would write an empty report
    rep = build_report(rounds, lock, target)
    atomic_write_text(out, rep.html, mode=0o644)  # a page to publish: readable by the web server, like any file
    bad = [r.path.name for r in rep.unverified]
    if json_out:
        print_json({"out": str(out), "rounds": len(rep.rounds), "steps": len(rep.steps), "unverified": bad,
                    "verify_problems": rep.verify_problems})
    else:
        console.print(f"wrote {out}: {len(rep.rounds)} round(s), {len(rep.steps)} ladder step(s), "
                      f"{len(rep.rounds) - len(bad)} receipt(s) verified", highlight=False)
    if bad or rep.verify_problems:
        raise NonCompliant(f"{len(bad)} receipt(s) do not match their seal, or no pinned key vouches for them "
                           f"({', '.join(bad) or 'none'}); verify: "
                           f"{len(rep.verify_problems)} problem(s) — the page marks them",
                           untrusted_hint(rep.trust) if rep.trust.next_step() and any(
                               r.seal == "UNTRUSTED" for r in rep.unverified) else
                           "run `scoreboard verify` and restore the named files from git")
