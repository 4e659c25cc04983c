"""Executable engine contract: checks any engine plugin against scoreboard.engine's rules.

Third-party plugin authors run these against their engine (see docs/engines.md); the project's own
suite (tests/test_engine_contract.py) runs them over every registered engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .engine import Engine, EngineIdentity, EngineTarget, LogitsRequest, Prepared, StepOutput, Workload, as_step_output
from .errors import EngineError
from .gate import log_softmax64
from .round.clock import in_process_reps


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


def check_timed(engine: Engine, prepared: Prepared, workload: Workload, reveals: list[tuple[int, ...]],
                reps: int = 2, geometry=None) -> TimedCheck:
    """Timed reps in this process (the round times them in its own process, over the handshake). For a
    harness-clocked engine: begin() sees only `workload.prompt_ids`, step() gets each reveal and returns the
    contract's number of ids, the same output for the same reveal whatever ran before, and (with `geometry`)
    a first id equal to the argmax of the engine's own logits after the prompt and that reveal: the answer
    depends on what was revealed."""
    if engine.clock == "harness":
        _require(len(reveals) >= reps + 1, "internal: one reveal per rep (warm-up included)")
        out = in_process_reps(engine, prepared, workload, reveals[: reps + 1], warmup=1)
        again = in_process_reps(engine, prepared, workload, reveals[1: reps + 1], warmup=0)
        _require([r.token_ids for r in out] == [r.token_ids for r in again],
                 "step() must give the same output for the same reveal, whatever came before it")
    elif engine.clock == "reference-tool":
        out = engine.timed(prepared, workload, reps)
        _require(all(r.clock == "reference-tool" and r.command for r in out),
                 "reference-tool reps must say so and carry the exact command line")
    else:
        raise ContractViolation(f"unknown clock {engine.clock!r}")
    _require(len(out) == reps, f"timed must return exactly {reps} reps, got {len(out)}")
    _require(all(isinstance(r.ns, int) and r.ns > 0 for r in out), "every rep needs raw positive integer ns")
    _require(all(r.n_tokens == workload.n_tokens for r in out), "every rep must count the workload's tokens")
    if engine.clock == "harness":
        _require(all(len(r.token_ids) == workload.output_len for r in out),
                 f"a {workload.phase} step() returns {workload.output_len} id(s)")
        check_step_output(engine, prepared, workload, reveals[0])
        if geometry is not None:
            for revealed, r in zip(reveals[1: reps + 1], out):
                seq = tuple(workload.prompt_ids) + tuple(revealed)
                row = engine.logits(prepared, LogitsRequest(seq, (len(seq) - 1,), geometry)).logits[0]
                _require(r.token_ids[0] == int(np.argmax(row)),
                         f"a {workload.phase} step()'s first id must be the greedy next token after the prompt and "
                         "the revealed token(s) (the engine's own logits disagree)")
    return TimedCheck(workload.phase, len(out), [r.token_ids for r in out])


def check_step_output(engine: Engine, prepared: Prepared, workload: Workload, revealed: tuple[int, ...]) -> None:
    """Contract 3: step() returns a StepOutput whose log-probs are its ids' log-softmax in the rows step_logits()
    then gives, and each id is its row's argmax."""
    state = engine.begin(prepared, workload)
    raw = engine.step(prepared, state, tuple(revealed))
    _require(isinstance(raw, StepOutput), f"step() must return a StepOutput (contract 3), got {type(raw).__name__}")
    out = as_step_output(raw)
    _require(out.logprobs is not None and len(out.logprobs) == len(out.token_ids),
             "step() must return one log-prob per output id")
    rows = engine.step_logits(prepared)
    _require(isinstance(rows, np.ndarray) and rows.ndim == 2 and rows.shape[0] == len(out.token_ids),
             f"step_logits() must be [len(token_ids)={len(out.token_ids)}, vocab]")
    _require(bool(np.all(np.argmax(rows, axis=-1) == np.asarray(out.token_ids))),
             "every id step() returns must be the argmax of its step_logits() row")
    own = log_softmax64(rows)[np.arange(len(out.token_ids)), np.asarray(out.token_ids)]
    assert out.logprobs is not None
    _require(bool(np.all(np.abs(own - np.asarray(out.logprobs)) <= 1e-3)),
             "step()'s log-probs must be the log-softmax of its ids in its step_logits() rows")


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
        k = min(3, depth)  # a decode reveals K tokens (scoreboard.round.reveal); 3 here, distinct per rep
        dec_w = Workload("decode", depth, n_decode, tuple(prompt[: depth - k]), reveal=k)
        dec = check_timed(engine, prepared, dec_w, [tuple(int(t) for t in prompt[depth - k + i: depth + i])
                                                     for i in range(3)], geometry=target.geometry)
        pre_w = Workload("prefill", 0, n_prefill, ())
        pre = check_timed(engine, prepared, pre_w, [tuple(prompt[i: i + n_prefill]) for i in range(3)],
                          geometry=target.geometry)
    except EngineError:
        raise
    finally:
        engine.close(prepared)
        engine.close(again)
    return {"vocab": int(x.shape[1]), "decode_tokens": dec.token_ids[0], "prefill_reps": pre.reps}
