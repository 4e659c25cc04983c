"""Deterministic generation of the kimi-k3 presets: bytes equal to the lock's pins, and loadable by llama.cpp."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import numpy as np
import pytest

from scoreboard.errors import InputError
from scoreboard.lockfile import load_lock
from scoreboard.models.k3 import load_k3_config
from scoreboard.weights.generate import generate, shard_names
from scoreboard.weights.presets import PRESETS, get_spec
from scoreboard.weights.tokenizer import build_tokenizer

REPO = Path(__file__).resolve().parent.parent


def _digests(paths: list[Path]) -> list[tuple[str, int, str]]:
    return [(p.name, p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest()) for p in paths]


@pytest.fixture(scope="module")
def mini(tmp_path_factory) -> list[Path]:
    return generate("k3-mini", tmp_path_factory.mktemp("a"))


def test_k3_mini_twice_gives_identical_shards_equal_to_the_lock(mini, tmp_path):
    again = generate("k3-mini", tmp_path)
    assert _digests(again) == _digests(mini)
    pinned = load_lock(REPO / "reference.lock").weights["k3-mini"]
    assert (pinned.repo, pinned.spec, pinned.seed, pinned.quant) == ("generated", "k3-mini", 0, "F32")
    assert [(f.path, f.size, f.sha256) for f in pinned.files] == _digests(mini)
    assert sorted(p.name for p in tmp_path.iterdir()) == [p.name for p in again]  # no temp dirs left


def test_k3_mini_is_small_sharded_and_first_shard_first(mini):
    assert [p.name for p in mini] == shard_names(get_spec("k3-mini")) == [
        "k3-mini-00001-of-00003.gguf", "k3-mini-00002-of-00003.gguf", "k3-mini-00003-of-00003.gguf"]
    assert sum(p.stat().st_size for p in mini) < 32 << 20


def test_seed_changes_the_weights_not_the_layout(mini, tmp_path):
    other = generate("k3-mini", tmp_path, seed=1)
    assert [d[2] for d in _digests(other)] != [d[2] for d in _digests(mini)]
    assert load_k3_config(other[0]).tensor_shapes == load_k3_config(mini[0]).tensor_shapes


def test_smooth_preset_routes_every_expert_on_the_same_weights(mini, tmp_path):
    smooth = load_k3_config(generate("k3-mini-smooth", tmp_path)[0])
    cfg = load_k3_config(mini[0])
    assert smooth.n_expert_used == smooth.n_expert == 8 and cfg.n_expert_used == 2
    assert dataclasses.replace(smooth, n_expert_used=2, shards=cfg.shards) == cfg
    assert (tmp_path / "k3-mini-smooth-00003-of-00003.gguf").read_bytes() == mini[2].read_bytes()


def test_k3_mini_exercises_the_architecture():
    spec = get_spec("k3-mini")
    cfg = spec.config()
    assert cfg.mla_layers and cfg.kda_layers and cfg.full_attn_layers == (3, 6)
    assert cfg.n_expert_used < cfg.n_expert and cfg.n_expert_shared == 1
    assert cfg.expert_latent_length != cfg.n_embd  # the latent-width trap is observable
    assert -(-cfg.n_layer // cfg.attn_res_block_size) >= 2  # at least two residual checkpoints
    assert cfg.n_embd % 256 == 0 and cfg.n_vocab % 256 == 0


def test_k3_mid_is_about_1_7_billion_parameters():
    cfg = get_spec("k3-mid").config()
    assert 1.6e9 < cfg.n_params() < 1.8e9
    assert (cfg.n_layer, cfg.full_attn_layers, cfg.n_embd, cfg.n_head, cfg.n_expert, cfg.n_expert_used) == (
        8, (4, 8), 2048, 16, 64, 8)


def test_unknown_preset_gets_did_you_mean():
    with pytest.raises(InputError) as exc:
        get_spec("k3-mni")
    assert exc.value.message == "unknown model spec 'k3-mni'" and exc.value.hint == "did you mean 'k3-mini'?"
    assert set(PRESETS) >= {"k3-mini", "k3-mini-smooth", "k3-mid"}


def test_a_spec_llama_cpp_could_not_load_is_refused(tmp_path):
    bad = dataclasses.replace(get_spec("k3-mini"), full_attn_layers=())
    with pytest.raises(InputError, match="at least one KDA and one MLA layer"):
        generate(bad, tmp_path)
    bad = dataclasses.replace(get_spec("k3-mini"), full_attn_layers=(0, 3))
    with pytest.raises(InputError, match=r"1-indexed in 1\.\.6"):
        generate(bad, tmp_path)
    assert not list(tmp_path.iterdir())


def test_a_changed_tokenizer_corpus_is_refused_before_writing(tmp_path):
    bad = dataclasses.replace(get_spec("k3-mini"), corpus_sha256="0" * 64)
    with pytest.raises(InputError, match="tokenizer corpus"):
        generate(bad, tmp_path)
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".gguf"]


def test_byte_level_bpe_with_bos_and_eos():
    tok = build_tokenizer(512)
    assert len(tok.tokens) == len(set(tok.tokens)) == 512
    assert tok.tokens[tok.bos_id] == "[BOS]" and tok.tokens[tok.eos_id] == "[EOS]"
    assert tok.token_types[-2:] == [3, 3] and set(tok.token_types[:-2]) == {1}
    text = "The harbour town woke before the sun. Café 42 _x_!\n\n"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and len(ids) < len(text.encode())  # merges compress
    assert build_tokenizer.__wrapped__(512) == tok  # deterministic from the corpus


@pytest.mark.slow
def test_pinned_llama_cpp_loads_k3_mini_and_gives_finite_logits_at_depth(mini):
    from llamacpp_fixtures import test_cache_dir, tiny_target

    from engines.llamacpp.engine import LlamaCppEngine
    from scoreboard.engine import Geometry, LogitsRequest

    engine = LlamaCppEngine()
    geom = Geometry(n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=2)
    target = tiny_target(mini[0], geometry=geom)
    target = dataclasses.replace(target, shard_paths=tuple(mini))
    prepared = engine.prepare(target, test_cache_dir())
    ids = build_tokenizer(512).encode((REPO / "scoreboard/data/corpus.txt").read_text())[:1025]
    out = engine.logits(prepared, LogitsRequest(tuple(ids), (63, 511, 1023), geom)).logits
    assert out.shape == (3, 512) and out.dtype == np.float32 and np.isfinite(out).all()
    assert 1.0 < float(out.std()) < 10.0  # damped: neither flat nor exploding


def test_every_tensor_is_drawn_only_when_written_with_the_bytes_an_eager_encode_gives(tmp_path, monkeypatch):
    """The writer is handed deferred tensors (a 12.6 GB F16 model held whole was killed for memory on 24 GiB):
    each is drawn once, in file order, at write time, and its bytes are what _encode gives, in F16 and in Q8_0
    (whose raw type and byte shape are declared before any value exists)."""
    import gguf

    from scoreboard.weights import generate as gen

    drawn: list[str] = []
    real_init = gen._init
    monkeypatch.setattr(gen, "_init", lambda spec, seed, name, shape: (drawn.append(name), real_init(
        spec, seed, name, shape))[1])
    before_write: list[int] = []
    real_write = gguf.GGUFWriter.write_tensors_to_file
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file",
                        lambda self, **kw: (before_write.append(len(drawn)), real_write(self, **kw))[1])
    for wt in ("f16", "q8_0"):
        drawn.clear()
        spec = dataclasses.replace(get_spec("k3-mini"), name=f"k3-mini-{wt}", weight_type=wt, n_shards=1)
        path = generate(spec, tmp_path / wt)[0]
        reader = gguf.GGUFReader(path)
        assert before_write.pop() == 0  # nothing drawn while the writer was only collecting
        assert drawn == [t.name for t in reader.tensors]  # each once, in the order the file holds them
        shapes = load_k3_config(path).tensor_shapes
        for t in reader.tensors[:6] + reader.tensors[-3:]:
            want, raw = gen._encode(real_init(spec, 0, t.name, shapes[t.name]), shapes[t.name], wt)
            assert bytes(t.data.tobytes()) == want.tobytes(), (wt, t.name)
            assert raw is None or t.tensor_type == raw
