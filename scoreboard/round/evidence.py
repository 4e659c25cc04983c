"""The reference build's evidence, anchored in sealed history instead of the cache.

The llama.cpp build and its ``manifest.json`` sit in the same writable cache, so a process that rewrites a
binary can rewrite the manifest with it. The anchor is therefore the round history: the first round that used
a build (keyed by the build's cache key) seals the hash of every file under its ``build/bin`` in its receipt
(``reference.identity.binaries`` + ``extra.build_links``); every later round compares a fresh hash of the build
with the latest verified sealed receipt for the same key, before the reference runs. An extra, a missing and a
changed file are each a pin error naming the file.

Why the candidate cannot move the anchor: receipts are sealed (sha256 over canonical bytes, optionally signed)
and chained in ``rounds/ledger.jsonl``; the history read here is the ledger's chain, each receipt re-hashed
against its ledger line and its seal re-checked, so a receipt edited or dropped by anyone (the candidate's
workers never see ``rounds/``) is an error, never a skip. A round that found a mismatch records status
"mismatch" and is never used as an anchor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import NonCompliant, PinError
from ..scans import compare_scans

GOOD = ("first-use", "matched", "renewed")  # anchor statuses a later round may compare with


@dataclass(frozen=True)
class Anchor:
    round_id: str
    files: dict[str, str]
    links: dict[str, str] | None  # None: a receipt from before links were recorded (files only)


def verified_receipts_newest_first(rounds_dir: Path):
    """Every receipt the ledger names, newest first, each re-hashed against its line and its seal checked.

    One small reader so that the round's verified-history object can replace it: it yields (line, receipt).
    """
    from ..history.ledger import read_entries
    from ..history.seal import check_seal, check_signature, sha256_hex

    rounds_dir = Path(rounds_dir)
    if not rounds_dir.is_dir():
        return
    for entry in reversed(read_entries(rounds_dir)):  # NonCompliant when the chain is broken
        if entry.kind not in ("round", "round-late"):
            continue
        path = rounds_dir / f"{entry.round_id}.json"
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise NonCompliant(f"{path}: the ledger records this receipt but it cannot be read ({exc})",
                               "restore it from git (`git checkout -- rounds/`); run `scoreboard verify`") from None
        if sha256_hex(data) != entry.receipt_sha256:
            raise NonCompliant(f"{path}: bytes differ from its ledger line (receipt_sha256)",
                               "restore it from git; run `scoreboard verify`")
        receipt = json.loads(data)
        problems = check_seal(receipt) + check_signature(receipt)
        if problems:
            raise NonCompliant(f"{path}: " + "; ".join(f"{f}: {m}" for f, m in problems),
                               "restore it from git; run `scoreboard verify`")
        yield entry, receipt


def sealed_anchor(rounds_dir: Path, build_key: str) -> Anchor | None:
    """The latest verified sealed receipt that recorded the files of build `build_key`, or None (first use)."""
    for _entry, receipt in verified_receipts_newest_first(rounds_dir):
        ident = ((receipt.get("reference") or {}).get("identity") or {})
        extra = ident.get("extra") or {}
        if extra.get("build_key") != build_key or not ident.get("binaries"):
            continue
        status = (extra.get("build_anchor") or {}).get("status")
        if status is not None and status not in GOOD:
            continue  # a round that found a mismatch recorded what it found, not what is good
        links = extra.get("build_links") if "build_links" in extra else None
        return Anchor(receipt["round_id"], dict(ident["binaries"]), links)
    return None


def check_reference_build(identity: dict[str, Any], rounds_dir: Path, renew: bool = False) -> dict[str, Any]:
    """Compare the prepared reference's fresh file hashes with the sealed anchor for its build key.

    Returns the ``build_anchor`` record for the receipt; raises PinError naming every differing file (the
    record with status "mismatch" is put into `identity` first so the aborted receipt shows what was found).
    `renew`: the operator accepts a rebuilt reference (recorded with the previous anchor and the differences).
    """
    extra = identity.setdefault("extra", {})
    key = extra.get("build_key", "")
    anchor = sealed_anchor(rounds_dir, key)
    if anchor is None:
        record: dict[str, Any] = {"status": "first-use", "round": None}
        extra["build_anchor"] = record
        return record
    found = {"files": dict(identity.get("binaries") or {}), "links": dict(extra.get("build_links") or {})}
    want_links = anchor.links if anchor.links is not None else found["links"]
    problems = compare_scans(found, anchor.files, want_links, f"the receipt of round {anchor.round_id}")
    if not problems:
        record = {"status": "matched", "round": anchor.round_id}
    elif renew:
        record = {"status": "renewed", "round": anchor.round_id, "differences": problems}
    else:
        extra["build_anchor"] = {"status": "mismatch", "round": anchor.round_id, "differences": problems}
        raise PinError(f"reference build {key} differs from the one sealed by round {anchor.round_id}:\n  "
                       + "\n  ".join(problems),
                       "something rewrote the cached build (and perhaps its manifest.json): delete "
                       f"<cache>/llamacpp/build/{key} and find out what wrote there; if you rebuilt it "
                       "deliberately, run the round with --renew-reference-anchor (recorded in the receipt)")
    extra["build_anchor"] = record
    return record
