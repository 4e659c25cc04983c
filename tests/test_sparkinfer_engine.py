"""The sparkinfer plugin: the engine contract on the generated k3-mini, its code paths (logits = prefill path,
greedy decode = the timed path), its refusals, and (slow) agreement with the pinned llama.cpp."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from engines.sparkinfer.engine import SparkInferEngine, greedy_decode
from engines.sparkinfer.faults import GATE_FAULTS
from scoreboard import registry
from scoreboard.contract import run_contract
from scoreboard.engine import EngineTarget, Geometry, LogitsRequest, Workload
from scoreboard.errors import EngineError
from scoreboard.gate import gate_positions, grade_depth
from scoreboard.lockfile import load_lock
from scoreboard.round.prompt import draw_prompt
from scoreboard.round.clock import in_process_reps
from scoreboard.weights.generate import generate
from scoreboard.weights.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent
GEOM = Geometry(n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=1)  # the k3-mini-cpu target's, 1 thread (shared CI box)


def target(shards, geometry: Geometry = GEOM, **options) -> EngineTarget:
    return EngineTarget("k3-mini-cpu", shards[0], tuple(shards), "cpu", geometry, options=options)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[Path]:
    return generate("k3-mini", tmp_path_factory.mktemp("k3mini"))


@pytest.fixture(scope="module")
def prompt(shards) -> tuple[int, ...]:
    return draw_prompt(Tokenizer.from_gguf(shards[0]), 1100, seed=7).token_ids


@pytest.fixture(scope="module")
def prepared(shards):
    engine = SparkInferEngine()
    return engine, engine.prepare(target(shards), Path("unused"))


def test_the_contract_suite_passes(shards, prompt, tmp_path):
    engine = registry.load("sparkinfer")
    assert isinstance(engine, SparkInferEngine) and engine.clock == "harness"
    summary = run_contract(engine, target(shards), tmp_path, list(prompt), depth=300)
    assert summary["vocab"] == 512 and len(summary["decode_tokens"]) == 4


def test_describe_pins_the_source_and_what_would_run(shards):
    engine = SparkInferEngine()
    ident = engine.describe(target(shards, faults=["mla_as_mqa"]))
    assert ident == engine.describe(target(shards, faults=["mla_as_mqa"]))
    assert ident.engine == "sparkinfer" and ident.device == "cpu"
    assert ident.source["package"] == "engines.sparkinfer" and isinstance(ident.source["dirty"], bool)
    assert len(ident.source["commit"]) in (0, 40)
    assert ident.extra["dtype"] == "float32" and ident.extra["kv_cache"] == "float16"
    assert ident.extra["faults"] == ["mla_as_mqa"] and ident.extra["torch"] and ident.extra["gguf"]
    assert engine.describe(target(shards)).extra["faults"] == []
    with pytest.raises(EngineError, match="options.dtype"):
        engine.describe(target(shards, dtype="float8"))
    with pytest.raises(EngineError, match=r"options\.faults: .*unknown fault"):  # the typed options (options.py)
        engine.describe(target(shards, faults=["typo"]))


def test_prepare_refuses_what_it_cannot_run(shards, tmp_path):
    engine = SparkInferEngine()
    with pytest.raises(EngineError, match="differ from the model's own shard set"):
        engine.prepare(target(shards[:1] + shards[:1]), tmp_path)
    missing = tmp_path / "k3-mini-00001-of-00003.gguf"
    missing.write_bytes(shards[0].read_bytes())
    with pytest.raises(EngineError, match="missing shard"):
        engine.prepare(target([missing]), tmp_path)
    cuda = dataclasses.replace(target(shards), device="cuda")
    import torch
    if not torch.cuda.is_available():
        with pytest.raises(EngineError, match="no CUDA device"):
            engine.prepare(cuda, tmp_path)


def test_logits_rows_follow_the_request_and_echo_the_geometry(prepared, prompt):
    engine, prep = prepared
    ids = prompt[:600]
    res = engine.logits(prep, LogitsRequest(ids, (599, 10, 599, 300), GEOM))
    assert res.logits.dtype == np.float32 and res.logits.shape == (4, 512)
    assert np.array_equal(res.logits[0], res.logits[2])
    single = engine.logits(prep, LogitsRequest(ids[:11], (10,), GEOM)).logits[0]
    assert np.allclose(single, res.logits[1], atol=1e-3)  # row p only sees tokens[:p+1] (chunking moves ~1e-4)
    assert res.geometry.n_ubatch == 512 and res.geometry.n_threads >= 1
    with pytest.raises(EngineError, match="outside the 600 token ids"):
        engine.logits(prep, LogitsRequest(ids, (600,), GEOM))
    with pytest.raises(EngineError, match="outside the vocabulary"):
        engine.logits(prep, LogitsRequest((1, 2, 512), (2,), GEOM))
    with pytest.raises(EngineError, match="do not fit the pinned n_ctx"):
        engine.logits(prep, LogitsRequest(ids, (599,), dataclasses.replace(GEOM, n_ctx=512)))


def test_greedy_decode_is_the_timed_path_and_continues_the_logits_path(prepared, prompt):
    engine, prep = prepared
    depth, n = 700, 8
    wl, revealed = Workload.split("decode", depth, n, prompt)
    reps = in_process_reps(engine, prep, wl, [revealed] * 3, warmup=1)
    toks = greedy_decode(prep, prompt, depth, n)
    assert [r.token_ids for r in reps] == [toks, toks] and len(toks) == n
    assert all(r.ns > 0 and r.n_tokens == n for r in reps)
    # token i is the argmax after the context + tokens[:i] (what the round teacher-forces through the reference)
    seq = tuple(prompt[:depth]) + tuple(toks[:-1])
    pos = tuple(range(depth - 1, depth - 1 + n))
    forced = engine.logits(prep, LogitsRequest(seq, pos, GEOM)).logits.argmax(-1)
    assert list(forced) == toks


def test_decode_really_fills_the_depth(shards, prompt):
    import torch

    engine = SparkInferEngine()
    prep = engine.prepare(target(shards), Path("unused"))  # a fresh handle: its persistent cache never written
    wl, revealed = Workload.split("decode", 500, 4, prompt)
    state = engine.begin(prep, wl)
    assert state.cache.n_past == 499  # the known context; the token at 499 is revealed to step()
    for st in state.cache.layers.values():
        if hasattr(st, "latent"):  # MLA: exactly the known latent rows written
            assert bool((st.latent[:499].abs().sum(-1) > 0).all()) and not st.latent[499:].any()
        else:  # KDA: a non-trivial recurrent state
            assert float(st.s.abs().sum()) > 0 and torch.isfinite(st.s).all()
    assert len(engine.step(prep, state, revealed).token_ids) == 4 and state.cache.n_past == 503
    with pytest.raises(ValueError, match="exactly 10 prompt ids"):
        Workload("prefill", 10, 64, prompt[:20])
    state = engine.begin(prep, Workload.split("prefill", 10, 64, prompt)[0])
    with pytest.raises(EngineError, match="got 3 revealed ids, this workload reveals 64"):
        engine.step(prep, state, (1, 2, 3))


def test_prefill_step_ingests_the_tokens_and_returns_the_last_argmax(prepared, prompt):
    engine, prep = prepared
    wl, revealed = Workload.split("prefill", 100, 530, prompt)
    state = engine.begin(prep, wl)
    assert state.cache.n_past == 100
    out = engine.step(prep, state, revealed).token_ids
    assert state.cache.n_past == 630
    want = engine.logits(prep, LogitsRequest(prompt[:630], (629,), GEOM)).logits[0]
    assert out == [int(np.argmax(want))]


def test_prepare_is_cached_and_close_releases_the_handle(shards, prepared):
    engine, prep = prepared
    again = engine.prepare(target(shards), Path("unused"))
    assert again.identity == prep.identity and again.handle.model.w is prep.handle.model.w
    engine.close(again)
    with pytest.raises(EngineError, match="closed"):
        engine.logits(again, LogitsRequest((1, 2), (1,), GEOM))


# -- against the pinned llama.cpp ------------------------------------------------------------------

def _gate(ref_engine, ref_prep, shards, faults: list[str]) -> list:
    """Grade sparkinfer against the reference at the k3-mini-cpu target's gate depths, like the round."""
    lock = load_lock(REPO / "reference.lock")
    pol = lock.targets["k3-mini-cpu"].gate
    ids = draw_prompt(Tokenizer.from_gguf(shards[0]), max(pol.depths), seed=11).token_ids
    per = {d: gate_positions(d, pol.rows_per_depth) for d in pol.depths}
    positions = tuple(sorted({p for ps in per.values() for p in ps}))
    ref = ref_engine.logits(ref_prep, LogitsRequest(ids, positions, GEOM)).logits
    row = {p: i for i, p in enumerate(positions)}
    eng = SparkInferEngine()
    out = []
    for fault in [None, *faults]:
        prep = eng.prepare(target(shards, faults=[fault] if fault else []), Path("unused"))
        cand = eng.logits(prep, LogitsRequest(ids, positions, GEOM)).logits
        idx = {d: [row[p] for p in ps] for d, ps in per.items()}
        out.append((fault, [grade_depth(d, per[d], ref[idx[d]], cand[idx[d]], pol) for d in pol.depths]))
    return out


@pytest.fixture(scope="module")
def reference(shards):
    from llamacpp_fixtures import pinned_sdist_reference, test_cache_dir

    from engines.llamacpp.engine import LlamaCppEngine

    rid, ref = pinned_sdist_reference()
    engine = LlamaCppEngine()

    def prep(model_shards):
        t = dataclasses.replace(target(model_shards), reference=ref, options={"reference_id": rid})
        return engine.prepare(t, test_cache_dir())
    return engine, prep


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["k3-mini", "k3-mini-smooth"])
def test_agrees_with_llamacpp_well_inside_the_bars(reference, shards, preset, tmp_path):
    engine, prep = reference
    model = shards if preset == "k3-mini" else generate(preset, tmp_path)
    [(_, depths)] = _gate(engine, prep(model), model, [])
    pol = load_lock(REPO / "reference.lock").targets["k3-mini-cpu"].gate
    for d in depths:
        assert d.passed and d.top1 == 1.0, d.reasons
        assert d.kl_mean < pol.kl_max / 1000 and d.kl_p99 < pol.kl_p99_max / 1000  # margins of 1000x at least


@pytest.mark.slow
def test_every_injected_fault_fails_the_gate_on_k3_mini(reference, shards):
    engine, prep = reference
    results = dict(_gate(engine, prep(shards), shards, list(GATE_FAULTS)))
    assert all(d.passed for d in results.pop(None))
    for fault, depths in results.items():
        assert not any(d.passed for d in depths), fault  # refused at every gate depth
        assert all(d.kl_mean > 0.1 for d in depths), fault


def test_prefill_runs_in_chunks_of_at_least_2048_and_agrees_with_ubatch_chunks(prepared, prompt):
    """A prompt is fed in calls of max(n_ubatch, 2048) tokens (fewer launches); per token the result is the same
    as feeding it in n_ubatch-sized calls, up to float32 rounding."""
    import torch

    from engines.sparkinfer.engine import PREFILL_CHUNK, prefill, prefill_chunk

    assert prefill_chunk(dataclasses.replace(GEOM, n_ubatch=512)) == PREFILL_CHUNK == 2048
    assert prefill_chunk(dataclasses.replace(GEOM, n_ubatch=4096)) == 4096
    model = prepared[1].handle.model
    ids = torch.tensor(prompt[:700])
    pos = list(range(0, 700, 9))
    with torch.inference_mode():
        small = prefill(model, model.new_cache(1024), ids, 64, pos).double()
        whole = prefill(model, model.new_cache(1024), ids, prefill_chunk(GEOM), pos).double()
    ls, lw = torch.log_softmax(small, -1), torch.log_softmax(whole, -1)
    assert float((ls.exp() * (ls - lw)).sum(-1).max()) < 1e-8
    assert torch.equal(small.argmax(-1), whole.argmax(-1))
