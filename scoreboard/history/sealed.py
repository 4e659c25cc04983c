"""Reading one receipt file for use: the single entry point every reader of a recorded receipt goes through.

Order: read the JSON -> refuse a format this scoreboard does not read (InputError, exit 1: not ours to read)
-> check the seal and an embedded signature (NonCompliant, exit 2: an edited or unsealed receipt is a
claim, not a measurement) -> with the lock's pins (`trust.Trust`), who sealed it (NonCompliant, exit 2: a
receipt no pinned key vouches for is UNTRUSTED) -> parse into the typed `Receipt` (InputError naming every
bad field's path).
The parsed model is what consumers read; the raw JSON stays next to it because the seal, the canonical
bytes and the ledger's file hash are over exactly those bytes, never over a re-dump of the model.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InputError, NonCompliant
from .receipt import Receipt, parse_receipt, refuse_unknown_format
from .seal import check_seal, check_signature, sha256_hex
from .trust import Standing, Trust


@dataclass(frozen=True)
class SealedReceipt:
    """A receipt file whose seal held when it was read."""

    path: Path
    raw: dict[str, Any]  # the JSON as read: what the seal, canonical bytes and field digests are over
    receipt: Receipt  # the same content, parsed
    file_sha256: str  # sha256 of the file's bytes (what a ledger line records)


def read_json_receipt(path: str | os.PathLike[str]) -> tuple[dict[str, Any], bytes]:
    """(the JSON object, the file's bytes); InputError when missing, unreadable or not an object."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{p}: receipt not found", "list sealed receipts with `ls rounds/*.json`")
    try:
        raw = p.read_bytes()
        data = json.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{p}: not a readable JSON receipt ({exc})",
                         "run `scoreboard verify` to check history") from None
    if not isinstance(data, dict):
        raise InputError(f"{p}: a receipt is a JSON object")
    return data, raw


def seal_problems(data: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, message) for a missing/mismatched seal or a signature that does not verify."""
    return check_seal(data) or check_signature(data)


def seal_state(problems: list[tuple[str, str]]) -> str:
    """How a display names a receipt whose seal problems are `problems`: sealed, UNSEALED or TAMPERED."""
    if not problems:
        return "sealed"
    return "UNSEALED" if problems[0][0] == "seal" else "TAMPERED"


def require_sealed(data: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """NonCompliant (exit 2) naming the edited fields, unless the receipt is exactly what was sealed."""
    problems = seal_problems(data)
    if not problems:
        return
    what = seal_state(problems)
    fields = ", ".join(f for f, _ in problems)
    detail = problems[0][1] if what == "UNSEALED" else f"changed since sealing: {fields}"
    raise NonCompliant(f"{path}: {what} receipt ({detail}); its verdict is not shown — an unsealed or edited "
                       "receipt is a claim, not a measurement",
                       f"restore it from git (`git checkout -- {path}`) and run `scoreboard verify`")


def require_trusted(data: dict[str, Any], path: str | os.PathLike[str], trust: Trust) -> Standing:
    """NonCompliant (exit 2) unless a key `trust` pins sealed the receipt (or it is listed as sealed before the pin)."""
    standing = trust.standing(data, "round")
    if not standing.trusted:
        raise NonCompliant(f"{path}: UNTRUSTED receipt ({standing.why}); its verdict is not shown — a record no "
                           "pinned key vouches for is a claim, not a measurement",
                           untrusted_hint(trust))
    return standing


def untrusted_hint(trust: Trust) -> str:
    """The next command for a record `trust` does not vouch for: judging by the lock that came with the records,
    when one did (only for a user who reviewed it), else checking history against the lock in use."""
    check = (f"run `scoreboard verify --lock {trust.source}`" if trust.source else "pass --lock <the reference.lock "
             "whose signers judge it>") + " (docs/signing.md: who may seal history)"
    if trust.next_step():
        return f"if you reviewed {trust.other}, judge by its pins: pass {trust.next_step()}; otherwise {check}"
    return check


def read_sealed(path: str | os.PathLike[str], trust: Trust | None = None) -> SealedReceipt:
    """Read a receipt file, refuse an unknown format (exit 1), check the seal (exit 2) and, with `trust`, who
    sealed it (exit 2), then parse it."""
    p = Path(path)
    data, raw = read_json_receipt(p)
    refuse_unknown_format(data, p)
    require_sealed(data, p)
    if trust is not None:
        require_trusted(data, p, trust)
    return SealedReceipt(p, data, parse_receipt(data, str(p)), sha256_hex(raw))


@dataclass(frozen=True)
class ReceiptFile:
    """A receipt file as a display reads it, never raising: sealed and parsed, or the reason it is not."""

    path: Path
    raw: dict[str, Any] | None  # the JSON object, when the file holds one (shown even when its seal fails)
    state: str  # "sealed" | "UNSEALED" | "TAMPERED" | "UNTRUSTED" | "UNREADABLE"
    problems: list[tuple[str, str]]  # (field, message); empty when sealed
    sealed: SealedReceipt | None  # set exactly when state == "sealed"
    standing: str = ""  # who sealed it, when judged: "signed by pinned key 'x'" | "sealed before the signer pin"


def inspect_receipt(path: str | os.PathLike[str], trust: Trust | None = None) -> ReceiptFile:
    """`read_sealed` for a page that lists every receipt: a receipt that cannot be used is reported, not raised.
    A file whose seal holds but whose content this scoreboard cannot read (a newer major format, or a field
    the model refuses) is UNREADABLE; with `trust`, one no pinned key vouches for is UNTRUSTED."""
    p = Path(path)
    try:
        raw = p.read_bytes()
        data = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError) as exc:
        return ReceiptFile(p, None, "UNREADABLE", [("<file>", str(exc))], None)
    if not isinstance(data, dict):
        return ReceiptFile(p, None, "UNREADABLE", [("<root>", "not a JSON object")], None)
    problems = seal_problems(data)
    if problems:
        return ReceiptFile(p, data, seal_state(problems), problems, None)
    standing = trust.standing(data, "round") if trust is not None else None
    if standing is not None and not standing.trusted:
        return ReceiptFile(p, data, "UNTRUSTED", [("seal", standing.why)], None)
    try:
        refuse_unknown_format(data, p)
        parsed = parse_receipt(data, str(p))
    except InputError as exc:
        return ReceiptFile(p, data, "UNREADABLE", [("<content>", exc.message)], None)
    return ReceiptFile(p, data, "sealed", [], SealedReceipt(p, data, parsed, sha256_hex(raw)),
                       standing.describe() if standing is not None else "")
