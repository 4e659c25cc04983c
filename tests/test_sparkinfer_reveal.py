"""sparkinfer against the engine contract's version 3 (the harness side is the integrator's): a decode reveals
K >= 1 tokens (begin() gets prompt[:depth-K], step() consumes the K in order, then generates), step() returns
StepOutput(token_ids, logprobs) with each log-probability computed on the device from the logits row whose argmax
the id is, and step_logits() returns those rows (decode) or the last position's row (prefill), kept on the device by
the step itself."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from engines.sparkinfer.engine import SparkInferEngine, greedy_decode  # noqa: E402
from scoreboard.engine import EngineTarget, Geometry, LogitsRequest, StepOutput, Workload  # noqa: E402
from scoreboard.errors import EngineError  # noqa: E402
from scoreboard.round.prompt import draw_prompt  # noqa: E402
from scoreboard.weights.generate import generate  # noqa: E402
from scoreboard.weights.tokenizer import Tokenizer  # noqa: E402

GEOM = Geometry(n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=1)


def reveal(prompt, depth: int, n: int, k: int) -> tuple[Workload, tuple[int, ...]]:
    return Workload.split("decode", depth, n, prompt, reveal=k)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[Path]:
    return generate("k3-mini", tmp_path_factory.mktemp("k3mini"))


@pytest.fixture(scope="module")
def prompt(shards) -> tuple[int, ...]:
    return draw_prompt(Tokenizer.from_gguf(shards[0]), 700, seed=9).token_ids


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=["eager", "static"])
def prepared(request, shards):
    engine = SparkInferEngine()
    prep = engine.prepare(EngineTarget("k3-mini-cpu", shards[0], tuple(shards), "cpu", GEOM), Path("unused"))
    prep.handle.static_decode = request.param == "static"  # the CUDA graph's step, run eagerly on CPU
    return engine, prep


def _check_rows(engine, prep, out: StepOutput) -> np.ndarray:
    """The rows of the last step: one per id, each id its row's argmax, each logprob its row's log-softmax there."""
    rows = engine.step_logits(prep)
    assert rows.dtype == np.float32 and rows.shape == (len(out.token_ids), 512)
    assert rows.argmax(-1).tolist() == out.token_ids
    lsm = torch.log_softmax(torch.from_numpy(rows), -1)
    want = lsm[torch.arange(len(out.token_ids)), torch.tensor(out.token_ids)]
    assert len(out.logprobs) == len(out.token_ids) and all(lp < 0 for lp in out.logprobs)
    assert torch.allclose(torch.tensor(out.logprobs), want, atol=1e-6, rtol=0), (out.logprobs, want)
    return rows


def test_decode_returns_step_output_with_each_ids_logprob_and_rows(prepared, prompt):
    engine, prep = prepared
    wl, revealed = Workload.split("decode", 400, 8, prompt)
    out = engine.step(prep, engine.begin(prep, wl), revealed)
    assert isinstance(out, StepOutput) and len(out.token_ids) == 8
    rows = _check_rows(engine, prep, out)
    # row i is the next-token row after the prompt and ids[:i], as the logits path (teacher-forced) gives it
    seq = tuple(prompt[:400]) + tuple(out.token_ids[:-1])
    forced = engine.logits(prep, LogitsRequest(seq, tuple(range(399, 407)), GEOM)).logits
    assert np.allclose(rows, forced, atol=2e-4 * float(np.abs(forced).max()))


def test_prefill_returns_the_next_token_its_logprob_and_the_last_row(prepared, prompt):
    engine, prep = prepared
    wl, revealed = Workload.split("prefill", 100, 300, prompt)
    out = engine.step(prep, engine.begin(prep, wl), revealed)
    rows = _check_rows(engine, prep, out)
    want = engine.logits(prep, LogitsRequest(prompt[:400], (399,), GEOM)).logits
    assert np.allclose(rows, want, atol=1e-4 * float(np.abs(want).max()))  # begin's and step's calls vs one


@pytest.mark.parametrize("k", [2, 5])
def test_a_k_token_reveal_decodes_the_greedy_continuation_of_the_whole_prompt(prepared, prompt, k):
    """begin() sees prompt[:depth-K], step() consumes the K revealed ids one decode step each, then generates:
    the ids are greedy_decode's of the full prompt (which prefills depth-1 and reveals one)."""
    engine, prep = prepared
    wl, revealed = reveal(prompt, 450, 6, k)
    state = engine.begin(prep, wl)
    assert state.cache.n_past == 450 - k
    with pytest.raises(EngineError, match=f"got {k - 1} revealed ids, this workload reveals {k}"):
        engine.step(prep, state, revealed[1:])
    out = engine.step(prep, state, revealed)
    assert state.cache.n_past == 450 - k + k + 6 - 1
    _check_rows(engine, prep, out)
    assert out.token_ids == greedy_decode(prep, prompt, 450, 6)


def test_step_logits_needs_a_step(prepared, prompt):
    engine, prep = prepared
    with pytest.raises(EngineError, match="has no step"):
        engine.step_logits(prep)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 3])
def test_the_captured_graph_gives_the_eager_ids_logprobs_and_rows_on_cuda(shards, prompt, k):
    """float16 with the kernels: the CUDA graph's step writes each logits row and its log-probability; they are
    the eager decode's within f16-level rounding, with the same ids."""
    engine = SparkInferEngine()
    runs = {}
    for graph in (True, False):
        t = EngineTarget("k3-mini-cpu", shards[0], tuple(shards), "cuda", GEOM,
                         options={"dtype": "float16", "cuda_graph": graph})
        prep = engine.prepare(t, Path("unused"))
        assert prep.handle.model.use_kernels
        wl, revealed = reveal(prompt, 500, 16, k)
        out = engine.step(prep, engine.begin(prep, wl), revealed)
        runs[graph] = (out, _check_rows(engine, prep, out))
        assert bool(prep.handle.decoder and prep.handle.decoder.graphs) == graph
    (g_out, g_rows), (e_out, e_rows) = runs[True], runs[False]
    assert g_out.token_ids == e_out.token_ids
    assert np.allclose(g_rows, e_rows, atol=1e-2 * float(np.abs(e_rows).max()))
