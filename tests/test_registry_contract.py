"""Registry (lazy, did-you-mean, injection) and the executable contract against fake engines.

The real engines run the same contract in tests/test_engine_contract.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from scoreboard import registry
from scoreboard.contract import ContractViolation, run_contract
from scoreboard.engine import Engine, EngineIdentity, EngineTarget, Geometry, LogitsResult, Prepared, StepOutput
from scoreboard.errors import InputError
from scoreboard.gate import log_softmax64

VOCAB = 32


class ToyEngine(Engine):
    """A deterministic bigram 'model': logits depend only on the last token."""

    name = "toy"
    clock = "harness"

    def describe(self, target):
        return EngineIdentity(engine=self.name, version="1", source={"package": "tests"})

    def prepare(self, target, cache_dir, progress=None):
        w = np.random.default_rng(0).normal(size=(VOCAB, VOCAB)).astype(np.float32)
        return Prepared(self.describe(target), handle=w)

    def logits(self, prepared, request):
        rows = prepared.handle[[request.token_ids[p] for p in request.positions]]
        return LogitsResult(rows.astype(np.float32), request.geometry)

    def begin(self, prepared, workload):
        return workload.phase, workload.n_tokens

    def step(self, prepared, state, revealed):
        phase, n = state
        out, rows = [], []
        last = revealed[-1]
        for _ in range(n if phase == "decode" else 1):
            rows.append(prepared.handle[last])
            last = int(np.argmax(rows[-1]))
            out.append(last)
        self._rows = np.stack(rows)  # contract 3: the rows step_logits() gives for the last step
        logprobs = log_softmax64(self._rows)[np.arange(len(out)), out]
        return StepOutput(out, [float(x) for x in logprobs])

    def step_logits(self, prepared):
        return self._rows


class Float64Engine(ToyEngine):
    name = "toy64"

    def logits(self, prepared, request):
        r = super().logits(prepared, request)
        return LogitsResult(r.logits.astype(np.float64), r.geometry)


class NondeterministicEngine(ToyEngine):
    name = "toyrand"
    _n = 0

    def step(self, prepared, state, revealed):
        NondeterministicEngine._n += 1
        return [NondeterministicEngine._n % VOCAB] * (state[1] if state[0] == "decode" else 1)


class PrecomputingEngine(ToyEngine):
    """Answers from what begin() saw (the known prompt's last token), ignoring the revealed one."""

    name = "toyprecompute"

    def begin(self, prepared, workload):
        return workload.phase, workload.n_tokens, workload.prompt_ids[-1] if workload.prompt_ids else 0

    def step(self, prepared, state, revealed):
        return super().step(prepared, state[:2], (state[2],))


def _target(tmp_path: Path) -> EngineTarget:
    return EngineTarget("toy", tmp_path / "m.gguf", (tmp_path / "m.gguf",), "cpu", Geometry(256, 64, 64, 1))


@pytest.fixture
def injected():
    for cls in (ToyEngine, Float64Engine, NondeterministicEngine, PrecomputingEngine):
        registry.inject(cls.name, cls)
    yield
    for cls in (ToyEngine, Float64Engine, NondeterministicEngine, PrecomputingEngine):
        registry.uninject(cls.name)


def test_builtins_are_registered_by_entry_point():
    assert {"llamacpp", "sparkinfer"} <= set(registry.available())


def test_unknown_engine_did_you_mean():
    with pytest.raises(InputError) as info:
        registry.load("sparkinfr")
    assert "did you mean 'sparkinfer'?" in info.value.hint


def test_injected_engine_loads_through_the_same_path(injected):
    assert isinstance(registry.load("toy"), ToyEngine)
    assert "toy" in registry.available()


def test_contract_passes_a_good_engine(injected, tmp_path):
    prompt = list(np.random.default_rng(1).integers(0, VOCAB, 200))
    summary = run_contract(registry.load("toy"), _target(tmp_path), tmp_path, prompt, depth=100)
    assert summary["vocab"] == VOCAB and len(summary["decode_tokens"]) == 4


def test_contract_catches_float64_logits(injected, tmp_path):
    with pytest.raises(ContractViolation, match="float32"):
        run_contract(registry.load("toy64"), _target(tmp_path), tmp_path, list(range(VOCAB)) * 4, depth=64)


def test_contract_catches_nondeterministic_greedy(injected, tmp_path):
    with pytest.raises(ContractViolation, match="same output for the same reveal"):
        run_contract(registry.load("toyrand"), _target(tmp_path), tmp_path, list(range(VOCAB)) * 4, depth=64)


def test_contract_catches_an_answer_that_ignores_the_reveal(injected, tmp_path):
    prompt = list(np.random.default_rng(1).integers(0, VOCAB, 200))
    with pytest.raises(ContractViolation, match="greedy next token after the prompt and the revealed"):
        run_contract(registry.load("toyprecompute"), _target(tmp_path), tmp_path, prompt, depth=100)
