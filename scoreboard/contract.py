"""Executable engine contract: checks any engine plugin against scoreboard.engine's rules.

Third-party plugin authors run these against their engine (see docs/engines.md); the project's own
suite (tests/test_engine_contract.py) runs them over every registered engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .engine import Engine, EngineIdentity, EngineTarget, LogitsRequest, Prepared, Workload
from .errors import EngineError
from .timing import time_reps


class ContractViolation(AssertionError):
    """An engine broke a rule of the contract; the message names the rule."""


def _require(cond: bool, rule: str) -> None:
    if not cond:
        raise ContractViolation(rule)


def check_describe(engine: Engine, target: EngineTarget) -> EngineIdentity:
    a, b = engine.describe(target), engine.describe(target)
    _require(isinstance(a, EngineIdentity), "describe() must return an EngineIdentity")
    _require(a == b, "describe() must be deterministic")
    _require(a.engine == engine.name, f"describe().engine must be the engine id {engine.name!r}, got {a.engine!r}")
    _require(bool(a.source), "describe().source must pin where the engine's code comes from")
    return a


def check_logits(engine: Engine, prepared: Prepared, token_ids: list[int], positions: list[int],
                 target: EngineTarget) -> np.ndarray:
    req = LogitsRequest(tuple(token_ids), tuple(positions), target.geometry)
    r1 = engine.logits(prepared, req)
    x = r1.logits
    _require(isinstance(x, np.ndarray), "logits must be a numpy array")
    _require(x.dtype == np.float32, f"logits must be float32, got {x.dtype}")
    _require(x.ndim == 2 and x.shape[0] == len(positions), f"logits must be [rows={len(positions)}, vocab], got {x.shape}")
    _require(bool(np.isfinite(x).all()), "logits must be finite")
    _require(r1.geometry.n_ubatch == target.geometry.n_ubatch and r1.geometry.n_batch == target.geometry.n_batch,
             "logits must echo the pinned batch geometry")
    r2 = engine.logits(prepared, req)
    _require(np.array_equal(r1.logits, r2.logits), "logits must be bit-identical on a repeated call")
    return x


@dataclass
class TimedCheck:
    phase: str
    reps: int
    token_ids: list[list[int]]


def check_timed(engine: Engine, prepared: Prepared, workload: Workload, reps: int = 2) -> TimedCheck:
    if engine.clock == "harness":
        out = time_reps(engine, prepared, workload, reps=reps, warmup=1)
    elif engine.clock == "reference-tool":
        out = engine.timed(prepared, workload, reps)
        _require(all(r.clock == "reference-tool" and r.command for r in out),
                 "reference-tool reps must say so and carry the exact command line")
    else:
        raise ContractViolation(f"unknown clock {engine.clock!r}")
    _require(len(out) == reps, f"timed must return exactly {reps} reps, got {len(out)}")
    _require(all(isinstance(r.ns, int) and r.ns > 0 for r in out), "every rep needs raw positive integer ns")
    _require(all(r.n_tokens == workload.n_tokens for r in out), "every rep must count the workload's tokens")
    if engine.clock == "harness" and workload.phase == "decode":
        first = out[0].token_ids
        _require(all(r.token_ids == first for r in out), "greedy decode must give the same tokens every rep")
    return TimedCheck(workload.phase, len(out), [r.token_ids for r in out])


def run_contract(engine: Engine, target: EngineTarget, cache_dir: Path, prompt: list[int],
                 depth: int, n_decode: int = 4, n_prefill: int = 64) -> dict[str, object]:
    """Run every check; returns a small summary. Raises ContractViolation naming the broken rule."""
    check_describe(engine, target)
    prepared = engine.prepare(target, cache_dir)
    again = engine.prepare(target, cache_dir)
    _require(prepared.identity == again.identity, "prepare() must be idempotent (same identity twice)")
    try:
        positions = sorted({0, depth // 2, depth - 1})
        x = check_logits(engine, prepared, prompt[:depth], positions, target)
        dec = check_timed(engine, prepared, Workload("decode", depth, n_decode, tuple(prompt[: depth + n_decode])))
        pre = check_timed(engine, prepared, Workload("prefill", 0, n_prefill, tuple(prompt[:n_prefill])))
    except EngineError:
        raise
    finally:
        engine.close(prepared)
        engine.close(again)
    return {"vocab": int(x.shape[1]), "decode_tokens": dec.token_ids[0], "prefill_reps": pre.reps}
