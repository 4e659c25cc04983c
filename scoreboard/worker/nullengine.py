"""The harness's own null engine: no model, no work, through the same launch and clock handshake.

Every round runs it in a fresh worker (the same command, scratch directory and FIFO handshake as a
candidate's timed block) to measure what the handshake itself costs per timed rep; the receipt records
that round trip next to the samples. It is not an entry point (``scoreboard.engines``), so a lock cannot
name it as a target's engine: the worker loads it only when the harness's own request asks for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..engine import Engine, EngineIdentity, EngineTarget, LogitsRequest, LogitsResult, Prepared, StepOutput, Workload

NAME = "scoreboard-null"


class NullEngine(Engine):
    """begin() keeps the workload; step() echoes the revealed token (decode) or the last revealed token
    (prefill), so its output is known to the harness and checked like any other."""

    name = NAME
    clock = "harness"
    max_ranks = 1024

    def describe(self, target: EngineTarget) -> EngineIdentity:
        return EngineIdentity(engine=NAME, version="1", source={"package": "scoreboard.worker.nullengine"},
                              device=target.device)

    def prepare(self, target: EngineTarget, cache_dir: Path, progress: Any = None) -> Prepared:
        return Prepared(self.describe(target))

    def logits(self, prepared: Prepared, request: LogitsRequest) -> LogitsResult:
        return LogitsResult(np.zeros((len(request.positions), 1), np.float32), request.geometry)

    def begin(self, prepared: Prepared, workload: Workload) -> Workload:
        return workload

    def step(self, prepared: Prepared, state: Workload, revealed: tuple[int, ...]) -> StepOutput:
        out = expected_output(state, revealed)
        return StepOutput(out, [0.0] * len(out))


def expected_output(workload: Workload, revealed: tuple[int, ...]) -> list[int]:
    """What the null engine returns for a reveal (the harness checks it)."""
    return [int(revealed[-1])] * workload.output_len
