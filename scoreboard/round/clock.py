"""The harness's clock, read in the round's own process around the handshake with a worker.

A candidate's code runs in the worker (its own process, sandboxed), so nothing it does there — replacing
functions, patching ``time``, threads — reaches the readings taken here. Per timed rep:

    worker: begin(known part) -> synchronize [-> barrier] -> "ready"
    parent: t0 = perf_counter_ns() -> reveal -> (worker: step -> synchronize -> ranks agree -> output)
            -> the output's complete line arrived -> t1 = perf_counter_ns()

``t1 - t0`` is the sample. It includes the handshake's own round trip, which every round measures with the
harness's null engine (scoreboard.worker.nullengine) and records beside the samples.

:func:`in_process_reps` is the same begin/reveal/step order inside one process, for the executable
contract and bench scripts; a round never uses it as a measurement.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..engine import Engine, Prepared, Rep, Workload, as_step_output
from ..errors import EngineError
from ..worker.handshake import ParentChannel, decode, encode

Clock = Callable[[], int]


@dataclass
class ClockedRep:
    """One rep as the parent saw it: its own nanoseconds, the variant revealed, the output that came back."""

    ns: int
    variant: int
    token_ids: list[int]
    worker_ns: int | None = None  # the worker's own reading: a cross-check, never a sample
    warmup: bool = False
    logprobs: list[float] | None = None  # per output id, as the engine computed it in the timed step


@dataclass
class SessionPlan:
    """What the parent reveals: per workload, the (variant index, revealed ids) of every rep in order
    (the first `warmup` of each are discarded)."""

    workloads: Sequence[Workload]
    reveals: Sequence[Sequence[tuple[int, tuple[int, ...]]]]
    warmup: int
    runs: list[list[ClockedRep]] = field(default_factory=list)


def run_session(channel: ParentChannel, plan: SessionPlan, clock: Clock = time.perf_counter_ns) -> list[list[ClockedRep]]:
    """Drive one worker session; returns per workload its timed reps (warm-up reps dropped)."""
    decode(channel.recv_line(), "hello")
    out: list[list[ClockedRep]] = []
    for i, (w, reveals) in enumerate(zip(plan.workloads, plan.reveals)):
        reps: list[ClockedRep] = []
        for j, (variant, tokens) in enumerate(reveals):
            if len(tokens) != w.reveal_len:
                raise EngineError(f"internal: reveal of {len(tokens)} ids for a {w.phase} rep (wants {w.reveal_len})")
            decode(channel.recv_line(), "ready", workload=i, rep=j)
            msg = encode("reveal", workload=i, rep=j, tokens=list(tokens))
            t0 = clock()
            channel.send(msg)
            line = channel.recv_line()
            t1 = clock()
            body = decode(line, "output", workload=i, rep=j)
            ids = body.get("token_ids")
            if not isinstance(ids, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
                raise EngineError(f"timed {w.phase} rep {j}: the output is not a list of token ids: {ids!r:.120}")
            if len(ids) != w.output_len:
                raise EngineError(f"timed {w.phase} rep {j}: the engine returned {len(ids)} ids, the contract wants "
                                  f"{w.output_len}", "decode returns n_tokens ids, prefill one (the next token)")
            if t1 <= t0:
                raise EngineError(f"non-positive elapsed time ({t1 - t0} ns) on the harness's clock")
            wns = body.get("worker_ns")
            reps.append(ClockedRep(t1 - t0, variant, [int(x) for x in ids],
                                   int(wns) if isinstance(wns, int) and not isinstance(wns, bool) else None,
                                   warmup=j < plan.warmup, logprobs=_logprobs(body.get("logprobs"), len(ids), w, j)))
        out.append([r for r in reps if not r.warmup])
    channel.send(encode("bye"))
    return out


def _logprobs(value: Any, n: int, w: Workload, j: int) -> list[float] | None:
    """The output's log-probs: None (an engine of an older contract) or n finite floats <= 0 (EngineError
    naming what is wrong otherwise)."""
    if value is None:
        return None
    ok = isinstance(value, list) and len(value) == n and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x <= 1e-6 for x in value)
    if not ok:
        raise EngineError(f"timed {w.phase} rep {j}: the output's logprobs are not {n} finite log-probabilities "
                          f"(<= 0): {value!r:.120}", "return one log-softmax value per output id, or none")
    return [float(x) for x in value]


def in_process_reps(engine: Engine, prepared: Prepared, workload: Workload, reveals: Sequence[tuple[int, ...]],
                    warmup: int = 1, clock: Clock = time.perf_counter_ns,
                    barrier: Callable[[], None] | None = None) -> list[Rep]:
    """begin -> synchronize -> t0 -> step(revealed) -> synchronize -> t1 in this process, one rep per reveal
    (the first `warmup` discarded). For the contract and bench scripts only: this clock is the engine's own
    process's, so no round takes it as a measurement."""
    if engine.clock != "harness":
        raise EngineError(f"engine {engine.name!r} is {engine.clock}-clocked; use engine.timed()")
    out: list[Rep] = []
    for i, revealed in enumerate(reveals):
        state = engine.begin(prepared, workload)
        engine.synchronize(prepared)
        if barrier is not None:
            barrier()
        t0 = clock()
        ids = as_step_output(engine.step(prepared, state, tuple(revealed))).token_ids
        engine.synchronize(prepared)
        if barrier is not None:
            barrier()
        t1 = clock()
        if len(ids) != workload.output_len:
            raise EngineError(f"engine {engine.name!r} returned {len(ids)} ids for a {workload.phase} rep "
                              f"(the contract wants {workload.output_len})",
                              "decode returns n_tokens ids, prefill one (the next token)")
        if t1 <= t0:
            raise EngineError(f"non-positive elapsed time ({t1 - t0} ns) timing {engine.name!r}")
        if i >= warmup:
            out.append(Rep(ns=t1 - t0, n_tokens=workload.n_tokens, token_ids=[int(x) for x in ids], clock="harness"))
    return out
