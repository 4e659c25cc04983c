"""Tiny deterministic engines for fast round tests: no torch, no llama.cpp, no weights read.

Both engines compute the same toy "model": the next-token logits after a prefix are a pseudo-random
float32 vector seeded by the prefix (`row`), so a correct candidate agrees with the reference exactly and
its greedy outputs are the reference's argmax. The reference (`ToyReference`, clock "reference-tool")
runs in the round's own process; the candidate (`ToyEngine`, clock "harness") runs in the round's
workers, so this file is also copied into a candidate tree as `engines/toy/engine.py` and reached through
the registry's entry point "engines.toy.engine:ToyEngine" (tests/test_round_fast.py).

The candidate's `mode` option picks a behaviour: "ok", "wrong_logits" (logits of another model, its
outputs still self-consistent), "raise_in_prepare" (an engine bug), "exit_in_prepare" (the process dies
without a result), "forge_result" (the process writes a malformed result file and exits), "lossy_when_timed"
(a cheaper, slightly wrong step taken only when the clock's FIFOs are there: its greedy ids are the honest
ones, its log-probs are not) and "decode_scaled" (a decode-only bug: the one-token step's logits are the right
ones times 1.5, so every argmax, and so every greedy id, is right while the rows are not).
A tree that holds `engines/toy/VARY` (a commit's own file, not an option: options are the target's, the same
for every arm) decodes differently on every other launch: "last" flips a decode's last token (a run-dependent
sum order that moves one argmax), "all" flips every token (a broken commit). A tree that holds
`engines/toy/SLOW` (a number) takes that many times as long per decoded token: a commit that made decode slower.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from scoreboard.engine import Engine, EngineIdentity, LogitsResult, Prepared, Rep, StepOutput

VOCAB = 64
_LAUNCH = 0  # this process's launch number among the launches of its tree (VARY only)
STEP_S = 0.002  # per forward: a rate well under any ceiling, and samples a real clock cannot repeat exactly


class ToyOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # path_by_launch: the engine picks its code path at start-up and says so in its identity (here: by pid)
    mode: Literal["ok", "wrong_logits", "raise_in_prepare", "exit_in_prepare", "forge_result", "path_by_launch",
                  "lossy_when_timed", "decode_scaled"] = "ok"


def row(prefix: tuple[int, ...] | list[int], salt: bytes = b"") -> np.ndarray:
    """The toy model's next-token logits after `prefix`: float32 [VOCAB]."""
    digest = hashlib.sha256(salt + np.asarray(prefix, dtype=np.int64).tobytes()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little")).standard_normal(VOCAB).astype(np.float32)


def _logits(token_ids: tuple[int, ...], positions: tuple[int, ...], salt: bytes = b"") -> np.ndarray:
    return np.stack([row(token_ids[: p + 1], salt) for p in positions]) if positions else np.zeros((0, VOCAB))


def _identity(name: str, target, mode: str) -> EngineIdentity:
    return EngineIdentity(engine=name, version="toy-1", source={"toy": True}, device=target.device,
                          extra={"mode": mode})


class ToyReference(Engine):
    name = "toy-ref"
    clock = "reference-tool"

    def describe(self, target):
        return _identity(self.name, target, "reference")

    def prepare(self, target, cache_dir, progress=None):
        return Prepared(self.describe(target))

    def logits(self, prepared, request):
        return LogitsResult(_logits(request.token_ids, request.positions), request.geometry)

    def timed(self, prepared, workload, reps):
        out = []
        for _ in range(reps):
            t0 = time.perf_counter_ns()
            time.sleep(STEP_S * (workload.n_tokens if workload.phase == "decode" else 1))
            out.append(Rep(time.perf_counter_ns() - t0, workload.n_tokens, clock="reference-tool",
                           command=["toy-reference", workload.phase, str(workload.depth), str(workload.n_tokens)]))
        return out


class ToyEngine(Engine):
    name = "toy"
    clock = "harness"

    def describe(self, target):
        return _identity(self.name, target, ToyOptions(**target.options).mode)

    def prepare(self, target, cache_dir, progress=None):
        mode = ToyOptions(**target.options).mode
        if mode == "raise_in_prepare":
            raise RuntimeError("the toy engine's prepare crashed")
        if mode == "exit_in_prepare":
            os._exit(7)
        if mode == "forge_result":  # the worker's argv: REQUEST.json RESULT.json
            Path(sys.argv[2]).write_text('{"protocol": "scoreboard-worker/2", "ok": true, "rank": "zero"}')
            os._exit(0)
        ident = self.describe(target)
        _count_launch()
        if mode == "path_by_launch":
            ident = EngineIdentity(engine=ident.engine, version=ident.version, source=ident.source,
                                   device=ident.device, extra={**ident.extra, "pid": os.getpid()})
        self.mode = mode
        self.rows: np.ndarray = np.zeros((0, VOCAB), np.float32)
        return Prepared(ident, handle=b"wrong" if mode == "wrong_logits" else b"")

    def logits(self, prepared, request):
        return LogitsResult(_logits(request.token_ids, request.positions, prepared.handle), request.geometry)

    def begin(self, prepared, workload):
        return list(workload.prompt_ids), workload

    def step(self, prepared, state, revealed):
        seq, workload = list(state[0]) + list(revealed), state[1]
        step_s = STEP_S * _slow()
        if workload.phase == "prefill":
            time.sleep(STEP_S)
            rows = [self._row(seq, prepared.handle)]
            return self._output(rows, [int(np.argmax(rows[0]))])
        vary = _vary()
        out, rows = [], []
        for k in range(workload.n_tokens):
            time.sleep(step_s)
            r = self._row(seq, prepared.handle)
            if self.mode == "decode_scaled":
                r = r * np.float32(1.5)
            tok = int(np.argmax(r))
            if _LAUNCH % 2 and (vary == "all" or (vary == "last" and k == workload.n_tokens - 1)):
                tok = (tok + 1) % VOCAB
            out.append(tok)
            rows.append(r)
            seq.append(tok)
        return self._output(rows, out)

    def _row(self, seq: list[int], salt: bytes) -> np.ndarray:
        r = row(seq, salt)
        if self.mode == "lossy_when_timed" and os.path.exists("clock.to-worker"):  # only under the clock
            top = int(np.argmax(r))
            r = r * np.float32(0.9)
            r[top] = r[top] / np.float32(0.9)  # the argmax stays where it was: the greedy ids agree
        return r

    def _output(self, rows: list[np.ndarray], ids: list[int]) -> StepOutput:
        self.rows = np.stack(rows).astype(np.float32)
        z = self.rows.astype(np.float64)
        lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
        return StepOutput(ids, [float(z[i, t] - lse[i]) for i, t in enumerate(ids)])

    def step_logits(self, prepared):
        return self.rows


def _slow() -> float:
    f = Path(__file__).with_name("SLOW")
    return float(f.read_text()) if f.exists() else 1.0


def _vary() -> str:
    f = Path(__file__).with_name("VARY")
    return f.read_text().strip() if f.exists() else ""


def _count_launch() -> None:
    """Number this launch among its tree's launches (a counter outside the tree: the tree stays clean)."""
    global _LAUNCH
    if not _vary():
        return
    import tempfile

    key = hashlib.sha256(str(Path(__file__).resolve()).encode()).hexdigest()[:16]
    counter = Path(tempfile.gettempdir()) / f"toy-launches-{key}"
    n = int(counter.read_text()) + 1 if counter.exists() else 0
    counter.write_text(str(n))
    _LAUNCH = n
