"""Re-chaining: every sealed, trusted receipt in rounds/ that the ledger lacks is put back where its seal proves
it belongs, every raise an interrupt cut off is finished, and the lock's slots are brought to the ledger.

Proof of place: a receipt's seal names the ledger line it was sealed after (``seal.prev_ledger_sha256``), and a
pinned key's signature binds that name (`trust`). Three cases, in this order, until none applies:

1. it was sealed after the ledger's last line: its ``round`` line is rebuilt exactly from it;
2. it was sealed after a ``frontier-raise`` line the ledger lost: that line is rebuilt from its round's receipt
   and the slot state the ledger reached, its time (the one field a receipt does not fix) found as the second
   whose line hashes to the later receipt's ``prev_ledger_sha256``, so the rebuilt line is byte-identical;
3. it was sealed after a line the ledger holds, with later lines after that one (history rolled back by git,
   and a round chained over the gap): a ``round-late`` line records it at the ledger's end, its proven place
   being the earlier line its seal names.

Then every round line whose receipt earned slot changes (`frontier.plan` at its place) and has no
``frontier-raise`` line after it gets one now, with what it still earns (`frontier.late_plan`: frontiers it
beats, never undoing a later lowering; baselines no later line re-measured). Receipts sealed after a line that
nothing can rebuild (a lost ``frontier-lower`` line, whose reason no receipt holds; a hand edit) and receipts no
pinned key vouches for stay off the ledger and are reported. The lock is written only to values some ledger
line set; a slot the ledger never held is left alone for `scoreboard verify` to report.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import frontier, ledger
from ..errors import InputError, NonCompliant
from .ledger import LedgerEntry, SlotChange
from .receipt import Receipt, parse_receipt
from .records import DEFAULT_ROUNDS, receipt_files, receipt_path, round_entry
from .seal import sha256_hex
from .trust import Trust


@dataclass
class Rechained:
    """What `rechain` appended and what it could not prove."""

    appended: list[str] = field(default_factory=list)  # one line per ledger line written, in order
    orphaned: list[tuple[Path, str]] = field(default_factory=list)  # receipts left off, and why
    lock_changes: list[SlotChange] = field(default_factory=list)  # slots brought to the ledger's state
    raised: dict[str, list[SlotChange]] = field(default_factory=dict)  # round id -> the raise written for it now


@dataclass
class _Orphan:
    path: Path
    data: Receipt  # sealed, and trusted: its seal and signer held when read
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


def _sealed_files(rounds_dir: Path, trust: Trust) -> tuple[dict[str, _Orphan], list[tuple[Path, str]]]:
    """Every receipt file whose seal, embedded signature and signer hold (by round id), and the others with why."""
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
        standing = trust.standing(data, "round")
        if path.stem != parsed.round_id:
            bad.append((path, f"named {path.name} but its round id is {parsed.round_id}"))
        elif not standing.trusted:
            bad.append((path, f"UNTRUSTED: {standing.why}"))
        else:
            good[parsed.round_id] = _Orphan(path, parsed, sha256_hex(raw))
    return good, bad


class _Chainer:
    """One re-chaining pass over rounds/, with the rounds/ lock held."""

    def __init__(self, rounds: Path, lock: Any, trust: Trust, out: Rechained):
        self.rounds, self.lock, self.out = rounds, lock, out
        entries = ledger.read_entries(rounds)  # never extend a broken chain
        self.files, out.orphaned = _sealed_files(rounds, trust)
        on = {e.round_id for e in entries if ledger.is_round(e)}
        self.orphans = {rid: o for rid, o in self.files.items() if rid not in on}
        self.state = {slot: c.after for slot, (_, c) in ledger.last_changes(entries).items()}
        self.pending: list[_Orphan] = []  # on the ledger in place, their raise not written yet
        last = entries[-1] if entries else None
        raised = {e.round_id for e in entries if e.kind == "frontier-raise"}
        if last is not None and last.kind == "round" and last.round_id in self.files and last.round_id not in raised:
            self.pending.append(self.files[last.round_id])  # interrupted between its round and raise lines

    def changes_of(self, o: _Orphan) -> list[SlotChange]:
        return frontier.plan(self.lock, o.data, self.state) if self.lock is not None else []

    def append_round(self, o: _Orphan, late: bool) -> None:
        entry = round_entry(o.data, o.file_sha)
        ledger.append(self.rounds, {**entry, "kind": "round-late"} if late else entry)
        self.out.appended.append(f"{'round-late' if late else 'round'} {o.rid}"
                                 + (f" (sealed after line {o.prev[:12] or '(none)'}…)" if late else ""))
        del self.orphans[o.rid]

    def append_raise(self, o: _Orphan, ch: list[SlotChange], date: str | None, why: str) -> None:
        entry = frontier._slot_entry("frontier-raise", o.data, o.path, ch, self.lock, values=self.state, date=date)
        ledger.append(self.rounds, entry)
        for c in ch:
            self.state[c.slot] = c.after
        self.out.raised[o.rid] = ch
        self.out.appended.append(f"frontier-raise {o.rid} ({why})")

    def chain_in_place(self) -> bool:
        """Case 1 of the module docstring: the earliest orphan sealed after the ledger's last line."""
        head = ledger.head_sha256(self.rounds)
        nxt = sorted((o for o in self.orphans.values() if o.prev == head), key=lambda o: o.data.created_at)
        if not nxt:
            return False
        self.append_round(nxt[0], late=False)
        if self.changes_of(nxt[0]):
            self.pending.append(nxt[0])
        return True

    def rebuild_raise(self) -> bool:
        """Case 2: a lost raise line of a round re-chained in place, proven by the next receipt's seal."""
        wanted = {o.prev for o in self.orphans.values()}
        head = ledger.head_sha256(self.rounds)
        for p in self.pending if wanted else []:
            ch = self.changes_of(p)
            if not ch:
                continue
            lo = _epoch(p.data.created_at)
            hi = max(_epoch(o.data.created_at) + sum(o.data.stage_seconds.values()) + 600
                     for o in self.orphans.values())
            entry = frontier._slot_entry("frontier-raise", p.data, p.path, ch, self.lock, values=self.state)
            hit = _proven_date(entry, head, lo, min(hi, lo + MAX_DATE_SEARCH_S), wanted)
            if hit:
                self.append_raise(p, ch, hit[0], f"rebuilt, {hit[0]}, proven by the seal of the next receipt")
                self.pending.remove(p)
                return True
        return False

    def chain_late(self) -> bool:
        """Case 3: the earliest orphan sealed after a line the ledger holds before its last one."""
        lines = ledger.read_lines(self.rounds)
        placed = {sha256_hex(raw) for raw in lines} | ({""} if lines else set())
        late = sorted((o for o in self.orphans.values() if o.prev in placed), key=lambda o: o.data.created_at)
        if not late:
            return False
        self.append_round(late[0], late=True)
        return True

    def finish_raises(self) -> None:
        """Every round line whose trusted receipt earned slot changes and has no raise line after it gets one."""
        if self.lock is None:
            return
        entries = ledger.read_entries(self.rounds)
        raised = {e.round_id for e in entries if e.kind == "frontier-raise"}
        for i, e in enumerate(entries):
            o = self.files.get(e.round_id)
            if not ledger.is_round(e) or o is None or e.round_id in raised:
                continue
            ch = frontier.late_plan(self.lock, o.data, self.state, entries[i + 1:])
            if ch:
                self.append_raise(o, ch, None, "slot changes recorded now" if i == len(entries) - 1 else
                                  "an interrupted raise, finished now")


def rechain(rounds_dir: str | os.PathLike[str] = DEFAULT_ROUNDS,
            lock_path: str | os.PathLike[str] | None = None) -> Rechained:
    """Re-chain every receipt the ledger lacks, finish every interrupted raise, bring the lock to the ledger (the
    module docstring says how each is proven). The pins are read from `lock_path`, else from the checkout's own
    lock (`trust.near`, never one that merely lies beside rounds_dir): a receipt no pinned key vouches for is never
    chained."""
    from ..lockfile import load_lock
    from .trust import near

    rounds = Path(rounds_dir)
    out = Rechained()
    lock = load_lock(lock_path) if lock_path is not None else None
    trust = Trust.of(lock, lock_path) if lock is not None and lock_path is not None else near(rounds)
    with ledger.exclusive(rounds):
        c = _Chainer(rounds, lock, trust, out)
        while c.chain_in_place() or c.rebuild_raise() or c.chain_late():
            pass
        c.finish_raises()
        for o in sorted(c.orphans.values(), key=lambda o: o.data.created_at):
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
