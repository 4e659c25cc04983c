"""K3 config from GGUF metadata, and one deliberately broken file per trap that must be refused by name."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from scoreboard.errors import InputError
from scoreboard.models.k3 import K3Config, _field_value, expected_tensors, load_k3_config
from scoreboard.weights.generate import generate
from scoreboard.weights.presets import get_spec

U32, I32, ARRAY = GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.ARRAY
HKV = "kimi-k3.attention.head_count_kv"


@pytest.fixture(scope="module")
def mini(tmp_path_factory) -> Path:
    """First shard of a freshly generated k3-mini (3 shards)."""
    return generate("k3-mini", tmp_path_factory.mktemp("mini"))[0]


def rewrite(first: Path, out: Path, drop: tuple[str, ...] = (), kv: dict | None = None,
            shapes: dict[str, tuple[int, ...]] | None = None, drop_tensors: tuple[str, ...] = ()) -> Path:
    """Copy a (sharded) kimi-k3 GGUF into one file, dropping/overriding keys and re-shaping tensors.

    kv: full key -> (value, GGUFValueType[, sub type]); shapes: tensor -> ggml shape (written as zeros).
    """
    kv, shapes = kv or {}, shapes or {}
    shards = sorted(first.parent.glob(first.name.replace("00001", "*")))
    w = GGUFWriter(out, "kimi-k3")
    for name, fld in GGUFReader(shards[0]).fields.items():
        if name.startswith(("GGUF.", "split.")) or name == "general.architecture" or name in drop or name in kv:
            continue
        sub = fld.types[-1] if fld.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(name, _field_value(fld), fld.types[0], sub_type=sub)
    for name, spec in kv.items():
        w.add_key_value(name, spec[0], spec[1], sub_type=spec[2] if len(spec) > 2 else None)
    for shard in shards:
        for t in GGUFReader(shard).tensors:
            if t.name in drop_tensors:
                continue
            if t.name in shapes:
                w.add_tensor(t.name, np.zeros(tuple(reversed(shapes[t.name])), np.float32))
            else:
                w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def refusal(path: Path, **kw) -> str:
    with pytest.raises(InputError) as exc:
        load_k3_config(path, **kw)
    return exc.value.message


def test_reads_every_hyperparameter_of_the_generated_model(mini):
    cfg = load_k3_config(mini)
    want = get_spec("k3-mini").config()
    for f in dataclasses.fields(K3Config):
        if f.name not in ("shards", "tensor_shapes", "tensor_types"):
            assert getattr(cfg, f.name) == getattr(want, f.name), f.name
    assert cfg.head_count_kv == (0, 0, 1, 0, 0, 1)
    assert (cfg.mla_layers, cfg.kda_layers, cfg.full_attn_layers) == ((2, 5), (0, 1, 3, 4), (3, 6))
    assert len(cfg.shards) == 3 and cfg.shards[0] == mini
    assert set(cfg.tensor_shapes) == set(expected_tensors(cfg))
    assert cfg.tensor_shapes["blk.1.ffn_gate_exps.weight"] == (128, 128, 8)  # ggml order: latent, ff, experts
    assert cfg.tensor_shapes["blk.2.attn_kv_a_mqa.weight"] == (256, 192)  # kv_lora 128 + rope 64
    assert cfg.key_length == 192 and cfg.value_length == 128
    assert cfg.n_params() == sum(int(np.prod(s)) for s in cfg.tensor_shapes.values())
    assert cfg.mla_cache_bytes_per_token() == 2 * 192 * 2


def test_the_reference_round_trip_copy_is_accepted(mini, tmp_path):
    """The rewrite helper itself changes nothing that the checks see."""
    cfg = load_k3_config(rewrite(mini, tmp_path / "copy.gguf"))
    assert cfg.mla_layers == (2, 5) and cfg.tensor_shapes == load_k3_config(mini).tensor_shapes


@pytest.mark.parametrize("key", ["expert_latent_length", "attn_res.block_size", "activation.situ_beta",
                                 "activation.situ_linear_beta"])
def test_trap_required_key_missing_is_never_defaulted(mini, tmp_path, key):
    msg = refusal(rewrite(mini, tmp_path / "m.gguf", drop=(f"kimi-k3.{key}",)))
    assert (f"trap: required-key: required key kimi-k3.{key} is missing (never defaulted: a default loads "
            "cleanly and produces fluent garbage)") in msg


def test_every_missing_required_key_is_reported_at_once(mini, tmp_path):
    drop = ("kimi-k3.activation.situ_beta", "kimi-k3.attn_res.block_size")
    msg = refusal(rewrite(mini, tmp_path / "m.gguf", drop=drop))
    assert "kimi-k3.activation.situ_beta" in msg and "kimi-k3.attn_res.block_size" in msg and "2 problem(s)" in msg


def test_trap_full_attention_layers_read_0_indexed(mini, tmp_path):
    # HF full_attn_layers [3, 6] (1-indexed) read as 0-indexed: MLA on layer 3 only (6 is out of range)
    bad = rewrite(mini, tmp_path / "m.gguf", kv={HKV: ([0, 0, 0, 1, 0, 0], ARRAY, I32)})
    msg = refusal(bad)
    assert "trap: layer-kinds: MLA layers (0-indexed) are [3] but the declared full_attn_layers [3, 6]" in msg
    assert "read 0-indexed" in msg


def test_trap_declared_layers_given_by_the_caller(mini):
    msg = refusal(mini, full_attn_layers=[2, 5])  # a 0-indexed list passed where the HF (1-indexed) one belongs
    assert "trap: layer-kinds" in msg and "[1, 4]" in msg
    assert load_k3_config(mini, full_attn_layers=[3, 6]).mla_layers == (2, 5)


def test_trap_mla_read_as_real_kv_heads(mini, tmp_path):
    bad = rewrite(mini, tmp_path / "m.gguf", kv={HKV: ([0, 0, 2, 0, 0, 2], ARRAY, I32)})
    msg = refusal(bad)
    assert "trap: layer-kinds" in msg and "layer 2: 2" in msg and "MLA read as real multi-head KV heads" in msg


def test_trap_head_count_kv_not_per_layer(mini, tmp_path):
    msg = refusal(rewrite(mini, tmp_path / "m.gguf", kv={HKV: (1, U32)}))
    assert "trap: layer-kinds" in msg and "per-layer array" in msg


def test_trap_mla_cache_width_not_latent(mini, tmp_path):
    # key_length set to the per-head q/k width (nope+rope = 128) instead of the latent kv_lora + rope = 192
    msg = refusal(rewrite(mini, tmp_path / "m.gguf", kv={"kimi-k3.attention.key_length": (128, U32)}))
    assert "trap: mla-as-mqa" in msg and "must be kv_lora_rank + rope = 192" in msg


def test_trap_experts_at_hidden_width(mini, tmp_path):
    shapes = {"blk.3.ffn_gate_exps.weight": (256, 128, 8), "blk.3.ffn_up_exps.weight": (256, 128, 8),
              "blk.3.ffn_down_exps.weight": (128, 256, 8)}
    msg = refusal(rewrite(mini, tmp_path / "m.gguf", shapes=shapes))
    assert ("trap: latent-experts: blk.3.ffn_gate_exps.weight is [256, 128, 8]: experts at the hidden width 256 "
            "instead of the latent width 128") in msg
    assert "blk.3.ffn_down_exps.weight is [128, 256, 8]" in msg


def test_trap_expert_count_beyond_the_reference_build(mini, tmp_path):
    msg = refusal(rewrite(mini, tmp_path / "m.gguf", kv={"kimi-k3.expert_count": (1025, U32)}))
    assert "trap: expert-limit: 1025 experts exceed the reference build's LLAMA_MAX_EXPERTS (1024)" in msg


def test_trap_tensor_missing_and_misshaped(mini, tmp_path):
    bad = rewrite(mini, tmp_path / "m.gguf", drop_tensors=("blk.0.ssm_a",),
                  shapes={"blk.5.attn_kv_a_mqa.weight": (256, 128)})
    msg = refusal(bad)
    assert "trap: tensor-shapes: tensor blk.0.ssm_a is missing (expected [2])" in msg
    assert "trap: tensor-shapes: tensor blk.5.attn_kv_a_mqa.weight is [256, 128], expected [256, 192]" in msg


def test_not_kimi_k3_and_missing_shards_are_refused(mini, tmp_path):
    other = tmp_path / "other.gguf"
    w = GGUFWriter(other, "llama")
    w.add_tensor("x", np.zeros(4, np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    assert "general.architecture is 'llama', expected 'kimi-k3'" in refusal(other)
    d = tmp_path / "two"
    shutil.copytree(mini.parent, d)
    (d / "k3-mini-00002-of-00003.gguf").unlink()
    assert "missing shard(s): " in refusal(d / mini.name) and "k3-mini-00002-of-00003.gguf" in refusal(d / mini.name)
    assert "not the first shard" in refusal(d / "k3-mini-00003-of-00003.gguf")
