"""The sealed history a round is judged against, read and verified at preflight and then held.

A round reads history for three decisions: the gate's ratchet (main's last sealed, gate-passing
KL per depth), the speed basis (the frontier slots and the commit that set them) and where its own
receipt chains (the ledger tip). All three are read here, once, before any candidate process
starts, and kept in a frozen `History`: the gate and the verdict ask this object, never rounds/.

Why a candidate cannot have touched what is held: it is read before the first candidate worker is
launched, from a ledger whose hash chain and receipts whose seals are checked here; what is kept is
the verified file bytes (immutable), parsed afresh on each use, so nothing a candidate later does to
rounds/ (hiding, deleting, editing receipts) changes what the round judges with.

What is refused (InputError naming the file and the next command, raised before the round starts so
nothing is written): a broken ledger chain; a ledger line whose receipt file is missing, differs from
the bytes the line recorded, fails its seal or embedded signature, is sealed by no key the lock pins (and
is not listed as sealed before the signer pin: `trust`), or does not chain where the line says; a sealed
receipt in rounds/ that no ledger line names (a round would seal over it: `scoreboard frontier resume`
chains it first); a frontier slot of the target that no ledger line backs, that the ledger set to another
value, or whose backing receipt did not measure it. An unverifiable basis is never skipped.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from . import ledger
from ..errors import InputError, NonCompliant
from .ledger import LedgerEntry
from ..lockfile import Lock
from .receipt import Receipt, parse_receipt, validation_problems
from .seal import check_seal, check_signature, sha256_hex
from .trust import Trust

_VERIFY = "run `scoreboard verify --lock {lock} --rounds {rounds}` to see the damage"


@dataclass(frozen=True)
class HeldReceipt:
    """One verified receipt as it was read at preflight (its file bytes)."""

    round_id: str
    target: str
    path: Path
    raw: bytes  # the file bytes, sha256-matched against the ledger line and seal-checked
    line: int  # ledger line number (1-based) of its ``round`` line

    def data(self) -> dict[str, Any]:
        """A fresh parse of the held bytes: a caller can never mutate what later callers see."""
        return json.loads(self.raw)

    def receipt(self) -> Receipt:
        """The held bytes as the typed model (validated when they were held)."""
        return parse_receipt(self.data(), str(self.path))


@dataclass(frozen=True)
class FrontierSlot:
    """A frontier slot of the target as the lock holds it, backed by the ledger and a sealed receipt."""

    slot: str
    role: str  # the metric's role: "scored" | "guard"
    value: float  # tok/s
    round_id: str  # the sealed receipt that measured it
    commit: str  # the candidate commit that receipt measured (the commit the frontier arm re-measures)


@dataclass(frozen=True)
class RatchetBasis:
    """Main's last sealed, gate-passing verdict receipt of the target: per-depth mean KL."""

    round_id: str
    kl_mean: tuple[tuple[int, float], ...]  # (depth, nats)

    def baselines(self) -> dict[int, float]:
        return dict(self.kl_mean)


@dataclass(frozen=True)
class History:
    """Everything a round reads from history, verified at preflight (see module docstring)."""

    rounds_dir: Path
    target: str
    lines: tuple[bytes, ...]  # every ledger line as verified (without newlines)
    receipts: tuple[HeldReceipt, ...]  # this target's receipts, ledger order
    ratchet: RatchetBasis | None
    frontier: tuple[FrontierSlot, ...]  # this target's non-zero frontier slots

    @property
    def tip(self) -> str:
        """sha256 of the last ledger line at preflight ("" for an empty ledger)."""
        return sha256_hex(self.lines[-1]) if self.lines else ""

    def ratchet_baselines(self) -> dict[int, float]:
        return self.ratchet.baselines() if self.ratchet else {}

    def frontier_slot(self, slot: str) -> FrontierSlot | None:
        return next((f for f in self.frontier if f.slot == slot), None)

    @property
    def scored_frontier(self) -> FrontierSlot | None:
        return next((f for f in self.frontier if f.role == "scored"), None)

    def recent_receipts(self, n: int | None = None) -> list[dict[str, Any]]:
        """This target's verified receipts, newest first (at most `n`), each a fresh parsed dict."""
        held = self.receipts[::-1] if n is None else self.receipts[::-1][:n]
        return [h.data() for h in held]

    def describe(self) -> dict[str, Any]:
        """What the round judged against, for the receipt (open sections only)."""
        return {"ledger_lines": len(self.lines), "ledger_tip": self.tip,
                "ratchet_round": self.ratchet.round_id if self.ratchet else None,
                "frontier_rounds": {f.slot: f.round_id for f in self.frontier}}

    def check_extends(self, rounds_dir: str | os.PathLike[str] | None = None) -> None:
        """Refuse to seal into a ledger that no longer begins with the history this round was judged
        against (rewritten, truncated or hidden while the round ran: a new chain would replace it)."""
        d = Path(rounds_dir) if rounds_dir is not None else self.rounds_dir
        try:
            now = ledger.read_lines(d)
        except NonCompliant as exc:
            now, why = [], exc.message
        else:
            why = ""
        if tuple(now[: len(self.lines)]) != self.lines:
            raise NonCompliant(
                f"{ledger.ledger_path(d)}: no longer begins with the {len(self.lines)} line(s) verified when the "
                f"round started (tip {self.tip[:12] or 'empty'}…){': ' + why if why else ''}; something wrote "
                "rounds/ while the round ran, so its receipt is not sealed into a replaced history",
                f"restore rounds/ledger.jsonl from git and run `scoreboard verify --rounds {d}`")


def _fail(msg: str, hint: str) -> InputError:
    return InputError(msg, hint)


def load_history(rounds_dir: str | os.PathLike[str], lock: Lock, target_id: str,
                 lock_path: str | os.PathLike[str] = "reference.lock") -> History:
    """Read and verify the ledger, every receipt it names, and the target's frontier slots; see the
    module docstring for what is refused. Reads only; never writes."""
    rounds = Path(rounds_dir)
    lp = ledger.ledger_path(rounds)
    verify_hint = _VERIFY.format(lock=lock_path, rounds=rounds)
    try:
        lines = ledger.read_lines(rounds)
    except NonCompliant as exc:
        raise _fail(f"{lp}: {exc.message.split(': ', 1)[-1]}", verify_hint + "; restore the ledger from git") from None
    problems = ledger.chain_problems(lines)
    if problems:
        shown = "; ".join(f"line {n}: {f}: {m}" for n, f, m in problems[:3])
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise _fail(f"{lp}: the ledger chain is broken ({shown}{more}); a round never runs against tampered "
                    "history", verify_hint + "; restore rounds/ledger.jsonl from git")
    entries = [LedgerEntry.model_validate(json.loads(raw)) for raw in lines]
    trust = Trust.of(lock, lock_path)
    held: dict[str, HeldReceipt] = {}
    earlier = {""}  # the hashes of the lines before line n: where a round-late line's receipt may have been sealed
    for n, e in enumerate(entries, start=1):
        where = f"{lp}:{n}"
        path = rounds / f"{e.round_id}.json"
        if ledger.is_round(e):
            if e.round_id in held:
                raise _fail(f"{where}: a second round line for round {e.round_id}", verify_hint)
            held[e.round_id] = _verified(path, e, n, where, verify_hint, trust, earlier)
            earlier.add(sha256_hex(lines[n - 1]))
            continue
        earlier.add(sha256_hex(lines[n - 1]))
        h = held.get(e.round_id)
        if h is None:
            raise _fail(f"{where}: {e.kind} line for round {e.round_id} before (or without) its round line",
                        verify_hint)
        if sha256_hex(h.raw) != e.receipt_sha256:
            raise _fail(f"{where}: {e.kind} line records receipt_sha256 {e.receipt_sha256[:12]}… but {path} "
                        f"is {sha256_hex(h.raw)[:12]}…", verify_hint)
    _refuse_unchained(rounds, held, lock_path)
    target = lock.target(target_id)
    mine = tuple(h for h in held.values() if h.target == target_id)
    return History(rounds, target_id, tuple(lines), mine, _ratchet(entries, held, target_id),
                   _frontier(lock, target, entries, held, lock_path, rounds, verify_hint))


def _refuse_unchained(rounds: Path, held: Mapping[str, HeldReceipt], lock_path: Any) -> None:
    """A sealed receipt in rounds/ that no round line names: a round that sealed now would chain past it, and the
    round it records (a raise included) would be lost for good."""
    from .records import receipt_files

    loose = [p for p in receipt_files(rounds) if p.stem not in held and _sealed(p)]
    if loose:
        names = ", ".join(p.name for p in loose[:3]) + (f" (and {len(loose) - 3} more)" if len(loose) > 3 else "")
        raise _fail(f"{rounds}: {len(loose)} receipt(s) on no ledger line ({names}); a round never seals past a "
                    "recorded round it has not chained",
                    f"chain them first: `scoreboard frontier resume --lock {lock_path} --rounds {rounds}` (or, for a "
                    f"file that is no receipt of this history, move it out of {rounds})")


def _sealed(path: Path) -> bool:
    """Whether the file holds a sealed receipt (a JSON object with a seal digest), whatever else is wrong with it;
    other files in rounds/ are no round's record (`verify` names them)."""
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return False
    seal = data.get("seal") if isinstance(data, dict) else None
    return isinstance(seal, dict) and isinstance(seal.get("sha256"), str) and "round_id" in data


def _verified(path: Path, e: LedgerEntry, n: int, where: str, verify_hint: str, trust: Trust,
              earlier: set[str]) -> HeldReceipt:
    """The receipt a round line names, checked against that line and its own seal."""
    resume = (f"if the file was moved, put it back at {path}; a receipt is never rewritten (restore it from "
              f"git), then " + verify_hint)
    if not path.is_file():
        raise _fail(f"{path}: missing, but {where} (the round line of {e.round_id}) names it; a round never "
                    "judges against history it cannot prove", resume)
    raw = path.read_bytes()
    if sha256_hex(raw) != e.receipt_sha256:
        raise _fail(f"{path}: its bytes are not the ones {where} recorded (receipt_sha256 {e.receipt_sha256[:12]}…, "
                    f"file {sha256_hex(raw)[:12]}…): edited after sealing", resume)
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise _fail(f"{path}: not JSON ({exc})", resume) from None
    bad = validation_problems(data)
    if bad:
        raise _fail(f"{path}: not a valid receipt ({'; '.join(bad[:3])})", resume)
    seal = check_seal(data) + check_signature(data)
    if seal:
        raise _fail(f"{path}: seal does not verify ({'; '.join(f'{f}: {m}' for f, m in seal[:3])})", resume)
    standing = trust.standing(data, "round")
    if not standing.trusted:
        raise _fail(f"{path}: UNTRUSTED ({standing.why}); a round never judges against history no pinned key "
                    "vouches for", verify_hint)
    r = Receipt.model_validate(data)
    seal_sha, prev = (r.seal.sha256, r.seal.prev_ledger_sha256) if r.seal else ("", "")  # check_seal: present
    checks = [(r.round_id != e.round_id, f"round_id is {r.round_id!r}, the line says {e.round_id!r}"),
              (seal_sha != e.seal_sha256, "seal.sha256 differs from the line's seal_sha256"),
              (e.kind == "round" and prev != e.prev_sha256,
               "sealed after a different ledger line than the one it follows (reordered)"),
              (e.kind == "round-late" and prev not in earlier,
               "a round-late line whose receipt was sealed after no earlier line of the ledger"),
              (r.target != e.target, f"target is {r.target!r}, the line says {e.target!r}")]
    for bad_, why in checks:
        if bad_:
            raise _fail(f"{path}: {why} ({where})", verify_hint)
    return HeldReceipt(e.round_id, e.target, path, raw, n)


def _ratchet(entries: list[LedgerEntry], held: Mapping[str, HeldReceipt], target_id: str) -> RatchetBasis | None:
    """Main's last sealed verdict receipt of the target whose gate passed (every one is verified)."""
    for e in reversed(entries):
        if not ledger.is_round(e) or e.target != target_id or not e.is_main or e.status != "verdict":
            continue
        rec = held[e.round_id].receipt()
        if not rec.candidate.is_main or rec.gate is None or not rec.gate.pass_:
            continue
        return RatchetBasis(e.round_id, tuple((int(d["depth"]), float(d["kl_mean"])) for d in rec.gate.depths))
    return None


def _frontier(lock: Lock, target: Any, entries: list[LedgerEntry], held: Mapping[str, HeldReceipt],
              lock_path: Any, rounds: Path, verify_hint: str) -> tuple[FrontierSlot, ...]:
    """The target's frontier slots, each backed by the last ledger change of it and a receipt that
    measured exactly that value at that commit."""
    from .frontier import measured_slots

    last = ledger.last_changes(entries)
    out = []
    for m in target.metrics:
        name = target.slot(target.candidate_engine, m)
        s = lock.slots.get(name)
        value = s.value if s else 0.0
        hit = last.get(name)
        f = f"{lock_path}: slots.{name}"
        if hit is None:
            if value:
                raise _fail(f"{f} = {value} is not backed by any ledger line (hand-seeded); a frontier is only "
                            "written from a sealed receipt", verify_hint)
            continue
        e, c = hit
        resume = (f"an interrupted round: `scoreboard frontier resume --receipt {rounds / (e.round_id + '.json')} "
                  f"--lock {lock_path} --rounds {rounds}`; otherwise a hand edit: " + verify_hint)
        if value != c.after or (s is not None and value and (s.round != e.round_id or s.commit != c.commit)):
            raise _fail(f"{f} = {value} (round {s.round if s else ''!r}) but the ledger's last change of it "
                        f"(round {e.round_id}) set {c.after}", resume)
        if not value or s is None:
            continue
        rec = held[e.round_id].receipt()
        try:
            got = {(x.slot, x.kind): x for x in measured_slots(rec)}.get((name, "frontier"))
        except InputError as exc:
            raise _fail(f"{f}: its receipt {held[e.round_id].path} cannot back it: {exc.message}", verify_hint) from None
        if got is None or got.value != value or got.commit != s.commit:
            raise _fail(f"{f} = {value} at {s.commit[:12]} but {held[e.round_id].path} measured "
                        f"{got.value if got else 'nothing'} at {got.commit[:12] if got else '-'}", verify_hint)
        out.append(FrontierSlot(name, m.role, value, e.round_id, s.commit))
    return tuple(out)
