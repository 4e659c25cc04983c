"""The harness's clock: times harness-clocked engines around begin/step with device synchronization."""

from __future__ import annotations

import time
from typing import Callable

from .engine import Engine, Prepared, Rep, Workload
from .errors import EngineError

Clock = Callable[[], int]


def time_reps(engine: Engine, prepared: Prepared, workload: Workload, reps: int, warmup: int = 1,
              clock: Clock = time.perf_counter_ns, barrier: Callable[[], None] | None = None) -> list[Rep]:
    """Run `warmup` discarded reps then `reps` timed reps; the harness reads the clock, not the engine.

    Each rep: begin() (untimed: fills the depth, allocates) -> synchronize -> t0 -> step() ->
    synchronize -> t1. Decode reps must return exactly n_tokens generated ids.

    Across ranks (scoreboard.distributed) every rank runs this with the group's `barrier`:
    synchronize -> barrier -> t0 -> step() -> synchronize -> barrier -> t1, and only rank 0's
    readings are kept: the second barrier makes t1 the moment the slowest rank finished.
    """
    if engine.clock != "harness":
        raise EngineError(f"engine {engine.name!r} is {engine.clock}-clocked; use engine.timed()")
    out: list[Rep] = []
    for i in range(warmup + reps):
        state = engine.begin(prepared, workload)
        engine.synchronize(prepared)
        if barrier is not None:
            barrier()
        t0 = clock()
        ids = list(engine.step(prepared, state))
        engine.synchronize(prepared)
        if barrier is not None:
            barrier()
        t1 = clock()
        if workload.phase == "decode" and len(ids) != workload.n_tokens:
            raise EngineError(f"engine {engine.name!r} returned {len(ids)} tokens for a decode of "
                              f"{workload.n_tokens}", "the engine must generate exactly n_tokens tokens")
        if t1 <= t0:
            raise EngineError(f"non-positive elapsed time ({t1 - t0} ns) timing {engine.name!r}")
        if i >= warmup:
            out.append(Rep(ns=t1 - t0, n_tokens=workload.n_tokens, token_ids=[int(x) for x in ids],
                           clock="harness"))
    return out
