"""rounds/ledger.jsonl: append-only, hash-chained, one canonical JSON line per recorded event.

Line kinds: ``round`` (every sealed receipt, aborted ones included; changes nothing), ``round-late`` (the
same, for a receipt re-chained after lines sealed later than it: its seal names the earlier line it was
sealed after, its proven place), ``frontier-raise`` (slots a sealed main round raised/replaced; written
before the lock) and ``frontier-lower`` / ``frontier-rebase`` (the logged hatches). ``prev_sha256`` = sha256 of the previous line's bytes
without its newline ("" for line 1).
Appends rewrite the whole file via temp + rename (atomic) and refuse to extend a broken chain.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Any, Iterator, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import InputError, NonCompliant
from ..lockfile import atomic_write_text
from .seal import canonical_bytes, sha256_hex

M = TypeVar("M", bound=BaseModel)

LEDGER_NAME = "ledger.jsonl"
ROUND_KINDS = ("round", "round-late")  # the lines that record a round (exactly one per sealed receipt)


class SlotChange(BaseModel):
    """One slot rewrite in reference.lock: before/after values in the slot's unit."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    slot: str
    kind: Literal["baseline", "frontier"]
    before: float  # 0 = was not measured
    after: float
    reps: int = Field(ge=0)
    commit: str


class LedgerEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["round", "round-late", "frontier-raise", "frontier-lower", "frontier-rebase"]
    round_id: str  # the round whose receipt backs this line
    date: str  # round: the receipt's created_at; frontier-*: when the slots were written (UTC)
    target: str
    status: Literal["verdict", "aborted"]
    candidate_commit: str
    is_main: bool
    verdict: str  # the receipt's verdict.label, or "aborted"
    value: float | None  # the candidate's scored value (tok/s); None without speed numbers
    slot: str  # the scored candidate slot ("" when the receipt has no target table)
    frontier_before: float | None  # that slot before this line (round: as read at round start; None: unknown)
    frontier_after: float | None  # ... and after it (a round line changes nothing: after == before)
    changes: list[SlotChange]  # every slot this line rewrote; [] on round lines
    reason: str  # frontier-lower, frontier-rebase: why; "" for rounds
    receipt_sha256: str  # sha256 of the receipt file's bytes
    seal_sha256: str  # the receipt's seal.sha256
    prev_sha256: str


def ledger_path(rounds_dir: str | os.PathLike[str]) -> Path:
    return Path(rounds_dir) / LEDGER_NAME


def line_bytes(entry: dict[str, Any]) -> bytes:
    return canonical_bytes(entry)


def read_lines(rounds_dir: str | os.PathLike[str]) -> list[bytes]:
    """Raw lines (without newlines); [] when there is no ledger yet."""
    return read_chain_file(ledger_path(rounds_dir))


def read_chain_file(p: Path) -> list[bytes]:
    """The raw lines of a hash-chained JSONL file (the ledger, the calibration chain); [] when absent."""
    if not p.exists():
        return []
    data = p.read_bytes()
    if data and not data.endswith(b"\n"):
        raise NonCompliant(f"{p}: last line has no newline (truncated write or hand edit)",
                           "run `scoreboard verify` for the full report")
    return data.split(b"\n")[:-1] if data else []


def read_chain_for_report(p: Path) -> tuple[list[bytes], str | None]:
    """A chain file's raw lines for a full report: (lines, the file-level problem or None). A last line without
    its newline is a problem, but is still returned as a line, so it is checked like every other."""
    try:
        return read_chain_file(p), None
    except NonCompliant as exc:
        return p.read_bytes().split(b"\n"), exc.message


def valid_lines(lines: list[bytes], model: type[M]) -> Iterator[tuple[int, M]]:
    """(line number, parsed line) for each line that parses as `model`; the rest are chain_problems' to report."""
    import json

    for n, raw in enumerate(lines, start=1):
        try:
            yield n, model.model_validate(json.loads(raw))
        except ValueError:
            continue


def chain_problems(lines: list[bytes], model: type[BaseModel] | None = None) -> list[tuple[int, str, str]]:
    """Structural problems as (line number, field, message): parse, schema (`model`, the ledger's line by
    default), canonical form, chain. Shared by every hash-chained JSONL file the history keeps."""
    import json

    schema = LedgerEntry if model is None else model
    problems: list[tuple[int, str, str]] = []
    prev = ""
    for i, raw in enumerate(lines, start=1):
        try:
            obj = json.loads(raw)
        except ValueError as exc:
            problems.append((i, "<line>", f"not JSON ({exc})"))
            prev = sha256_hex(raw)
            continue
        try:
            schema.model_validate(obj)
        except ValidationError as exc:
            for err in exc.errors():
                problems.append((i, ".".join(map(str, err["loc"])) or "<line>", err["msg"]))
        if isinstance(obj, dict):
            if line_bytes(obj) != raw:
                problems.append((i, "<line>", "not in canonical form (edited by hand)"))
            if obj.get("prev_sha256") != prev:
                problems.append((i, "prev_sha256", f"{str(obj.get('prev_sha256'))[:12]}… is not the hash of "
                                 f"line {i - 1 if i > 1 else '(none)'} ({prev[:12] or 'empty'}…): a line was "
                                 "deleted, inserted, reordered or edited"))
        prev = sha256_hex(raw)
    return problems


def _format(problems: list[tuple[int, str, str]], where: str) -> str:
    return "\n".join(f"  {where}:{n}: {field}: {msg}" for n, field, msg in problems)


def read_entries(rounds_dir: str | os.PathLike[str]) -> list[LedgerEntry]:
    """The ledger's entries; NonCompliant if the chain is broken (use chain_problems for a report)."""
    import json

    lines = read_lines(rounds_dir)
    problems = chain_problems(lines)
    if problems:
        raise NonCompliant("ledger chain is broken:\n" + _format(problems, str(ledger_path(rounds_dir))),
                           "run `scoreboard verify`; never extend a tampered ledger")
    return [LedgerEntry.model_validate(json.loads(raw)) for raw in lines]


def read_ledger(rounds_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The ledger as plain dicts, oldest first ([] when there is none); NonCompliant if broken."""
    return [e.model_dump(mode="json") for e in read_entries(rounds_dir)]


def is_round(e: LedgerEntry) -> bool:
    """Whether the line records a round (``round`` or ``round-late``)."""
    return e.kind in ROUND_KINDS


def last_changes(entries: list[LedgerEntry]) -> dict[str, tuple[LedgerEntry, SlotChange]]:
    """Slot name -> the ledger line and change that last wrote it."""
    out: dict[str, tuple[LedgerEntry, SlotChange]] = {}
    for e in entries:
        for c in e.changes:
            out[c.slot] = (e, c)
    return out


def head_sha256(rounds_dir: str | os.PathLike[str]) -> str:
    """sha256 of the last line ("" when empty): what the next receipt's seal chains to."""
    lines = read_lines(rounds_dir)
    return sha256_hex(lines[-1]) if lines else ""


def append(rounds_dir: str | os.PathLike[str], entry: dict[str, Any]) -> LedgerEntry:
    """Append one line (prev_sha256 filled in), atomically; refuses a broken chain or a bad entry."""
    lines = read_lines(rounds_dir)
    problems = chain_problems(lines)
    if problems:
        raise NonCompliant("refusing to extend a broken ledger:\n" + _format(problems, str(ledger_path(rounds_dir))),
                           "run `scoreboard verify` and restore rounds/ledger.jsonl from git")
    full = {**entry, "prev_sha256": sha256_hex(lines[-1]) if lines else ""}
    try:
        model = LedgerEntry.model_validate(full)
    except ValidationError as exc:
        raise InputError(f"bad ledger entry: {exc}") from None
    new = line_bytes(model.model_dump(mode="json"))
    text = b"".join(raw + b"\n" for raw in [*lines, new]).decode("utf-8")
    Path(rounds_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_text(ledger_path(rounds_dir), text)
    return model


@contextlib.contextmanager
def exclusive(rounds_dir: str | os.PathLike[str]) -> Iterator[None]:
    """Serialize writers of rounds/ (seal -> ledger -> lock): an advisory flock on the directory itself."""
    d = Path(rounds_dir)
    d.mkdir(parents=True, exist_ok=True)
    fd = os.open(d, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock
