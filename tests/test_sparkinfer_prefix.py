"""Restored prefills (engines/sparkinfer/prefix.py): every begin() of a prepared sparkinfer leaves exactly the state
a prefill of its known ids from zero would, bit for bit, while restoring what an earlier begin() of the same prefix
prefilled; rows below a snapshot's length are never overwritten, and the snapshots are bounded."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import engines.sparkinfer.engine as E  # noqa: E402
from engines.sparkinfer.prefix import SNAPSHOTS_MAX, PrefixStore  # noqa: E402
from scoreboard.engine import EngineTarget, Geometry, Workload  # noqa: E402
from scoreboard.errors import EngineError  # noqa: E402
from scoreboard.round.prompt import draw_prompt  # noqa: E402
from scoreboard.weights.generate import generate  # noqa: E402
from scoreboard.weights.tokenizer import Tokenizer  # noqa: E402

CHUNK = 64  # the prefill's call size here (engine.PREFILL_CHUNK patched): several aligned calls in a short prompt
GEOM = Geometry(n_ctx=1024, n_batch=64, n_ubatch=64, n_threads=1)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[Path]:
    return generate("k3-mini", tmp_path_factory.mktemp("k3mini"))


@pytest.fixture(scope="module")
def prompt(shards) -> tuple[int, ...]:
    return draw_prompt(Tokenizer.from_gguf(shards[0]), 900, seed=5).token_ids


@pytest.fixture(autouse=True)
def small_calls(monkeypatch):
    monkeypatch.setattr(E, "PREFILL_CHUNK", CHUNK)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _prepared(shards, static: bool, device: str = "cpu", **options):
    engine = E.SparkInferEngine()
    prep = engine.prepare(EngineTarget("k3-mini-cpu", shards[0], tuple(shards), device, GEOM, options=options),
                          Path("unused"))
    prep.handle.static_decode = static  # the CUDA targets' path (captured there), run eagerly on CPU
    return engine, prep


def _fresh(model, ids: tuple[int, ...]):
    cache = model.new_cache(GEOM.n_ctx)
    if ids:
        E.prefill(model, cache, torch.tensor(ids, device=model.device), CHUNK, [])
    return cache


def _assert_same_state(cache, fresh) -> None:
    """The state a prefill from zero leaves: n_past, every KDA state and the latent rows below n_past, exactly."""
    assert cache.n_past == fresh.n_past
    for il, st in fresh.layers.items():
        got = cache.layers[il]
        if hasattr(st, "latent"):
            assert torch.equal(got.latent[:fresh.n_past], st.latent[:fresh.n_past]), il
        else:
            assert torch.equal(got.conv, st.conv) and torch.equal(got.s, st.s), il


def _begin(engine, prep, phase: str, depth: int, prompt, n: int = 4):
    wl, revealed = Workload.split(phase, depth, n, prompt)
    state = engine.begin(prep, wl)
    return state, revealed, wl.prompt_ids


@pytest.mark.parametrize("static", [False, True])
def test_every_begin_leaves_the_state_of_a_prefill_from_zero(shards, prompt, static):
    engine, prep = _prepared(shards, static)
    model = prep.handle.model
    store = lambda: prep.handle.context.store  # noqa: E731
    with torch.inference_mode():
        state, revealed, known = _begin(engine, prep, "decode", 300, prompt)  # known 299: a snapshot at 256
        _assert_same_state(state.cache, _fresh(model, known))
        assert store().restored == 0 and [len(s.ids) for s in store().snapshots] == [256]
        first = engine.step(prep, state, revealed).token_ids  # writes rows 299.. (none below 256)
        state, revealed, known = _begin(engine, prep, "decode", 300, prompt)  # the next rep: restored
        assert store().restored == 256
        _assert_same_state(state.cache, _fresh(model, known))
        assert engine.step(prep, state, revealed).token_ids == first
        state, _, known = _begin(engine, prep, "decode", 700, prompt)  # a nested prefix: restored, extended
        assert store().restored == 256 and [len(s.ids) for s in store().snapshots] == [640, 256]
        _assert_same_state(state.cache, _fresh(model, known))
        state, revealed, known = _begin(engine, prep, "prefill", 650, prompt, n=30)  # a prefill workload too
        assert store().restored == 640
        _assert_same_state(state.cache, _fresh(model, known))
        want = engine.logits(prep, E.LogitsRequest(prompt[:680], (679,), GEOM)).logits[0]
        assert engine.step(prep, state, revealed).token_ids == [int(want.argmax())]
        other = (prompt[0] + 1,) + tuple(prompt[1:])  # the same length, another first id: nothing to restore
        state, _, known = _begin(engine, prep, "decode", 700, other)
        assert store().restored == 0 and [s.ids[0] for s in store().snapshots] == [other[0]]
        _assert_same_state(state.cache, _fresh(model, known))
        state, revealed, known = _begin(engine, prep, "decode", 300, prompt)  # the first prompt's rows are gone
        assert store().restored == 0
        _assert_same_state(state.cache, _fresh(model, known))
        assert engine.step(prep, state, revealed).token_ids == first


def test_a_write_below_a_snapshot_is_refused_and_the_next_begin_starts_over(shards, prompt):
    engine, prep = _prepared(shards, static=True)
    model = prep.handle.model
    with torch.inference_mode():
        state, _, known = _begin(engine, prep, "decode", 300, prompt)
        mla = next(st for st in state.cache.layers.values() if hasattr(st, "latent"))
        mla.latent[10, 3] += 1.0  # a write that bypassed the store, below the snapshot's 256 rows
        with pytest.raises(EngineError, match=r"latent rows below a prefix snapshot's length \(256\) changed"):
            _begin(engine, prep, "decode", 300, prompt)
        state, revealed, known = _begin(engine, prep, "decode", 300, prompt)
        assert prep.handle.context.store.restored == 0
        _assert_same_state(state.cache, _fresh(model, known))


def test_decode_writes_drop_the_snapshots_they_reach(shards, prompt):
    """A shorter prompt's begin and step write from its own length on: a longer snapshot of the same prompt
    loses its rows and goes; a later begin restores the longest one that kept them."""
    engine, prep = _prepared(shards, static=False)
    with torch.inference_mode():
        _begin(engine, prep, "decode", 700, prompt)  # snapshot at 640
        state, revealed, _ = _begin(engine, prep, "decode", 300, prompt)  # restores nothing shorter: prefills 0..298
        store = prep.handle.context.store
        assert store.restored == 0 and [len(s.ids) for s in store.snapshots] == [256]
        engine.step(prep, state, revealed)
        _begin(engine, prep, "decode", 700, prompt)
        assert store.restored == 256


def test_snapshots_are_bounded_longest_first_and_fixed_in_size(shards, prompt):
    engine, prep = _prepared(shards, static=False)
    with torch.inference_mode():
        for depth in (100, 200, 300, 400, 500, 600, 700, 800):  # nested, as the harness orders a launch's metrics
            _begin(engine, prep, "decode", depth, prompt)
    store = prep.handle.context.store
    lengths = [len(s.ids) for s in store.snapshots]
    assert lengths == [768, 640, 576, 448][:SNAPSHOTS_MAX] and len(lengths) == SNAPSHOTS_MAX
    sizes = {s.nbytes for s in store.snapshots}
    cfg = prep.handle.cfg
    per_kda = 4 * (3 * cfg.kda_inner * (cfg.ssm_conv_kernel - 1) + cfg.n_head * cfg.kda_head_dim ** 2)
    assert sizes == {per_kda * len(cfg.kda_layers)} and store.nbytes == SNAPSHOTS_MAX * per_kda * len(cfg.kda_layers)


def test_the_store_refuses_nonsense_settings():
    with pytest.raises(ValueError, match="chunk 0"):
        PrefixStore(0)


@pytest.mark.gpu
def test_restored_begins_are_bit_exact_on_cuda_with_the_kernels_and_the_graph(shards, prompt):
    """On the GPU targets' path (float16, the Triton kernels checked at prepare, the captured graph): each begin()
    equals a prefill from zero on the same device, bit for bit, restored or not, and the graph decodes the same
    ids after each."""
    engine, prep = _prepared(shards, True, "cuda", dtype="float16", cuda_graph=True)
    model = prep.handle.model
    assert prep.identity.extra["kernels"].startswith("triton") and model.use_kernels
    with torch.inference_mode():
        outs = []
        for depth, restored in ((300, 0), (300, 256), (700, 256), (700, 640)):
            state, revealed, known = _begin(engine, prep, "decode", depth, prompt)
            assert prep.handle.context.store.restored == restored
            _assert_same_state(state.cache, _fresh(model, known))
            outs.append(engine.step(prep, state, revealed).token_ids)
        assert prep.handle.decoder.graphs and outs[0] == outs[1] and outs[2] == outs[3]
