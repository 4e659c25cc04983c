"""The round, in order: load lock -> preflight -> gate -> speed -> verdict -> seal -> frontier.

Every round that gets past loading the lock produces a receipt (REJECT, inconclusive and aborted
ones too). Ctrl-C propagates and leaves nothing written. No printing here: progress goes through the
`report` callback the CLI supplies.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .. import environment
from ..engine import EngineTarget, Geometry
from ..errors import InputError, ScoreboardError, TransientError
from ..lockfile import Lock, Target, lock_digest, load_lock
from ..receipt import FORMAT_VERSION, new_round_id, utc_now
from . import candidate as cand_mod
from . import sandbox
from .stages import GateStage, PreflightResult, SpeedStage, preflight

Report = Callable[..., None]


def _noop(*_a: Any, **_k: Any) -> None:
    return None


@dataclass
class RoundOptions:
    target: str
    lock_path: Path = Path("reference.lock")
    candidate: str = "main"
    seed: int | None = None
    blocks: int | None = None
    reps: int | None = None
    seal: bool = True
    rounds_dir: Path = Path("rounds")
    cache_dir: Path = Path.home() / ".cache" / "scoreboard"
    candidate_options: dict[str, Any] = field(default_factory=dict)  # e.g. {"faults": ["..."]} (tests)
    max_transient_retries: int = 2
    update_frontier: bool = True
    allow_node_mismatch: bool = False
    gate_only: bool = False  # tests: stop after the gate (no speed, no verdict, nothing sealed)
    # "bwrap" (candidate workers sandboxed) or "none": an explicit opt-out for tests that cannot run under the
    # sandbox; never read from the environment (a candidate could set that); its receipts move no frontier
    isolation: str = "bwrap"
    repo: Path = cand_mod.HARNESS_ROOT  # the git repository whose commits are main and the candidates


@dataclass
class RoundOutcome:
    receipt: dict[str, Any]
    path: Path | None
    exit_code: int
    frontier_change: Any = None


class _Abort(Exception):
    def __init__(self, stage: str, exc: ScoreboardError):
        super().__init__(exc.message)
        self.stage = stage
        self.exc = exc


class Round:
    """One round's state while it runs; `receipt` is built up stage by stage."""

    def __init__(self, opts: RoundOptions, lock: Lock, report: Report):
        self.opts = opts
        self.lock = lock
        self.target: Target = lock.target(opts.target)
        self.report = report
        self.seed = opts.seed if opts.seed is not None else secrets.randbits(31)
        created = utc_now()
        self.receipt: dict[str, Any] = {
            "format_version": FORMAT_VERSION, "round_id": new_round_id(opts.target, created),
            "created_at": created, "status": "verdict", "target": opts.target,
            "lock_sha256": lock_digest(opts.lock_path),
            "lock_target": self.target.model_dump(mode="json", by_alias=True),
            "candidate": None, "main": None, "reference": None, "weights": None, "environment": {},
            "seed": self.seed, "geometry": dict(self.target.geometry), "gate": None, "speed": None,
            "verdict": None, "aborted": None, "retries": [], "commands": [], "stage_seconds": {}, "provenance": {},
        }
        self.pre: PreflightResult | None = None

    # -- helpers -------------------------------------------------------------------------------
    def stage(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run one stage with timing, bounded retries of transient failures, and abort on errors."""
        self.report("stage", name=name)
        t0 = time.perf_counter()
        attempt = 0
        try:
            while True:
                try:
                    return fn()
                except TransientError as exc:
                    attempt += 1
                    self.receipt["retries"].append({"stage": name, "error": exc.message, "at": utc_now()})
                    if attempt > self.opts.max_transient_retries:
                        raise _Abort(name, exc) from exc
                    self.report("retry", stage=name, error=exc.message, attempt=attempt)
                except ScoreboardError as exc:
                    raise _Abort(name, exc) from exc
        finally:
            self.receipt["stage_seconds"][name] = round(time.perf_counter() - t0, 3)

    def engine_target(self, device_opts: dict[str, Any] | None = None, reference: Any = None,
                      ranks: int = 1) -> EngineTarget:
        g = self.target.geometry
        assert self.pre is not None
        return EngineTarget(self.target_id, self.pre.shards[0], tuple(self.pre.shards), self.target.device,
                            Geometry(g["n_ctx"], g["n_batch"], g["n_ubatch"], g.get("n_threads", 0)),
                            reference=reference, options=dict(device_opts or {}), ranks=ranks)

    def candidate_target(self) -> EngineTarget:
        """The candidate's target: parallel.ranks processes (launched by the harness when > 1)."""
        return self.engine_target(self.opts.candidate_options, ranks=self.target.parallel.ranks)

    def device_env(self) -> dict[str, str]:
        """Both sides' GPUs: CUDA_VISIBLE_DEVICES = the first parallel.ranks devices (cuda targets only)."""
        if self.target.device != "cuda":
            return {}
        from ..distributed import visible_devices

        return {"CUDA_VISIBLE_DEVICES": visible_devices(self.target.parallel.ranks)}

    def reference_target(self) -> EngineTarget:
        """The reference's target: one process, llama.cpp's own split mode over the candidate's GPUs."""
        opts = {"split_mode": self.target.parallel.reference_split_mode}
        visible = self.device_env().get("CUDA_VISIBLE_DEVICES")
        if visible:
            opts["visible_devices"] = visible
        return self.engine_target(opts, reference=self.lock.references[self.target.reference])

    @property
    def target_id(self) -> str:
        return self.opts.target


def run_round(opts: RoundOptions, report: Report = _noop) -> RoundOutcome:
    """Run a round end to end. Lock errors raise (nothing to record); later failures become receipts."""
    for name, value, least in (("--blocks", opts.blocks, 2), ("--reps", opts.reps, 1)):
        if value is not None and value < least:
            raise InputError(f"{name} {value}: must be at least {least}",
                             "paired confidence intervals need >= 2 blocks and >= 1 timed rep per block")
    lock = load_lock(opts.lock_path)
    rnd = Round(opts, lock, report)
    opts.cache_dir.mkdir(parents=True, exist_ok=True)
    # private to this round (0700): the arms' exports and every launch's scratch dir; removed however it ends
    rnd.scratch = sandbox.new_scratch_root()
    try:
        return _run(rnd, opts)
    finally:
        sandbox.remove_tree(rnd.scratch)


def _run(rnd: Round, opts: RoundOptions) -> RoundOutcome:
    r = rnd.receipt
    branch = rnd.lock.main_branch
    try:
        src = rnd.stage("candidate", lambda: cand_mod.resolve(opts.candidate, rnd.scratch, opts.repo, branch))
        rnd.source = src
        rnd.main_source = None if src.is_main else rnd.stage(
            "candidate", lambda: cand_mod.resolve_main_arm(rnd.scratch, opts.repo, branch))
        rnd.pre = rnd.stage("preflight", lambda: preflight(rnd))
        gate = GateStage(rnd)
        rnd.stage("gate", gate.run)
        if opts.gate_only:
            return RoundOutcome(r, None, 0 if r["gate"]["pass"] else 2)
        if r["gate"]["pass"]:
            rnd.stage("speed", SpeedStage(rnd, gate).run)
        rnd.stage("verdict", lambda: _verdict(rnd))
    except _Abort as ab:
        _mark_aborted(rnd, ab.stage, ab.exc)
    return _finish(rnd)


def _verdict(rnd: Round) -> None:
    from ..tiers import verdict_from_receipt

    v = verdict_from_receipt(rnd.receipt, rnd.target)
    rnd.receipt["verdict"] = v.as_dict()


def _mark_aborted(rnd: Round, stage: str, exc: ScoreboardError) -> None:
    r = rnd.receipt
    r["status"] = "aborted"
    r["verdict"] = None
    reason = exc.message + (f" (next: {exc.hint})" if exc.hint else "")
    r["aborted"] = {"stage": stage, "reason": reason, "transient": isinstance(exc, TransientError)}
    _fill_sides(rnd)


def _fill_sides(rnd: Round) -> None:
    """An aborted round still records who was going to run; unknown identities stay empty."""
    r = rnd.receipt
    t = rnd.target
    src = getattr(rnd, "source", None)
    if r["candidate"] is None:
        r["candidate"] = {"engine": t.candidate_engine, "label": rnd.opts.candidate,
                          "commit": src.commit if src else "", "dirty": src.dirty if src else False,
                          "is_main": src.is_main if src else rnd.opts.candidate == "main", "identity": {}}
    if r["reference"] is None:
        r["reference"] = {"engine": t.reference_engine, "identity": {}}
    if r["candidate"]["is_main"]:
        r["main"] = None


def _finish(rnd: Round) -> RoundOutcome:
    from ..records import write_receipt

    r = rnd.receipt
    _fill_sides(rnd)
    if not r["environment"]:
        r["environment"] = environment.fingerprint()
    path, change = None, None
    weights_pinned = bool(r.get("weights") and r["weights"].get("fully_pinned"))
    if rnd.opts.seal and not weights_pinned and r["status"] == "verdict":
        r["provenance"]["unsealable"] = "weights not fully pinned: the round ran but cannot seal"
    if rnd.opts.seal and (weights_pinned or r["status"] == "aborted"):
        rnd.report("stage", name="seal")  # the seal cannot time itself inside the bytes it seals
        path = write_receipt(r, rnd.opts.rounds_dir)
        if r["status"] == "verdict" and r["candidate"]["is_main"] and rnd.opts.update_frontier:
            from ..frontier import raise_frontier

            change = raise_frontier(rnd.opts.lock_path, path, rnd.opts.rounds_dir)
    return RoundOutcome(r, path, _exit_code(r), change)


def _exit_code(r: dict[str, Any]) -> int:
    if r["status"] == "aborted":
        return 1
    return 2 if r["verdict"]["label"] == "REJECT" else 0
