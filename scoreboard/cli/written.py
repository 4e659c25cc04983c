"""Where a command's records went (receipt, ledger lines, lock slots) and the one command that keeps them.

Every command that writes history (`round run`, `frontier lower|rebase|resume`) ends with `records_note`: the
records are plain files in the checkout until someone commits them, and a CI job that exits on the round's
verdict must still keep them. One function, so that a new place the records go is named everywhere at once.
"""

from __future__ import annotations

import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ..history.ledger import SlotChange


@dataclass(frozen=True)
class Written:
    """What one command wrote: its receipt (if any), the ledger lines it appended, the lock slots it changed."""

    rounds: Path
    lock: Path | None
    receipt: Path | None = None
    ledger_lines: tuple[str, ...] = ()  # the kinds of the lines appended, in order ("round", "frontier-raise", ...)
    changes: tuple[SlotChange, ...] = field(default_factory=tuple)


def ledger_kinds(rounds: Path) -> list[str]:
    """Every ledger line's kind, oldest first ([] without a ledger, or when it does not parse: verify reports it)."""
    import json

    from ..errors import ScoreboardError
    from ..history import ledger

    try:
        return [str(json.loads(raw).get("kind", "?")) for raw in ledger.read_lines(rounds)]
    except (ScoreboardError, ValueError, AttributeError):
        return []


def written_since(rounds: Path, lock: Path | None, before: int, receipt: Path | None = None,
                  changes: Sequence[SlotChange] = ()) -> Written:
    """`Written` for a command that found `before` ledger lines when it started."""
    return Written(rounds, lock, receipt, tuple(ledger_kinds(rounds)[before:]), tuple(changes))


def _git_top(path: Path) -> Path | None:
    out = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=path, capture_output=True, text=True)
    return Path(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip() else None


def records_note(w: Written, subject: str) -> list[str]:
    """Lines saying where the records are and the git command that commits them (`subject`: its message)."""
    if not w.receipt and not w.ledger_lines and not w.changes:
        return ["records: nothing written (no receipt, no ledger line, no slot changed)"]
    ledger_path = w.rounds / "ledger.jsonl"
    parts = []
    if w.receipt:
        parts.append(f"receipt {w.receipt} (sealed, write-once)")
    if w.ledger_lines:
        parts.append(f"ledger {ledger_path} (+{len(w.ledger_lines)} line(s): {', '.join(w.ledger_lines)})")
    if w.changes and w.lock is not None:
        moved = ", ".join(f"{c.slot} {c.before:g} -> {c.after:g}" for c in w.changes)
        parts.append(f"lock {w.lock} ({len(w.changes)} slot(s): {moved})")
    out = ["records: " + "; ".join(parts)]
    paths = [p for p in (w.receipt, ledger_path if w.ledger_lines else None,
                         w.lock if w.changes else None) if p is not None]
    top = _git_top(w.rounds.resolve() if w.rounds.is_dir() else Path.cwd())
    if top is None:
        out.append(f"next: {w.rounds} is not in a git checkout: copy these files into the repository's rounds/ "
                   "(and reference.lock) and commit them there; until then they are no shared history")
        return out
    rel = []
    for p in paths:
        try:
            rel.append(str(p.resolve().relative_to(top)))
        except ValueError:
            rel.append(str(p.resolve()))
    files = " ".join(shlex.quote(r) for r in rel)
    repo = shlex.quote(str(top))
    out.append(f"next (commit them: records not committed are lost with this checkout): git -C {repo} add -- "
               f"{files} && git -C {repo} commit -m {shlex.quote(subject)} -- {files}")
    return out
