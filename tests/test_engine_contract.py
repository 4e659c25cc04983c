"""The engine contract, run over EVERY registered engine on the default target's model (k3-mini).

Real parts: the pinned llama.cpp build (cached under $SCOREBOARD_CACHE), the bundled sparkinfer
engine, and the deterministic k3-mini weights verified against reference.lock.
"""

from __future__ import annotations

import pytest

from scoreboard import registry
from scoreboard.contract import run_contract
from scoreboard.engine import EngineTarget, Geometry
from scoreboard.lockfile import load_lock
from scoreboard.round.prompt import draw_prompt
from scoreboard.weights.tokenizer import Tokenizer
from scoreboard.weights.verify import default_cache, ensure_generated

TARGET = "k3-mini-cpu"


@pytest.fixture(scope="module")
def setup(lock_path_module):
    lock = load_lock(lock_path_module)
    t = lock.target(TARGET)
    cache = default_cache()
    shards = ensure_generated(lock, t.weights, cache)
    g = t.geometry
    target = EngineTarget(TARGET, shards[0], tuple(shards), "cpu",
                          Geometry(g["n_ctx"], g["n_batch"], g["n_ubatch"], g.get("n_threads", 0)),
                          reference=lock.references[t.reference])
    prompt = list(draw_prompt(Tokenizer.from_gguf(shards[0]), 600, seed=1).token_ids)
    return target, cache, prompt


@pytest.fixture(scope="module")
def lock_path_module():
    from pathlib import Path

    return Path(__file__).resolve().parent.parent / "reference.lock"


@pytest.mark.slow
@pytest.mark.parametrize("name", registry.available())
def test_engine_honours_the_contract(name, setup):
    target, cache, prompt = setup
    summary = run_contract(registry.load(name), target, cache, prompt, depth=256)
    assert summary["vocab"] == 512
