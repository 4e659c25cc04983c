"""Who may seal history: the signing keys pinned in reference.lock, and the records sealed before the first pin.

A sealed record (a receipt, ``rounds/<round_id>.json``; a calibration, ``rounds/calibrations/<id>.json``) is
*trusted* when

- its Ed25519 signature verifies and the public key it embeds is pinned as ``[signers.<id>]``: "signed by <id>";
- or it is listed in ``[sealed_before_pin]`` under its id with exactly its ``seal.sha256``: "sealed before the
  signer pin" (trusted by review of that list, and always reported as such, never silently).

Anything else is untrusted: unsigned, signed by a key the lock does not pin, or a signature that does not verify.
The seal itself (content = seal.sha256) is checked by the caller first; a standing is about who sealed it.

Why a candidate could not have made a record trusted: the private key lies outside every tree a candidate can
read (`seal.load_private_key` refuses one inside the checkout or the rounds directory's parent; the sandbox binds
neither the key nor its environment variable), and the pins are read from reference.lock, a reviewed file whose
every change of a signer, a listed record, a target or a slot `scoreboard verify --base REV` reports. A ledger
line carries no signature of its own: it is trusted through the receipt it names (a round line repeats that
receipt's fields; a frontier line is backed by what that receipt measured), which `verify` checks field by field.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Mapping

from ..errors import InputError, ScoreboardError
from .seal import SIGNING_KEY_ENV, check_signature

RecordKind = Literal["round", "calibration"]
_ID_KEY = {"round": "round_id", "calibration": "calibration_id"}
PRE_PIN = "sealed before the signer pin"


@dataclass(frozen=True)
class Standing:
    """Who sealed one record, as the pins say."""

    state: Literal["signed", "pre-pin", "untrusted"]
    signer: str = ""  # the pinned signer's id, when signed
    why: str = ""  # untrusted: the reason, naming the fix

    @property
    def trusted(self) -> bool:
        return self.state != "untrusted"

    def describe(self) -> str:
        if self.state == "signed":
            return f"signed by pinned key {self.signer!r}"
        return PRE_PIN if self.state == "pre-pin" else self.why


@dataclass(frozen=True)
class Trust:
    """The pins one lock holds: signer id -> base64 raw public key; (kind, id) -> seal sha256 of a pre-pin record."""

    signers: Mapping[str, str] = field(default_factory=dict)
    pre_pin: Mapping[tuple[str, str], str] = field(default_factory=dict)
    source: str = "reference.lock"  # where the pins were read, for messages
    problem: str = ""  # non-empty: the pins could not be read at all (every record is untrusted)
    other: str = ""  # a lock beside the records that was not used (named when a record is untrusted)

    @classmethod
    def of(cls, lock: Any, source: str | os.PathLike[str] = "reference.lock") -> "Trust":
        pre = {("round", r.id): r.seal_sha256 for r in lock.sealed_before_pin.rounds}
        pre.update({("calibration", r.id): r.seal_sha256 for r in lock.sealed_before_pin.calibrations})
        return cls({sid: s.public_key for sid, s in lock.signers.items()}, pre, str(source))

    @classmethod
    def unreadable(cls, why: str, source: str = "") -> "Trust":
        return cls({}, {}, source, why)

    def next_step(self) -> str:
        """The command-line option that judges the records by the lock beside them ("" when there is none, or it
        is the one in use): for a user who reviewed that lock, never applied unasked."""
        return f"--lock {self.other}" if self.other else ""

    def _other_hint(self) -> str:
        return (f" (beside the records lies another lock, {self.other}, whose pins were not used: if you reviewed "
                f"it, pass {self.next_step()})") if self.other else ""

    def signer_of(self, public_key_b64: str) -> str | None:
        return next((sid for sid, key in self.signers.items() if key == public_key_b64), None)

    def standing(self, record: Mapping[str, Any], kind: RecordKind) -> Standing:
        """The record's standing under these pins (its seal is assumed checked: see module docstring)."""
        if self.problem:
            return Standing("untrusted", why=f"no pinned signers could be read ({self.problem})" + self._other_hint())
        raw_seal = record.get("seal")
        seal: Mapping[str, Any] = raw_seal if isinstance(raw_seal, Mapping) else {}
        rid, digest = str(record.get(_ID_KEY[kind], "")), str(seal.get("sha256", ""))
        listed = self.pre_pin.get((kind, rid))
        if listed is not None and listed == digest:
            return Standing("pre-pin")
        if seal.get("signature"):
            bad = check_signature(record)
            if bad:
                return Standing("untrusted", why=f"{bad[0][0]}: {bad[0][1]}")
            sid = self.signer_of(str(seal.get("public_key")))
            if sid is not None:
                return Standing("signed", sid)
            return Standing("untrusted", why=f"signed by a key {self.source} does not pin ([signers]: public key "
                                             f"{seal.get('public_key')}); only a box's pinned key seals history"
                                             + self._other_hint())
        if listed is not None:
            return Standing("untrusted", why=f"{self.source} lists {kind} {rid} as {PRE_PIN} with seal "
                                             f"{listed[:12]}…, but this record's seal is {digest[:12]}…")
        return Standing("untrusted", why=f"not signed, and not listed in {self.source} [sealed_before_pin]: a record "
                                         "sealed after the signer pin must be signed by a pinned key"
                                         + self._other_hint())


def own_lock(start: str | os.PathLike[str] = ".") -> Path | None:
    """The reference.lock of the checkout a command runs in: `start`/reference.lock, else the one at the root of
    the git working tree `start` lies in (the nearest directory above holding .git); None when neither is there.
    A lock in a directory between the two is not the checkout's: a directory of records handed over and unpacked
    inside the checkout carries its own."""
    here = Path(start).resolve()
    if (here / "reference.lock").is_file():
        return here / "reference.lock"
    root = next((d for d in (here, *here.parents) if (d / ".git").exists()), None)
    if root is not None and (root / "reference.lock").is_file():
        return root / "reference.lock"
    return None


def near(rounds_dir: str | os.PathLike[str], lock_path: str | os.PathLike[str] | None = None) -> Trust:
    """The pins a display of `rounds_dir` judges by: `lock_path`, else the lock of the checkout the command runs in
    (`own_lock`). Never the lock that merely lies beside the records: whoever hands over a directory of records
    can put a lock pinning their own key beside them, so a record is trusted only by the checkout's pins or by a
    lock the user chose (passed as --lock). A lock beside the records that was not used is kept as `other`, so
    that an untrusted record's reason names `--lock <it>`. Never raises: pins that cannot be read make every
    record untrusted, with the reason."""
    from ..lockfile import load_lock

    beside = Path(rounds_dir).resolve().parent / "reference.lock"
    if lock_path is None:
        lock_path = own_lock()
    other = str(beside) if beside.is_file() and (lock_path is None or beside.resolve() != Path(lock_path).resolve()) \
        else ""
    if lock_path is None:
        return replace(Trust.unreadable("no reference.lock in the working directory or at the root of its git "
                                        "working tree; pass --lock FILE"), other=other)
    try:
        trust = Trust.of(load_lock(lock_path), lock_path)
    except ScoreboardError as exc:
        trust = Trust.unreadable(exc.message.splitlines()[0], str(lock_path))
    return replace(trust, other=other)


def pinned_signing_key(lock: Any, lock_path: str | os.PathLike[str], forbidden_roots: list[Path]) -> str:
    """The pinned signer id of the key in $SCOREBOARD_SIGNING_KEY, loaded exactly as sealing loads it; InputError
    naming the commands when no key is set or its public key is not pinned (a record it sealed would be a finding)."""
    from .seal import load_private_key, public_key_b64

    key = load_private_key(None, forbidden_roots)
    new = ("make the box's key once, outside every checkout: `scoreboard signer new ~/.config/scoreboard/signing.key`, "
           f"export {SIGNING_KEY_ENV}=~/.config/scoreboard/signing.key, and pin its public key by a reviewed commit: "
           f"`scoreboard signer pin --id <box> --public-key ~/.config/scoreboard/signing.key.pub --lock {lock_path}` "
           "(docs/signing.md); or run with --no-seal for an unsealed trial")
    if key is None:
        raise InputError(f"${SIGNING_KEY_ENV} is not set: a sealed record must be signed by a key pinned in "
                         f"{lock_path} [signers], or `scoreboard verify` reports it", new)
    pub = public_key_b64(key.public_key())
    sid = Trust.of(lock, lock_path).signer_of(pub)
    if sid is None:
        raise InputError(f"${SIGNING_KEY_ENV}: its public key {pub} is not pinned in {lock_path} [signers]; what it "
                         "sealed would be untrusted history", new)
    return sid


def pin_signer(lock_path: str | os.PathLike[str], signer_id: str, public_key: str, note: str = "",
               today: str | None = None) -> None:
    """Add ``[signers.<signer_id>]`` to the lock (comment-preserving, validated, atomic). `public_key` is the
    base64 raw key or the path of a public key file (PEM or base64). Refuses an id or a key already pinned."""
    import datetime as dt

    import tomlkit

    from ..lockfile import load_lock, update_lock
    from .seal import load_public_key, public_key_b64

    raw = public_key if not Path(public_key).is_file() else public_key_b64(load_public_key(public_key))
    lock = load_lock(lock_path)
    if signer_id in lock.signers:
        raise InputError(f"{lock_path}: signers.{signer_id} is already pinned",
                         "pick another --id; a key is never replaced in place (remove the old table in a reviewed "
                         "commit first)")
    other = Trust.of(lock, lock_path).signer_of(raw)
    if other is not None:
        raise InputError(f"{lock_path}: that key is already pinned as signers.{other}")

    def edit(doc: Any) -> None:
        signers = doc.get("signers")
        if signers is None:
            signers = tomlkit.table(is_super_table=True)
            doc["signers"] = signers
        table = tomlkit.table()
        table["public_key"] = raw
        table["added"] = today or dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
        if note:
            table["note"] = note
        signers[signer_id] = table

    update_lock(lock_path, edit)
