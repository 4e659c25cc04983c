"""GGUF -> torch: read every shard with gguf-py, dequantize each tensor, lay it out for model.py.

F32 and F16 tensors are read as stored (one copy, no dequantization); gguf-py dequantizes every other
type (BF16, Q4_0..Q8_0, the K-quants and the IQ quants, IQ1_S included) to float32. Arrays are in numpy
order (the reverse of ggml's ``ne``); each tensor is moved to the device and cast to the compute dtype there. Vectors (norms, residual scores, biases, ssm_a), the conv taps
and the router stay float32 (small, and they steer softmaxes and top-k routing).

With float32 compute, each matrix also records the activation rounding llama.cpp's CPU backend
applies before multiplying by a weight of its GGUF type (its ``vec_dot_type``), see model.Mat.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from scoreboard.errors import EngineError

from .model import FUSED, K3Weights, Mat

Progress = Callable[[str, "float | None"], None]

_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")
VECTORS = {"attn_norm", "ffn_norm", "attn_res_score", "ffn_res_score", "attn_q_a_norm", "attn_kv_a_norm", "ssm_norm",
           "ssm_a", "ssm_dt_b", "exp_probs_b", "ffn_routed_norm", "output_norm", "output_res_score",
           "ssm_conv1d_q", "ssm_conv1d_k", "ssm_conv1d_v"}
F32_MATS = {"ffn_gate_inp"}  # matrices kept in float32 whatever the compute dtype
# ggml-cpu type_traits_cpu[type].vec_dot_type: how a matmul's activation is rounded for each weight type
VEC_DOT = {"F32": None, "F16": "f16", "BF16": "bf16",
           "Q4_0": "q8_0", "Q4_1": "q8_0", "Q5_0": "q8_0", "Q5_1": "q8_0", "Q8_0": "q8_0", "IQ4_NL": "q8_0",
           "MXFP4": "q8_0", "Q2_K": "q8_K", "Q3_K": "q8_K", "Q4_K": "q8_K", "Q5_K": "q8_K", "Q6_K": "q8_K",
           "IQ2_XXS": "q8_K", "IQ2_XS": "q8_K", "IQ2_S": "q8_K", "IQ3_XXS": "q8_K", "IQ3_S": "q8_K",
           "IQ1_S": "q8_K", "IQ1_M": "q8_K", "IQ4_XS": "q8_K", "TQ1_0": "q8_K", "TQ2_0": "q8_K"}


def _short(rest: str) -> str:
    """'attn_q.weight' -> 'attn_q'; 'ssm_dt.bias' -> 'ssm_dt_b'; 'exp_probs_b.bias' -> 'exp_probs_b'."""
    if rest.endswith(".weight"):
        return rest[: -len(".weight")]
    if rest.endswith(".bias"):
        base = rest[: -len(".bias")]
        return "ssm_dt_b" if base == "ssm_dt" else base
    return rest


def gguf_tensors(shards) -> Iterator[tuple[Path, Any, tuple[int, ...]]]:
    """(shard path, gguf tensor, shape in numpy order) for every tensor of every shard."""
    from gguf import GGUFReader

    for path in shards:
        try:
            reader = GGUFReader(path)
        except Exception as exc:  # gguf raises ValueError/struct errors on a damaged file
            raise EngineError(f"{path}: cannot read GGUF ({exc})", "re-fetch or regenerate this shard") from exc
        for t in reader.tensors:
            yield path, t, tuple(int(d) for d in reversed([int(x) for x in t.shape]))


def to_f32(path: Path, t: Any, data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Dequantize raw GGUF bytes (all of a tensor, or a slice along its outermost axis) to float32."""
    from gguf.quants import dequantize

    try:
        arr = dequantize(data, t.tensor_type)
    except NotImplementedError as exc:
        raise EngineError(f"{path}: tensor {t.name} has type {t.tensor_type.name}, which gguf-py "
                          "cannot dequantize", "requantize the weights to a supported type") from exc
    return np.array(arr, dtype=np.float32, copy=True).reshape(shape)


# GGUF types whose bytes numpy reads as they are: no dequantization, one copy in the stored width; the cast
# to the compute dtype then runs on the device (f16 -> f16 is none; f16 -> f32 and f32 -> f32 are exact)
NATIVE = {"F32": np.float32, "F16": np.float16}


def native_array(t: Any, shape: tuple[int, ...]) -> np.ndarray | None:
    """A tensor of a NATIVE type as one array in its stored dtype (numpy order), or None for other types."""
    want = NATIVE.get(t.tensor_type.name)
    if want is None:
        return None
    return np.array(t.data, dtype=want, copy=True).reshape(shape)


def iter_tensors(shards: tuple[Path, ...]) -> Iterator[tuple[str, np.ndarray, str]]:
    """(name, array in numpy order, ggml type name) for every tensor of every shard: F32/F16 as stored,
    every other type dequantized to float32."""
    for path, t, shape in gguf_tensors(shards):
        arr = native_array(t, shape)
        yield t.name, to_f32(path, t, t.data, shape) if arr is None else arr, t.tensor_type.name


def load_weights(cfg: Any, shards: tuple[Path, ...], device: str, dtype: torch.dtype,
                 progress: Progress | None = None) -> tuple[K3Weights, dict[str, str]]:
    """Every tensor of every shard, checked against the config; returns weights and name -> ggml type."""
    expected = set(cfg.tensor_shapes) if cfg.tensor_shapes else None
    layers: list[dict[str, Any]] = [{} for _ in range(cfg.n_layer)]
    glob: dict[str, Any] = {}
    types: dict[str, str] = {}
    total = len(expected) if expected else 0
    for i, (name, arr, ttype) in enumerate(iter_tensors(shards)):
        types[name] = ttype
        m = _BLK.match(name)
        key = _short(m.group(2) if m else name)
        if m and int(m.group(1)) >= cfg.n_layer:
            raise EngineError(f"tensor {name}: layer {m.group(1)} beyond block_count {cfg.n_layer}",
                              "the shards do not belong to this config; regenerate the weights")
        (layers[int(m.group(1))] if m else glob)[key] = _place(key, arr, ttype, device, dtype)
        if progress and total:
            progress(f"loading {name}", (i + 1) / total)
    return assemble(cfg, glob, layers, types, expected), types


def assemble(cfg: Any, glob: dict[str, Any], layers: list[dict[str, Any]], types: dict[str, str],
             expected: set[str] | None) -> K3Weights:
    """Check the tensor set against the metadata and lay the placed tensors out as K3Weights."""
    if expected is not None and set(types) != expected:
        missing, extra = sorted(expected - set(types)), sorted(set(types) - expected)
        raise EngineError(f"shards disagree with their metadata: missing {missing[:5]}, extra {extra[:5]}",
                          "re-fetch the shards; the set of files is inconsistent")
    for k in ("token_embd", "output_norm", "output"):
        if k not in glob:
            raise EngineError(f"tensor {k}.weight is missing", "the GGUF is incomplete; regenerate it")
    for il, lw in enumerate(layers):
        _layout_layer(cfg, il, lw)
    return K3Weights(tok_embd=glob["token_embd"].w, output_norm=glob["output_norm"], output=glob["output"],
                     output_res_score=glob.get("output_res_score"), layers=layers)


def _place(key: str, arr: np.ndarray, ttype: str, device: str, dtype: torch.dtype) -> Any:
    """A vector -> float32 tensor; a matrix -> Mat in the compute dtype (router: float32)."""
    t = torch.from_numpy(arr).to(device)  # moved in its stored width (half the bytes for F16), cast there
    if key in VECTORS:
        return aligned(t.to(torch.float32))
    act = VEC_DOT.get(ttype) if dtype == torch.float32 else None
    return Mat(aligned(t.to(torch.float32 if key in F32_MATS else dtype)), act)


ALIGN = 64  # bytes: torch's CPU allocator's alignment, and the one MKL's AVX-512 kernels need for reproducible sums


def aligned(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor whose storage starts on a 64-byte boundary: a copy into torch's own allocation where numpy's
    was not.

    On the CPU, ``torch.from_numpy(...).to("cpu")`` keeps numpy's buffer, which malloc places at 16-byte
    granularity, and where depends on the process's heap history (PYTHONHASHSEED alone moved 7 to 30 of
    k3-mini's 112 weight tensors between offsets 0/16/32/48 mod 64, measured 2026-12-07). MKL's sgemm takes
    alignment-dependent paths (Intel's "conditional numerical reproducibility": align inputs to 64 bytes): on
    the developer machine a [700, 1024] x [1024, 513] product differed in its low bits at every offset from 1 to
    15 floats. Through the f16 latent cache a last-bit difference can flip one rounding, so the same gate prompt
    read KL 1.2e-11 and then 1.2e-6 at depth 1024 in CI (2026-12-07): above the ratchet's floor (1e-6), enough to
    fail a round by its ratchet. Device tensors are the allocator's own already."""
    if t.device.type != "cpu" or t.data_ptr() % ALIGN == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _layout_layer(cfg: Any, il: int, lw: dict[str, Any]) -> None:
    """Reshape one layer's tensors into the layouts model.py reads.

    KDA: conv taps ggml {K, 1, d_inner(, 1)} -> one [3*d_inner, 1, K] f32 kernel (q|k|v rows). MLA: k_b
    {nope, kvr, H} and v_b {kvr, v, H} are already [H, kvr, nope] and [H, v, kvr] in numpy order.
    Then the matrices of each model.FUSED group are stacked.
    """
    def need(k: str) -> Any:
        if k not in lw:
            raise EngineError(f"tensor blk.{il}.{k} is missing", "the GGUF is incomplete; regenerate it")
        return lw[k]

    if cfg.head_count_kv[il] == 0:
        di, kc = cfg.kda_inner, cfg.ssm_conv_kernel
        convs = [need(f"ssm_conv1d_{x}").reshape(di, kc) for x in "qkv"]
        lw["ssm_conv1d"] = torch.cat(convs, 0)[:, None, :]  # [3*di, 1, K]: tap j weighs input t-(K-1)+j
        for x in "qkv":
            del lw[f"ssm_conv1d_{x}"]
        lw["ssm_a"] = need("ssm_a").reshape(cfg.n_head)
    else:
        need("attn_k_b")
        need("attn_v_b")
    for group, keys in FUSED.items():
        _fuse(lw, group, [k for k in keys if k in lw])


def _fuse(lw: dict[str, Any], group: str, keys: list[str]) -> None:
    """Stack matrices that read the same input into one Mat (one product instead of several), when they
    share the activation rounding and dtype; the model splits the product back (model.project)."""
    mats = [lw[k] for k in keys]
    if len(mats) < 2 or len({(m.act, m.w.dtype) for m in mats}) != 1:
        return
    # stacked along the output rows: dim 0 of a matrix [out, in], dim 1 of an expert stack [X, out, in]
    lw[group] = Mat(torch.cat([m.w for m in mats], -2), mats[0].act, tuple(m.w.shape[-2] for m in mats))
    lw[group + ".keys"] = tuple(keys)
    for k in keys:
        del lw[k]
