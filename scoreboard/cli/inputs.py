"""Options checked before a command reads or writes anything: directories, sizes and target ids, each
refused with the option's name, the value, the near match when there is one, and the fix (InputError, exit 1).

A misspelled `--rounds` must not read as an empty history (every slot "hand-edited"), nor a misspelled
`--target` as a target with no rounds yet ("no frontier has moved yet", an empty report).
"""

from __future__ import annotations

import difflib
import math
from pathlib import Path
from typing import Iterable

from ..errors import InputError


def _near(word: str, choices: Iterable[str]) -> str | None:
    close = difflib.get_close_matches(word, sorted(set(choices)), n=1, cutoff=0.6)
    return close[0] if close else None


def judging_lock(lock: Path | None, judged: str = "the receipts") -> None:
    """A --lock the caller named that is not a file is their typo (InputError naming the option), never a reason to
    read the records as untrusted; None (no --lock) passes."""
    if lock is not None and not lock.is_file():
        raise InputError(f"--lock {lock}: lock file not found",
                         f"pass the reference.lock whose signers judge {judged}, or leave --lock out")


def existing_dir(path: str | Path, option: str) -> Path:
    """`path` when it is a directory; else InputError naming `option`, and the sibling directory it was
    probably meant to be."""
    p = Path(path)
    if p.is_dir():
        return p
    parent = p.parent if str(p.parent) else Path(".")
    siblings = [d.name for d in parent.iterdir() if d.is_dir()] if parent.is_dir() else []
    near = _near(p.name, siblings)
    what = "is a file, not a directory" if p.exists() else "directory not found"
    hint = (f"did you mean {option} {parent / near if str(parent) != '.' else near}?" if near else
            f"pass {option} DIR, the directory holding the receipts and ledger.jsonl (run from the repository "
            "root for the default)")
    raise InputError(f"{option} {path}: {what}", hint)


def new_or_existing_dir(path: str | Path, option: str) -> Path:
    """`path` for a command that may create it or read its absence (`round run --rounds` on a fresh history,
    `verify` of a lock with no history): refused only when it does not exist and a sibling directory with a near
    name does (`--rounds roundz` beside `rounds`), so a typo is not taken for a new, empty history."""
    p = Path(path)
    if p.exists():
        return existing_dir(p, option)
    parent = p.parent if str(p.parent) else Path(".")
    near = _near(p.name, [d.name for d in parent.iterdir() if d.is_dir()] if parent.is_dir() else [])
    if near:
        raise InputError(f"{option} {path}: directory not found, and {parent / near} is",
                         f"did you mean {option} {parent / near if str(parent) != '.' else near}? (for a new history "
                         f"create it first: mkdir {path})")
    return p


def positive(value: float | int | None, option: str, unit: str, zero_means: str | None = None) -> None:
    """Refuse a negative (or, without `zero_means`, a zero) size. `zero_means`: what 0 stands for, if allowed."""
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise InputError(f"{option} {value}: must be a finite number of {unit}", f"pass {option} as a number")
    if value < 0 or (value == 0 and zero_means is None):
        least = "0 or more" if zero_means is not None else "a positive number"
        tail = f" (0: {zero_means})" if zero_means is not None else ""
        raise InputError(f"{option} {value}: a size cannot be {'negative' if value < 0 else 'zero'}; it is "
                         f"{least} of {unit}{tail}", f"pass {option} with {least}, or omit it for the default")


def known_target(target: str | None, lock: str | Path | None, rounds: str | Path | None = None) -> None:
    """Refuse a `--target` that neither the lock nor the ledger knows, with the near match among both."""
    if not target:
        return
    known: set[str] = set()
    lp = Path(lock) if lock is not None else None
    if lp is not None and lp.is_file():
        from ..lockfile import load_lock

        known |= set(load_lock(lp).targets)
    if rounds is not None:
        known |= _ledger_targets(Path(rounds))
    if target in known or not known:
        return
    near = _near(target, known)
    raise InputError(f"--target {target}: no such target in {lp if lp is not None and lp.is_file() else 'the lock'}"
                     f"{' or in ' + str(Path(rounds) / 'ledger.jsonl') if rounds is not None else ''}",
                     f"did you mean --target {near}?" if near else f"targets: {', '.join(sorted(known))}")


def _ledger_targets(rounds: Path) -> set[str]:
    import json

    from ..errors import ScoreboardError
    from ..history import ledger

    try:
        return {str(json.loads(raw).get("target", "")) for raw in ledger.read_lines(rounds)} - {""}
    except (ScoreboardError, ValueError, AttributeError):
        return set()


def receipt_path(ref: str, rounds: str | Path, option: str = "ID") -> Path:
    """A receipt named by `ref`: a path to a .json file, a round id under `rounds`, or a unique part of one."""
    if ref.endswith(".json"):
        p = Path(ref)
        if not p.is_file():
            raise InputError(f"{option} {ref}: receipt not found", "receipts live in rounds/<round_id>.json")
        return p
    d = Path(rounds)
    p = d / f"{ref}.json"
    if p.is_file():
        return p
    existing_dir(d, "--rounds")
    matches = sorted(x for x in d.glob(f"*{ref}*.json") if not x.name.startswith("."))
    if len(matches) == 1:
        return matches[0]
    if not matches:
        near = _near(ref, [x.stem for x in d.glob("*.json")])
        raise InputError(f"no receipt {ref!r} in {d}/", f"did you mean {near}?" if near else f"list them with `ls {d}/`")
    raise InputError(f"{ref!r} matches {len(matches)} receipts in {d}/: "
                     + ", ".join(x.stem for x in matches[:4]) + (" ..." if len(matches) > 4 else ""),
                     "pass more of the round id")
