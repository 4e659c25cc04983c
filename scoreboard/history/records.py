"""Receipts on disk: seal + write-once `rounds/<round_id>.json` + its ``round`` ledger line; read back;
record a whole round (receipt, ledger, frontier) and finish one that was interrupted.

Order and crash safety: the sealed receipt is written first (temp file + fsync + link(2), so an
existing file is never replaced), then its ``round`` ledger line (whole-file temp + rename); slot
changes follow in `frontier.raise_frontier` (a ``frontier-raise`` line, then the lock). An
interruption leaves no receipt, a receipt without its ledger line, or a ledger line whose slot
changes the lock lacks; `scoreboard verify` names each and `resume_round`
(`scoreboard frontier resume --receipt FILE`) finishes it.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from . import frontier, ledger
from ..errors import InputError, NonCompliant
from .ledger import LedgerEntry, SlotChange
from .receipt import Receipt, normalize, parse_receipt, scored_metric
from .seal import load_private_key, make_seal, sha256_hex

if TYPE_CHECKING:
    from .durable import Restored, Saved
    from .rechain import Rechained

DEFAULT_ROUNDS = "rounds"


@dataclass
class Recorded:
    path: Path
    receipt: dict[str, Any]  # as sealed and written
    changes: list[SlotChange] = field(default_factory=list)  # slots written to the lock


def receipt_path(rounds_dir: str | os.PathLike[str], round_id: str) -> Path:
    return Path(rounds_dir) / f"{round_id}.json"


def file_bytes(receipt: Mapping[str, Any]) -> bytes:
    """On-disk form: sorted, indented, UTF-8, trailing newline (the seal is over canonical bytes)."""
    return (json.dumps(receipt, indent=1, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n").encode()


def _write_once(path: Path, data: bytes) -> None:
    """Temp file + fsync + link(2): atomic, and fails instead of replacing an existing file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise InputError(f"{path}: already exists; receipts are write-once",
                             "a round id is never reused; start a new round") from None
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    finally:
        os.unlink(tmp)


def _seal_and_write(receipt: Mapping[str, Any], rounds_dir: str | os.PathLike[str], prev_ledger_sha256: str,
                    private_key: Any) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """Seal and write once; returns (path, sealed receipt, its round ledger entry), the entry built
    and validated BEFORE the file is written so a bad receipt leaves nothing behind."""
    if receipt.get("seal") is not None:
        raise InputError(f"receipt {receipt.get('round_id')}: already sealed; a receipt is sealed exactly once")
    body = normalize(receipt)
    sealed = {**body, "seal": make_seal(body, prev_ledger_sha256, private_key)}
    parsed = parse_receipt(sealed)
    data = file_bytes(sealed)
    entry = round_entry(parsed, sha256_hex(data))
    LedgerEntry.model_validate({**entry, "prev_sha256": prev_ledger_sha256})
    Path(rounds_dir).mkdir(parents=True, exist_ok=True)
    path = receipt_path(rounds_dir, sealed["round_id"])
    _write_once(path, data)
    return path, sealed, entry


def write_receipt(receipt: Mapping[str, Any], rounds_dir: str | os.PathLike[str] = DEFAULT_ROUNDS,
                  signing_key: str | os.PathLike[str] | None = None,
                  forbidden_roots: Iterable[Path] | None = None) -> Path:
    """Validate, seal (signed when a key is configured), write once, and append the ``round`` ledger line.

    Every round calls this, aborted and REJECTed ones included (rounds, not successes). The signing key comes from
    `signing_key` or $SCOREBOARD_SIGNING_KEY and must lie outside the checkout (and outside
    `forbidden_roots`, default: the current directory and the parent of rounds_dir).
    """
    roots = list(forbidden_roots) if forbidden_roots is not None else _forbidden_roots(rounds_dir)
    key = load_private_key(signing_key, roots)
    with ledger.exclusive(rounds_dir):
        ledger.read_entries(rounds_dir)  # refuse before writing anything when the chain is broken
        path, _, entry = _seal_and_write(receipt, rounds_dir, ledger.head_sha256(rounds_dir), key)
        ledger.append(rounds_dir, entry)
    return path


def read_receipt(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A receipt file as a validated dict (the seal is NOT checked here; see seal.verify_sealed)."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{p}: receipt not found", "receipts live in rounds/<round_id>.json")
    try:
        data = json.loads(p.read_bytes())
    except ValueError as exc:
        raise InputError(f"{p}: not JSON ({exc})") from None
    parse_receipt(data, str(p))
    return data


def receipt_files(rounds_dir: str | os.PathLike[str]) -> list[Path]:
    d = Path(rounds_dir)
    return sorted(p for p in d.glob("*.json") if not p.name.startswith(".")) if d.is_dir() else []


def round_entry(sealed: Receipt, file_sha256: str) -> dict[str, Any]:
    """The ``round`` ledger line for a sealed receipt (prev_sha256 is filled in by ledger.append)."""
    m = scored_metric(sealed)
    at_start = m.frontier if m else None  # the slot as the round read it from the lock
    return {"kind": "round", "round_id": sealed.round_id, "date": sealed.created_at,
            "target": sealed.target, "status": sealed.status, "candidate_commit": sealed.candidate.commit,
            "is_main": sealed.candidate.is_main, "verdict": frontier._label(sealed),
            "value": frontier.scored_value(sealed), "slot": frontier.scored_slot(sealed),
            "frontier_before": at_start, "frontier_after": at_start, "changes": [], "reason": "",
            "receipt_sha256": file_sha256, "seal_sha256": frontier._seal_sha256(sealed)}


def _forbidden_roots(rounds_dir: str | os.PathLike[str]) -> list[Path]:
    return [Path.cwd(), Path(rounds_dir).resolve().parent]


def record_round(receipt: Mapping[str, Any], rounds_dir: str | os.PathLike[str] = DEFAULT_ROUNDS,
                 lock_path: str | os.PathLike[str] | None = None,
                 signing_key: str | os.PathLike[str] | None = None,
                 forbidden_roots: Iterable[Path] | None = None) -> Recorded:
    """`write_receipt`, then (with a lock) `frontier.raise_frontier`: the whole of stages 7 and 8."""
    path = write_receipt(receipt, rounds_dir, signing_key, forbidden_roots)
    sealed = json.loads(path.read_bytes())
    changes = frontier.raise_frontier(lock_path, path, rounds_dir) if lock_path is not None else []
    return Recorded(path, sealed, changes)


def resume_round(receipt: str | os.PathLike[str], rounds_dir: str | os.PathLike[str] = DEFAULT_ROUNDS,
                 lock_path: str | os.PathLike[str] | None = None) -> Recorded:
    """Finish a round interrupted after its receipt was written: its missing ``round`` line, and the slots it
    earned (a ``frontier-raise`` line already written is not repeated), whatever was recorded after it.

    Every receipt the ledger lacks is re-chained with it, and every interrupted raise finished (`rechain`)."""
    from .rechain import rechain as _rechain

    with ledger.exclusive(rounds_dir):
        rec = frontier.recorded_receipt(receipt, rounds_dir)
    data, path, rid = rec.raw, rec.path, rec.receipt.round_id
    done = _rechain(rounds_dir, lock_path)
    if not any(ledger.is_round(e) and e.round_id == rid for e in ledger.read_entries(rounds_dir)):
        why = next((w for p, w in done.orphaned if p.resolve() == path.resolve()), "")
        raise NonCompliant(f"{path}: cannot be re-chained: {why or 'sealed against another ledger head'}",
                           "this receipt is orphaned; record the round again")
    return Recorded(path, data, done.raised.get(rid) or done.lock_changes)


@dataclass
class Recovered:
    """What `recover` did: files restored from the records ref, lines re-chained, and where the result was saved."""

    restored: Restored
    saved: Saved
    rechained: Rechained | None = None  # without a receipt: every receipt the ledger lacked
    resumed: Recorded | None = None  # with a receipt: that round finished


def recover(rounds_dir: str | os.PathLike[str], lock_path: str | os.PathLike[str],
            receipt: str | os.PathLike[str] | None = None) -> Recovered:
    """`scoreboard frontier resume`: restore what the working tree lost since the records were last saved
    (`durable.restore`), re-chain every receipt the ledger lacks and finish every interrupted raise (or, with
    `receipt`, that round: `resume_round`), bring the lock's slots to the ledger, then save the records again."""
    from . import durable

    restored = durable.restore(rounds_dir, lock_path)
    resumed = resume_round(receipt, rounds_dir, lock_path) if receipt is not None else None
    rechained = rechain(rounds_dir, lock_path) if receipt is None else None
    return Recovered(restored, durable.save(rounds_dir, lock_path, "frontier resume"), rechained, resumed)


# ----------------------------------------------------------------------------------------------
# re-chaining receipts the ledger lost

def rechain(rounds_dir: str | os.PathLike[str] = DEFAULT_ROUNDS,
            lock_path: str | os.PathLike[str] | None = None) -> Rechained:
    """`rechain.rechain` (kept here: the round's records API)."""
    from .rechain import rechain as _rechain

    return _rechain(rounds_dir, lock_path)
