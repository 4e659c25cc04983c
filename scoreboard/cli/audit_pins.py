"""`scoreboard audit-pins`: check every external pin in reference.lock without downloading weights."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ..errors import InputError, NonCompliant, ScoreboardError
from ..lockfile import atomic_write_text, load_lock
from .console import console, print_json


def command(
    target: Optional[List[str]] = typer.Option(None, "--target", "-t", help="audit this target's pins (repeatable)"),
    all_: bool = typer.Option(False, "--all", help="audit every pin in the lock and the CI workflows (the default)"),
    json_out: bool = typer.Option(False, "--json", help="machine-readable findings on stdout"),
    markdown: Optional[Path] = typer.Option(None, "--markdown", metavar="FILE",
                                            help="also write the markdown report to FILE (atomically)"),
    lock: Path = typer.Option(Path("reference.lock"), "--lock", help="the lock to audit"),
    timeout: float = typer.Option(30.0, "--timeout", min=0.1, help="seconds per network request"),
    hub_endpoint: Optional[str] = typer.Option(None, "--hub-endpoint", metavar="URL",
                                               help="Hugging Face endpoint (default: $SCOREBOARD_HF_ENDPOINT, "
                                                    "else huggingface.co)"),
    repo_root: Optional[Path] = typer.Option(None, "--repo-root", metavar="DIR",
                                             help="where .github/workflows is (default: the lock's directory)"),
) -> None:
    """Check every external pin (git refs, Hub weights, PyPI sdists, CI actions): exit 0 clean, 2 drift, 1 error.

    A network or API failure is an error (exit 1), never drift; when both occur the exit code is 1.
    """
    from ..pins.audit import audit
    from ..pins.report import render_markdown, render_text

    if target and all_:
        raise InputError("--target and --all are exclusive", "pass one or the other")
    if markdown is not None and not markdown.parent.is_dir():
        raise InputError(f"{markdown.parent}: directory not found (for --markdown)", "create it or pick another path")
    lk = load_lock(lock)
    report = audit(lk, lock_path=lock, targets=list(target) if target else None, timeout=timeout,
                   hub_endpoint=hub_endpoint, workflows_root=repo_root or lock.resolve().parent)
    if markdown is not None:
        atomic_write_text(markdown, render_markdown(report))
    if json_out:
        print_json(report.to_dict())
    else:
        console.print(render_text(report), highlight=False, markup=False, soft_wrap=True)
    c = report.counts()
    if report.exit_code == 1:
        raise ScoreboardError(f"pin audit incomplete: {c['error']} check(s) could not complete (network/API); "
                              f"that is not drift" + (f" ({c['drift']} drift also observed)" if c["drift"] else ""),
                              "re-run `scoreboard audit-pins`; see each error's `next:` line")
    if report.exit_code == 2:
        raise NonCompliant(f"pin drift: {c['drift']} finding(s); a baseline measured against the old state is no "
                           f"longer reproducible", "review each finding, re-pin deliberately, re-measure "
                           "(docs/audit-pins.md)")
