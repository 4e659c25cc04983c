"""sparkinfer's static-shape decode step (graph.py): on CPU it runs eagerly and must give the eager decode's
greedy tokens and logits; through the engine it is the decode path whenever options.cuda_graph is on. On a
CUDA box (skipped here) the captured graph is checked against the eager decode too."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from engines.sparkinfer.engine import SparkInferEngine, greedy_decode
from engines.sparkinfer.graph import SPAN_MIN, StaticDecoder, span_for
from engines.sparkinfer.model import K3Model
from engines.sparkinfer.weights import load_weights
from scoreboard.engine import EngineTarget, Geometry, Workload
from scoreboard.errors import EngineError
from scoreboard.models.k3 import load_k3_config
from scoreboard.weights.generate import generate

GEOM = Geometry(n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=1)
DEPTH, N = 200, 16


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=["k3-mini", "k3-mini-smooth"])
def shards(request, tmp_path_factory) -> list[Path]:
    return generate(request.param, tmp_path_factory.mktemp(request.param))


def _model(shards, device: str = "cpu", dtype=torch.float32) -> K3Model:
    cfg = load_k3_config(shards[0])
    return K3Model(cfg, load_weights(cfg, tuple(cfg.shards), device, dtype)[0])


def _prompt(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 510, (n,), generator=torch.Generator().manual_seed(seed))


def _eager(model: K3Model, ids: torch.Tensor, n_ctx: int, n: int) -> tuple[list[int], torch.Tensor]:
    """The engine's eager decode after a chunked prefill of ids: greedy tokens and each step's logits [n, V]."""
    from engines.sparkinfer.engine import prefill

    cache = model.new_cache(n_ctx)
    tok = prefill(model, cache, ids.to(model.device), 512, [len(ids) - 1]).argmax(-1)
    row0 = torch.zeros(1, dtype=torch.long, device=model.device)
    toks, rows = [], []
    for _ in range(n):
        logits = model.forward(tok, cache, row0)
        tok = logits.argmax(-1)
        toks.append(int(tok))
        rows.append(logits[0])
    return toks, torch.stack(rows)


def _static(dec: StaticDecoder, ids: torch.Tensor, n: int, junk: bool = False) -> tuple[list[int], torch.Tensor]:
    """The same through StaticDecoder.step (the function a CUDA graph records): tokens and logits [n, V]."""
    from engines.sparkinfer.engine import prefill

    cache = dec.reset(len(ids) + n)
    tok = prefill(dec.model, cache, ids.to(dec.model.device), 512, [len(ids) - 1]).argmax(-1)
    dec.check()
    if junk:  # stale rows past the context: the mask must hide them
        for st in cache.layers.values():
            if hasattr(st, "latent"):
                st.latent[len(ids):].uniform_(-4, 4, generator=torch.Generator().manual_seed(1))
    dec.tok.copy_(tok)
    dec.pos.fill_(cache.n_past)
    rows = []
    for _ in range(n):
        dec.step(dec.span)
        rows.append(dec.logits[0].clone())
    toks = dec.hist[len(ids):len(ids) + n].tolist()
    assert int(dec.pos) == len(ids) + n and int(dec.tok) == toks[-1]
    return toks, torch.stack(rows)


def test_span_is_a_power_of_two_covering_the_workload_within_n_ctx():
    assert span_for(1, 4096) == SPAN_MIN == span_for(SPAN_MIN, 4096)
    assert span_for(SPAN_MIN + 1, 4096) == 2 * SPAN_MIN and span_for(576, 4096) == 1024
    assert span_for(3000, 3000) == 3000 and span_for(100, 128) == 128


def test_static_step_gives_the_eager_tokens_and_logits(shards):
    with torch.inference_mode():
        model = _model(shards)
        ids = _prompt(DEPTH)
        want_toks, want = _eager(model, ids, GEOM.n_ctx, N)
        dec = StaticDecoder(model, GEOM.n_ctx, capture=False)
        toks, got = _static(dec, ids, N)
        assert toks == want_toks and len(set(toks)) > 1
        assert float((got - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max()))
        # rows beyond the position are masked, whatever they hold; a reset starts the next sequence clean
        toks2, got2 = _static(dec, ids, N, junk=True)
        assert toks2 == toks and torch.equal(got2, got)
        toks3, got3 = _static(dec, ids, N)
        assert toks3 == toks and torch.equal(got3, got)


def test_static_step_at_depth_zero_and_a_full_span(shards):
    with torch.inference_mode():
        model = _model(shards)
        ids = _prompt(SPAN_MIN - 8, seed=5)
        want_toks, want = _eager(model, ids, SPAN_MIN, 8)  # fills every row of the span (= n_ctx)
        dec = StaticDecoder(model, SPAN_MIN, capture=False)
        toks, got = _static(dec, ids, 8)
        assert dec.span == SPAN_MIN and toks == want_toks
        assert float((got - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max()))
        with pytest.raises(EngineError, match="overruns the span"):
            dec.run(torch.tensor([1]), 9)
        with pytest.raises(EngineError, match="do not fit"):
            dec.reset(SPAN_MIN + 1)
        dec.reset(4)  # depth 0: the first token is fed at position 0
        assert dec.run(ids[:1], 4)[0] == _eager_from_empty(model, int(ids[0]), 4)


def _eager_from_empty(model: K3Model, first: int, n: int) -> list[int]:
    cache = model.new_cache(SPAN_MIN)
    tok, out = torch.tensor([first]), []
    for _ in range(n):
        tok = model.forward(tok, cache, torch.zeros(1, dtype=torch.long)).argmax(-1)
        out.append(int(tok))
    return out


# -- through the engine -------------------------------------------------------------------------

def _target(shards, device: str = "cpu", **options) -> EngineTarget:
    return EngineTarget("k3-mini-cpu", shards[0], tuple(shards), device, GEOM, options=options)


def test_the_option_is_recorded_and_refused_where_it_cannot_run(shards):
    engine = SparkInferEngine()
    assert engine.describe(_target(shards)).extra["cuda_graph"] is False
    assert engine.describe(_target(shards, "cuda")).extra["cuda_graph"] is True  # describe is GPU-free
    assert engine.describe(_target(shards, "cuda", cuda_graph=False)).extra["cuda_graph"] is False
    assert engine.describe(_target(shards, cuda_graph=False)).extra["cuda_graph"] is False
    with pytest.raises(EngineError, match="options.cuda_graph: CUDA graphs need a cuda target"):
        engine.describe(_target(shards, cuda_graph=True))
    with pytest.raises(EngineError, match="options.cuda_graph: Input should be a valid boolean"):
        engine.describe(_target(shards, "cuda", cuda_graph="yes"))


def test_engine_static_decode_equals_the_eager_engine(shards):
    """begin/step on the static path (what a CUDA target captures), forced on for a cpu target."""
    engine = SparkInferEngine()
    eager = engine.prepare(_target(shards), Path("unused"))
    static = engine.prepare(_target(shards), Path("unused"))
    static.handle.static_decode = True
    prompt = tuple(_prompt(DEPTH + N).tolist())
    for depth, n in ((DEPTH, N), (1, 6), (37, 3)):
        assert greedy_decode(static, prompt, depth, n) == greedy_decode(eager, prompt, depth, n), (depth, n)
    wl, revealed = Workload.split("decode", DEPTH, 4, prompt)
    first = engine.begin(static, wl)
    assert first.cache is static.handle.decoder.cache and first.cache.n_past == DEPTH - 1
    second = engine.begin(static, wl)
    with pytest.raises(EngineError, match="superseded by a later begin"):
        engine.step(static, first, revealed)
    assert engine.step(static, second, revealed).token_ids == greedy_decode(eager, prompt, DEPTH, 4)
    assert second.cache.n_past == DEPTH - 1 + 4
    # a prefill workload fills the same persistent buffers, and ingests its tokens eagerly
    pre_wl, pre_revealed = Workload.split("prefill", 10, 20, prompt)
    prefill = engine.begin(static, pre_wl)
    assert prefill.cache is static.handle.decoder.cache and not static.handle.decoder.graphs
    assert engine.step(static, prefill, pre_revealed).token_ids == \
        engine.step(eager, engine.begin(eager, pre_wl), pre_revealed).token_ids


@pytest.mark.gpu
def test_captured_graph_gives_the_eager_tokens_on_cuda(shards):
    engine = SparkInferEngine()
    graph = engine.prepare(_target(shards, "cuda"), Path("unused"))
    eager = engine.prepare(_target(shards, "cuda", cuda_graph=False), Path("unused"))
    prompt = tuple(_prompt(DEPTH + N).tolist())
    toks = greedy_decode(graph, prompt, DEPTH, N)
    assert graph.handle.decoder.graphs and toks == greedy_decode(eager, prompt, DEPTH, N)
    assert greedy_decode(graph, prompt, DEPTH, N) == toks  # replayed again after a reset
