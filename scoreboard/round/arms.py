"""The arms of a round: the reference, the candidate, and main (a PR round's) or the frontier (a main round's).

Every arm answers the same two questions the gate and the speed stage ask, through its client: logits at
some positions, and one block of timed reps. The reference runs the pinned engine the harness prepared, in
the harness's own process; every other arm is a commit's `engines/` run in fresh (sandboxed) worker
processes timed by the parent's clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from .. import environment
from ..engine import Engine, LogitsRequest, Prepared, Workload
from ..errors import EngineError, InputError
from ..fields import changes
from . import armcode
from .candidate import CandidateSource, import_root
from .clock import SessionPlan, run_session
from .context import RoundContext, RoundLog
from ..worker.protocol import TimedOp, WorkerOp
from .launch import HarnessEngine, WorkerRun, run_worker
from .reveal import Variants, block_order

Role = Literal["reference", "candidate-side"]


@dataclass(frozen=True)
class ReferenceClient:
    """The pinned reference engine, prepared (built and re-verified) at preflight."""

    engine: Engine
    prepared: Prepared
    log: RoundLog

    def logits(self, req: LogitsRequest) -> Any:
        return self.engine.logits(self.prepared, req)

    def logits_many(self, reqs: list[LogitsRequest]) -> list[Any]:
        """Several requests at once where the engine can share their work (one load, a common prefix once):
        each answer is what logits() gives it alone."""
        many = getattr(self.engine, "logits_many", None)
        return list(many(self.prepared, reqs)) if many is not None and len(reqs) > 1 else [self.logits(r) for r in reqs]

    def block(self, w: Workload, reps: int, block: int | None) -> dict[str, Any]:
        """One block of `reps` timed reps, bounded by the harness's wall clock around the reference tool."""
        t0 = time.perf_counter_ns()
        out = self.engine.timed(self.prepared, w, reps)
        wall = time.perf_counter_ns() - t0
        total = sum(x.ns for x in out)
        if total > wall:
            raise EngineError(f"reference reported {total} ns of reps inside {wall} ns of wall clock",
                              "the reference tool's self-report exceeds the harness's wall-clock bound")
        if out and out[0].command:
            self.log.command(out[0].command)
        return {"block": block if block is not None else -1, "samples_ns": [x.ns for x in out],
                "n_tokens": [x.n_tokens for x in out], "wall_ns": wall, "command": out[0].command if out else [],
                "clock": "reference-tool"}


@dataclass(frozen=True)
class WorkerClient:
    """Fresh worker processes of the candidate engine for one source tree (`None`: a root given per call)."""

    ctx: RoundContext
    log: RoundLog
    source: CandidateSource | None
    target: Any  # EngineTarget: the candidate's
    # the identity the arm's first launch of its own target reported (the gate's, for the candidate): every later
    # launch must report the same, so the code that was timed is the code that was judged
    first: dict[str, Any] = field(default_factory=dict)
    engine: str = ""  # the engine its workers run ("": the target's candidate engine)

    @property
    def engine_name(self) -> str:
        return self.engine or self.ctx.target.candidate_engine

    def root(self) -> Path:
        """The directory whose `engines` the worker imports (a git arm's export is re-verified each launch)."""
        if self.source is None:
            raise EngineError("this arm has no source tree of its own; pass the worker's import root")
        return import_root(self.source, self.ctx.cache_dir)

    def call(self, op: WorkerOp, session: Callable[..., Any] | None = None, root: Path | None = None,
             target: Any = None, timeout_s: float | None = None, harness_engine: HarnessEngine = None) -> WorkerRun:
        """One fresh worker (`target`: the arm's, unless a calibration asks for a variant of it: another
        precision, an injected fault, several prompts in one launch)."""
        ctx = self.ctx
        own = harness_engine is None  # the arm's engine, from the arm's code (not the harness's null engine)
        res = run_worker(self.engine_name, root or self.root(), target or self.target, ctx.cache_dir, op,
                         timeout_s or ctx.target.speed.timeout_s, workdir=ctx.scratch, env=ctx.device_env(),
                         session=session, isolation=ctx.isolation, harness_engine=harness_engine,
                         entry_point=armcode.entry_point(self.engine_name, self.source) if own else None,
                         import_paths=armcode.import_paths(self.source) if own else (),
                         logs_dir=ctx.logs_dir, on_launch=self.log.record_launch)
        self.log.command(res.base_command + [f"<{op.kind}>"])
        if res.result.ranks is not None:
            self.check_ranks(res.result.ranks)
        self.log.record_peaks([p.as_dict() for p in res.result.peak_memory])
        if target is None and harness_engine is None and res.result.identity is not None:
            self.check_identity(res.result.identity)  # the arm's own engine at its own target
        return res

    def check_identity(self, identity: dict[str, Any]) -> None:
        """The first launch's identity is the arm's; a later launch that reports another ran other code (an engine
        that picks its code path at start-up, e.g. a kernel that compiles on one launch and not the next)."""
        if not self.first:
            self.first.update(identity)
            return
        if identity != self.first:
            diff = changes(self.first, identity)
            raise EngineError(f"the {self.engine_name} engine reported another identity in a later launch "
                              f"than in its first: {'; '.join(diff[:6])}. What was timed would not be what was judged",
                              "make the engine choose its code path the same way in every launch, then run the round again")

    def check_ranks(self, fps: list[dict[str, Any]]) -> None:
        """Every rank's fingerprint: recorded (first launch), checked against the node class (every launch)."""
        from ..worker.distributed import rank_problems

        ctx, t = self.ctx, self.ctx.target
        node = ctx.lock.nodes[t.node]
        bad = rank_problems(fps, t.parallel.ranks, t.device, node.gpu_model)
        for fp in fps:
            bad += [f"rank {fp['rank']['rank']}: {p}" for p in environment.node_mismatches(fp, node)]
        if bad and not ctx.allow_node_mismatch:
            raise InputError(f"the candidate's {t.parallel.ranks} ranks are not a {t.node!r} world:\n  "
                             + "\n  ".join(bad), f"run `scoreboard env --target {ctx.target_id}` and use a matching box")
        if self.log.ranks is None:
            self.log.ranks = fps
            self.log.rank_problems = bad

    def block(self, arm: str, variants: list[Variants], reps: int, block: int | None) -> list[dict[str, Any]]:
        """One launch timing every metric: warm-up reps, then `reps` timed reps of each metric's variants in
        the order (seed, arm, block) draws; one record per metric."""
        ctx = self.ctx
        warmup = ctx.target.speed.warmup_reps
        n = warmup + reps
        orders = [block_order(ctx.seed, arm, block, v.key, len(v.reveals), n) for v in variants]
        plan = SessionPlan([v.workload for v in variants],
                           [[(i, v.reveals[i]) for i in order] for v, order in zip(variants, orders)], warmup)
        run = self.call(TimedOp.of([v.workload for v in variants], [n] * len(variants)),
                        session=lambda ch: run_session(ch, plan))
        wall = int(run.wall_ns)
        runs = run.session
        total = sum(x.ns for reps_ in runs for x in reps_)
        if total > wall:  # both readings are the parent's: only a harness bug could break this
            raise EngineError(f"{arm}: {total} ns of timed reps inside {wall} ns of launch wall clock",
                              "report this harness bug")
        out = []
        for var, reps_ in zip(variants, runs):
            out.append({"block": block if block is not None else -1, "samples_ns": [x.ns for x in reps_],
                        "n_tokens": [var.workload.n_tokens for _ in reps_], "token_ids": [x.token_ids for x in reps_],
                        "variants": [x.variant for x in reps_], "worker_ns": [x.worker_ns for x in reps_],
                        "logprobs": [x.logprobs for x in reps_],
                        "wall_ns": wall, "command": run.base_command, "clock": "harness"})
        return out


@dataclass(frozen=True)
class Arm:
    """One side of the round's comparison."""

    name: str  # "reference" | "candidate" | "main" | "frontier"
    role: Role  # the pinned reference, or a commit's engine on the candidate's side
    engine: str  # registry name
    source: CandidateSource | None  # the tree the arm's engines/ come from (None: the reference's pin)
    sandbox: str  # how its code runs: "in-process" (the reference), else the workers' isolation ("bwrap"|"none")
    client: ReferenceClient | WorkerClient

    @property
    def is_reference(self) -> bool:
        return self.role == "reference"

    def worker(self) -> WorkerClient:
        if not isinstance(self.client, WorkerClient):
            raise EngineError(f"arm {self.name} runs in the harness's process, not in a worker")
        return self.client

    def logits(self, req: LogitsRequest) -> Any:
        if isinstance(self.client, ReferenceClient):
            return self.client.logits(req)
        raise EngineError(f"arm {self.name}: logits of a worker arm come from its gate call")

    def logits_many(self, reqs: list[LogitsRequest]) -> list[Any]:
        if isinstance(self.client, ReferenceClient):
            return self.client.logits_many(reqs)
        raise EngineError(f"arm {self.name}: logits of a worker arm come from its gate call")

    def blocks(self, variants: list[Variants], reps: int, block: int | None) -> list[dict[str, Any]]:
        """One block of this arm for every metric (`block` None: the discarded warm-up pass)."""
        if isinstance(self.client, ReferenceClient):
            return [self.client.block(v.workload, reps, block) for v in variants]
        return self.client.block(self.name, variants, reps, block)

    def side(self, identity: dict[str, Any]) -> dict[str, Any]:
        """The receipt's candidate / main section for this arm."""
        s = self.source
        if s is None:
            return {"engine": self.engine, "identity": identity}
        return {"engine": self.engine, "label": s.label, "commit": s.commit, "dirty": s.dirty, "is_main": s.is_main,
                "identity": identity}


def reference_arm(ctx: RoundContext, log: RoundLog, engine: Engine, prepared: Prepared) -> Arm:
    return Arm("reference", "reference", ctx.target.reference_engine, None, "in-process",
               ReferenceClient(engine, prepared, log))


def worker_arm(name: str, ctx: RoundContext, log: RoundLog, source: CandidateSource | None, target: Any) -> Arm:
    return Arm(name, "candidate-side", ctx.target.candidate_engine, source, ctx.isolation,
               WorkerClient(ctx, log, source, target))
