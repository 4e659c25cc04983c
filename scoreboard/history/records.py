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
from typing import Any, Iterable, Mapping

from . import frontier, ledger
from ..errors import InputError, NonCompliant
from .ledger import LedgerEntry, SlotChange
from .receipt import Receipt, normalize, parse_receipt, scored_metric
from .seal import load_private_key, make_seal, sha256_hex

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
    """Finish a round interrupted after its receipt was written: append its missing ``round`` line, then
    raise/replace the slots it earned (a ``frontier-raise`` line already written is not repeated).

    Every receipt the ledger lacks is re-chained first, with every other receipt whose place its seal
    proves (`rechain`: also receipts sealed after a ``frontier-raise`` line the ledger lost). Slots are then
    raised from it only when it is the ledger's last round: an older receipt's slot changes were
    settled by the lines after it."""
    with ledger.exclusive(rounds_dir):
        rec = frontier.recorded_receipt(receipt, rounds_dir)
    data, path, rid = rec.raw, rec.path, rec.receipt.round_id
    done = rechain(rounds_dir, lock_path)
    if not any(e.kind == "round" and e.round_id == rid for e in ledger.read_entries(rounds_dir)):
        why = next((w for p, w in done.orphaned if p.resolve() == path.resolve()), "")
        raise NonCompliant(f"{path}: cannot be re-chained: {why or 'sealed against another ledger head'}",
                           "this receipt is orphaned; record the round again")
    rechained = done.lock_changes
    last_round = next((e for e in reversed(ledger.read_entries(rounds_dir)) if e.kind == "round"), None)
    changes = []
    if lock_path is not None and last_round is not None and last_round.round_id == rid:
        changes = frontier.raise_frontier(lock_path, path, rounds_dir)
    return Recorded(path, data, changes or rechained)


# ----------------------------------------------------------------------------------------------
# re-chaining receipts the ledger lost

@dataclass
class Rechained:
    """What `rechain` appended and what it could not prove."""

    appended: list[str] = field(default_factory=list)  # one line per ledger line written, in order
    orphaned: list[tuple[Path, str]] = field(default_factory=list)  # receipts left off, and why
    lock_changes: list[SlotChange] = field(default_factory=list)  # slots brought to the ledger's state


@dataclass
class _Orphan:
    path: Path
    data: Receipt  # sealed: its seal held when read
    file_sha: str

    @property
    def prev(self) -> str:
        return self.data.seal.prev_ledger_sha256 if self.data.seal else ""

    @property
    def rid(self) -> str:
        return self.data.round_id


_DATE_PLACEHOLDER = "9999-12-31T23:59:59Z"
MAX_DATE_SEARCH_S = 45 * 86400  # how far past a round's start its lost raise line's time is searched


def _stamp(ts: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _epoch(stamp: str) -> float:
    import datetime as dt

    return dt.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc).timestamp()


def _proven_date(entry: dict[str, Any], prev: str, lo: float, hi: float, wanted: set[str]) -> tuple[str, str] | None:
    """The second in [lo, hi] at which the raise line `entry` (date unknown) hashes to one of `wanted`
    (a later receipt's seal.prev_ledger_sha256): (date, that hash), or None. The seal of the receipt
    sealed right after the line is the proof that the line, byte for byte, was there."""
    model = LedgerEntry.model_validate({**entry, "date": _DATE_PLACEHOLDER, "prev_sha256": prev})
    template = ledger.line_bytes(model.model_dump(mode="json"))
    if template.count(_DATE_PLACEHOLDER.encode()) != 1:
        return None
    head, tail = template.split(_DATE_PLACEHOLDER.encode())
    t = int(lo)
    while t <= hi:
        stamp = _stamp(t)
        digest = sha256_hex(head + stamp.encode() + tail)
        if digest in wanted:
            return stamp, digest
        t += 1
    return None


def _sealed_files(rounds_dir: Path) -> tuple[dict[str, _Orphan], list[tuple[Path, str]]]:
    from .seal import check_signature, verify_sealed

    good: dict[str, _Orphan] = {}
    bad: list[tuple[Path, str]] = []
    for path in receipt_files(rounds_dir):
        raw = path.read_bytes()
        try:
            data = json.loads(raw)
            parsed = parse_receipt(data, str(path))
            verify_sealed(data, str(path))
            sig = check_signature(data)
            if sig:
                raise NonCompliant(f"{path}: {sig[0][0]}: {sig[0][1]}")
        except (ValueError, InputError, NonCompliant) as exc:
            bad.append((path, getattr(exc, "message", str(exc)).splitlines()[0]))
            continue
        if path.stem != parsed.round_id:
            bad.append((path, f"named {path.name} but its round id is {parsed.round_id}"))
            continue
        good[parsed.round_id] = _Orphan(path, parsed, sha256_hex(raw))
    return good, bad


def rechain(rounds_dir: str | os.PathLike[str] = DEFAULT_ROUNDS,
            lock_path: str | os.PathLike[str] | None = None) -> Rechained:
    """Append to the ledger every sealed receipt under rounds_dir that it lacks and whose place in the
    chain can be proven, with the ``frontier-raise`` lines between them, then bring the lock's slots to
    the ledger's state.

    Proof: a receipt's seal names the ledger line it was sealed after (seal.prev_ledger_sha256). A
    round line is rebuilt exactly from its receipt; a lost raise line is rebuilt from its receipt and
    the slot state the ledger had reached, its time (the one field a receipt does not fix) found as
    the second whose line hashes to the next receipt's prev_ledger_sha256. Receipts sealed after a
    line that cannot be rebuilt (a ``frontier-lower`` line, whose reason no receipt holds; a hand
    edit) stay off the ledger and are reported. The lock is written only to values some ledger line
    set; a slot the ledger never held is left alone for `scoreboard verify` to report.
    """
    from ..lockfile import load_lock

    rounds = Path(rounds_dir)
    out = Rechained()
    with ledger.exclusive(rounds):
        entries = ledger.read_entries(rounds)  # never extend a broken chain
        files, out.orphaned = _sealed_files(rounds)
        on = {e.round_id for e in entries if e.kind == "round"}
        orphans = {rid: o for rid, o in files.items() if rid not in on}
        lock = load_lock(lock_path) if lock_path is not None else None
        state = {slot: c.after for slot, (_, c) in ledger.last_changes(entries).items()}
        pending: list[_Orphan] = []  # re-chained rounds whose slot changes no line records yet
        raised = {e.round_id for e in entries if e.kind == "frontier-raise"}
        if entries and entries[-1].kind == "round" and entries[-1].round_id in files \
                and entries[-1].round_id not in raised:
            pending.append(files[entries[-1].round_id])  # interrupted between its round and raise lines

        def changes_of(o: _Orphan) -> list[SlotChange]:
            return frontier.plan(lock, o.data, state) if lock is not None else []

        def append_raise(o: _Orphan, ch: list[SlotChange], date: str | None, why: str) -> None:
            entry = frontier._slot_entry("frontier-raise", o.data, o.path, ch, lock, values=state, date=date)
            ledger.append(rounds, entry)
            for c in ch:
                state[c.slot] = c.after
            out.appended.append(f"frontier-raise {o.rid} ({why})")

        while True:
            head = ledger.head_sha256(rounds)
            nxt = sorted((o for o in orphans.values() if o.prev == head), key=lambda o: o.data.created_at)
            if nxt:
                o = nxt[0]
                ledger.append(rounds, round_entry(o.data, o.file_sha))
                out.appended.append(f"round {o.rid}")
                del orphans[o.rid]
                if changes_of(o):
                    pending.append(o)
                continue
            wanted = {o.prev for o in orphans.values()}
            proven = None
            for p in pending if wanted else []:
                ch = changes_of(p)
                if not ch:
                    continue
                lo = _epoch(p.data.created_at)
                hi = max(_epoch(o.data.created_at) + sum(o.data.stage_seconds.values()) + 600
                         for o in orphans.values())
                entry = frontier._slot_entry("frontier-raise", p.data, p.path, ch, lock, values=state)
                hit = _proven_date(entry, head, lo, min(hi, lo + MAX_DATE_SEARCH_S), wanted)
                if hit:
                    proven = (p, ch, hit[0])
                    break
            if proven is None:
                break
            p, ch, date = proven
            append_raise(p, ch, date, f"rebuilt, {date}, proven by the seal of the next receipt")
            pending.remove(p)
        # the chain ends here: slot changes of re-chained rounds that no later seal proves are
        # recorded now, as raise_frontier would have recorded them
        for p in pending:
            ch = changes_of(p)
            if ch:
                append_raise(p, ch, None, "slot changes recorded now")
        for o in sorted(orphans.values(), key=lambda o: o.data.created_at):
            out.orphaned.append((o.path, f"sealed after ledger line {o.prev[:12]}…, which is not on the ledger "
                                         "and cannot be rebuilt (a lost frontier-lower line, or a hand edit)"))
        if lock_path is not None:
            out.lock_changes = _lock_to_ledger(Path(lock_path), rounds)
    return out


def _lock_to_ledger(lock_path: Path, rounds: Path) -> list[SlotChange]:
    """Write each slot the lock holds at a value the ledger had earlier (stale) to the ledger's last
    value for it, with that line's provenance. Called with the rounds/ lock held."""
    from ..lockfile import load_lock

    entries = ledger.read_entries(rounds)
    history: dict[str, set[float]] = {}
    for e in entries:
        for c in e.changes:
            history.setdefault(c.slot, {0.0}).update({c.before, c.after})
    lock = load_lock(lock_path)
    by_round: dict[str, list[SlotChange]] = {}
    for slot, (e, c) in ledger.last_changes(entries).items():
        now = lock.slots[slot].value if slot in lock.slots else 0.0
        s = lock.slots.get(slot)
        if now == c.after and (s is None or s.round == e.round_id):
            continue
        if now != c.after and now not in history[slot]:
            continue  # never a ledger value: a hand edit, left for `scoreboard verify`
        by_round.setdefault(e.round_id, []).append(c.model_copy(update={"before": now}))
    done: list[SlotChange] = []
    for rid, changes in by_round.items():
        path = receipt_path(rounds, rid)
        frontier.apply(lock_path, changes, parse_receipt(json.loads(path.read_bytes()), str(path)))
        done += changes
    return done
