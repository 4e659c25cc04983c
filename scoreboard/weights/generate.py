"""Deterministic random-weight `kimi-k3` GGUFs from a named spec: same spec + seed -> same bytes.

Determinism, by construction: each tensor draws from its own PCG64 stream seeded by
sha256(seed, tensor name) and read through ``random_raw`` (a raw bit stream numpy keeps stable across
versions), converted to floats with plain IEEE arithmetic; keys and tensors are written in a fixed
order; nothing time- or host-dependent is written. Kimi-k3 keys are written as raw strings so the
PyPI ``gguf`` package (which lacks the kimi-k3 constants) works as well as the vendored gguf-py.

Routing code (specs with ``route_code``). Random routers put some tokens' k-th and (k+1)-th expert scores
within rounding of each other; f16 rounding then flips one expert at one position, and the KDA/MLA state
carries the difference to every later position, so f32 and f16 runs of the same correct engine disagree
as much as a bug would. With a code, the last n_expert dims of the residual stream carry, for each token,
a discrete pattern: k dims at +amp*(1..1.5) and n_expert-k at -amp*(1..1.5), from the token embedding
(the token's own random permutation of the dims). Every matrix that writes the stream (attention and FFN
output projections, routed up, shared down) has zero rows there, so those dims hold only the embedding's
code, scaled by one positive factor per token (the residual mix's weight on the first checkpoint over
the norm). Each MoE layer's router reads code dim P_layer(e) for expert e (its own permutation) at a gain
that puts the weakest selected logit near +route_margin and the strongest unselected near -route_margin,
plus a small context term from the other dims. The top-k set is then the token's code under that
layer's permutation: a margin of several logit units against f16's ~1e-3, and a positive scale cannot
reorder it. Routing is still real: k of n experts per token, a different set per token and per layer,
every expert used over a prompt; the routing weights still depend on the context (scale, context term).
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ..errors import InputError
from ..models.k3 import ARCH, DECLARED_KEY, K3Config, expected_tensors, key
from .presets import K3Spec, get_spec
from .tokenizer import build_tokenizer

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

GENERATOR_VERSION = 1  # bump when the bytes a spec produces change on purpose
FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7}  # llama_ftype: ALL_F32, MOSTLY_F16, MOSTLY_Q8_0
Progress = Callable[[str, float | None], None]


def shard_names(spec: K3Spec) -> list[str]:
    """File names the spec produces, first shard first."""
    if spec.n_shards == 1:
        return [f"{spec.name}.gguf"]
    return [f"{spec.name}-{i:05d}-of-{spec.n_shards:05d}.gguf" for i in range(1, spec.n_shards + 1)]


def _uniform(seed: int, name: str, n: int) -> np.ndarray:
    """n floats in [-1, 1) from the tensor's own stream (float64)."""
    digest = hashlib.sha256(f"{seed}|{name}".encode()).digest()
    bits = np.random.PCG64(int.from_bytes(digest[:16], "little")).random_raw(n)
    return (bits >> np.uint64(11)).astype(np.float64) * (2.0 ** -52) - 1.0


def _perm(seed: int, name: str, n: int) -> np.ndarray:
    """A deterministic permutation of range(n) from the named stream (argsort of its uniform draws)."""
    return np.argsort(_uniform(seed, name, n), kind="stable")


def route_code_table(spec: K3Spec, seed: int) -> np.ndarray:
    """[n_vocab, n_expert] float64: each token's routing code (module docstring). Row v: the token's own
    permutation of the code dims; its first k dims get +amp*(1 + 0.5*j/k), the others -amp*(1 + 0.5*j/(n-k))."""
    n, k = spec.n_expert, spec.n_expert_used
    pos = spec.route_code_amp * (1.0 + 0.5 * np.arange(k) / k)
    neg = -spec.route_code_amp * (1.0 + 0.5 * np.arange(n - k) / (n - k))
    levels = np.concatenate([pos, neg])
    out = np.empty((spec.n_vocab, n))
    for v in range(spec.n_vocab):
        out[v, _perm(seed, f"route_code|{v}", n)] = levels
    return out


def route_perm(seed: int, layer: int, n_expert: int) -> np.ndarray:
    """Layer `layer`'s router reads code dim route_perm[e] for expert e."""
    return _perm(seed, f"blk.{layer}.route_perm", n_expert)


def route_gain(spec: K3Spec, layer: int) -> float:
    """Router weight on a code dim. The code reaches layer `layer`'s FFN only through the residual mix's
    weight on the first checkpoint (the stream restarts at each banked layer): about 1/(C+1) of the mix
    over C checkpoints + the stream, whose RMS is about 1/sqrt(C+1) of a single one; the gain undoes that."""
    c = layer // spec.attn_res_block_size + 1 if spec.attn_res_block_size > 0 else 0
    return spec.route_margin * math.sqrt(c + 1) / spec.route_code_amp


def _route_code(spec: K3Spec, seed: int, name: str, leaf: str, x: np.ndarray) -> np.ndarray:
    """Apply the routing code to one tensor (numpy order); tensors it does not touch come back as they are."""
    r = slice(spec.n_embd - spec.n_expert, spec.n_embd)  # spec.code_dims
    if name == "token_embd.weight":  # [V, E]
        x[:, r] = route_code_table(spec, seed).astype(np.float32)
    elif name == "output.weight":  # [V, E]: the logits do not read the code
        x[:, r] = 0.0
    elif leaf in ("attn_output.weight", "ffn_down.weight", "ffn_down_shexp.weight", "ffn_routed_up.weight"):
        x[r, :] = 0.0  # [E, in]: nothing but the embedding writes the code dims
    elif leaf == "ffn_gate_inp.weight":  # [n_expert, E]
        layer = int(name.split(".")[1])
        x[:, r] = 0.0
        x[np.arange(spec.n_expert), spec.n_embd - spec.n_expert + route_perm(seed, layer, spec.n_expert)] = (
            route_gain(spec, layer))
    return x


def _init(spec: K3Spec, seed: int, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The float32 values of one tensor (numpy order = reversed ggml shape), damped (random K3 weights are chaotic)."""
    n = math.prod(shape)
    u = _uniform(seed, name, n)
    leaf = name.split(".", 2)[-1] if name.startswith("blk.") else name
    fan_in = shape[0]
    sq3 = math.sqrt(3.0)

    def rnd(std: float, mean: float = 0.0) -> np.ndarray:
        return mean + u * (sq3 * std)

    g = spec.branch_gain
    situ_rms = 1.5  # RMS of situ(g, u) with gate pre-activation std ~3 and unit up
    if leaf.endswith("norm.weight"):
        x = rnd(0.05, 1.0)
    elif "res_score" in leaf:
        x = rnd(spec.res_score_std)
    elif name == "token_embd.weight":
        x = rnd(1.0)
    elif name == "output.weight":
        x = rnd(spec.logit_std / math.sqrt(fan_in))
    elif leaf == "ssm_a":  # -exp(A_log), folded as the converter does; exp(A_log) in [0.5, 1.5]
        x = -(1.0 + 0.5 * u)
    elif leaf == "ssm_dt.bias":  # decay gate bias in [-7, -1]: a spread of memory lengths
        x = -4.0 + 3.0 * u
    elif leaf.startswith("ssm_conv1d"):
        x = rnd(0.5)
    elif leaf == "exp_probs_b.bias":
        x = rnd(spec.expert_bias_std)
    elif leaf == "ffn_gate_inp.weight":
        x = rnd((spec.router_context_std if spec.route_code else spec.router_logit_std) / math.sqrt(fan_in))
    elif leaf in ("ffn_gate.weight", "ffn_gate_shexp.weight", "ffn_gate_exps.weight"):
        x = rnd(spec.gate_preact_std / math.sqrt(fan_in))
    elif leaf in ("ffn_down.weight", "ffn_down_shexp.weight", "ffn_down_exps.weight"):
        x = rnd(g / (situ_rms * math.sqrt(fan_in)))
    elif leaf in ("attn_output.weight", "ffn_routed_up.weight"):
        x = rnd(2.0 * g / math.sqrt(fan_in) if leaf == "attn_output.weight" else g / math.sqrt(fan_in))
    else:  # projections into an activation: unit-variance outputs
        x = rnd(1.0 / math.sqrt(fan_in))
    x = x.astype(np.float32).reshape(tuple(reversed(shape)))
    return _route_code(spec, seed, name, leaf, x) if spec.route_code else x


def _declared(shape: tuple[int, ...], weight_type: str) -> tuple[tuple[int, ...], np.dtype, Any]:
    """The one rule for what a tensor of ggml `shape` is written as (what _encode returns, without drawing it): the
    numpy shape and dtype, and the raw ggml type (None: the writer reads it from the dtype). Matrices take the
    spec's weight type; 1-D tensors, conv taps and ssm_a stay f32."""
    from gguf import GGMLQuantizationType

    np_shape = tuple(reversed(shape))
    if len(shape) == 1 or weight_type == "f32" or (len(shape) == 4 and shape[1] == 1):
        return np_shape, np.dtype(np.float32), None
    if weight_type == "f16":
        return np_shape, np.dtype(np.float16), None
    return (*np_shape[:-1], np_shape[-1] // 32 * 34), np.dtype(np.uint8), GGMLQuantizationType.Q8_0


def _encode(arr: np.ndarray, shape: tuple[int, ...],
            weight_type: str) -> tuple[np.ndarray, GGMLQuantizationType | None]:
    """(data, raw_dtype): matrices in the spec's type; 1-D tensors, conv taps and ssm_a stay f32 (_declared)."""
    from gguf import quants

    _, dtype, raw = _declared(shape, weight_type)
    if raw is not None:
        return quants.quantize(arr, raw), raw
    return arr.astype(dtype, copy=False), None


class _Deferred:
    """One tensor that the GGUF writer asks for only when it writes it: gguf's GGUFWriter keeps every tensor it
    was given until write_tensors_to_file, so eager arrays hold the whole model in memory at once (k3-wide's 12.6 GB
    F16 were killed for memory on a 24 GiB machine). The writer reads `shape`, `dtype` and `nbytes` when the tensor
    is added and calls `tofile` once, in file order: the values are drawn there and dropped after the write."""

    def __init__(self, make: Callable[[], tuple[np.ndarray, Any]], shape: tuple[int, ...], dtype: np.dtype,
                 done: Callable[[], None] | None = None):
        self._make, self.shape, self.dtype, self._done = make, shape, dtype, done
        self.nbytes = math.prod(shape) * dtype.itemsize

    def tofile(self, fout: Any) -> None:
        data, _ = self._make()
        if data.shape != self.shape or data.dtype != self.dtype:  # the declared header would not match the bytes
            raise RuntimeError(f"deferred tensor drew {data.dtype}{data.shape}, declared {self.dtype}{self.shape}")
        data.tofile(fout)
        if self._done:
            self._done()


def _nbytes(shape: tuple[int, ...], weight_type: str) -> int:
    np_shape, dtype, _ = _declared(shape, weight_type)
    return math.prod(np_shape) * dtype.itemsize


def _split_size(sizes: list[int], n_shards: int) -> int:
    """Smallest byte limit for which gguf's greedy split (new shard when the next tensor would exceed
    it) gives at most `n_shards` shards; it must give exactly that many."""
    def count(limit: int) -> int:
        shards, cur = 1, 0
        for s in sizes:
            if cur > 0 and cur + s > limit:
                shards, cur = shards + 1, 0
            cur += s
        return shards

    lo, hi = max(sizes), sum(sizes)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if count(mid) <= n_shards else (mid + 1, hi)
    if count(lo) != n_shards:
        raise InputError(f"cannot split into {n_shards} shards at tensor boundaries", "lower n_shards in the spec")
    return lo


def _write_metadata(w, spec: K3Spec, cfg: K3Config, seed: int) -> None:
    tok = build_tokenizer(spec.n_vocab)
    if tok.corpus_sha256 != spec.corpus_sha256:
        raise InputError(f"spec {spec.name}: the tokenizer corpus scoreboard/data/corpus.txt has sha256 "
                         f"{tok.corpus_sha256}, the spec pins {spec.corpus_sha256}; the tokenizer (and every "
                         "shard hash) would change",
                         "restore scoreboard/data/corpus.txt, or give the preset a new corpus_sha256 and re-pin "
                         "its weights in reference.lock")
    w.add_name(spec.name)
    w.add_uint32("general.file_type", FILE_TYPES[spec.weight_type])
    if spec.weight_type == "q8_0":
        w.add_uint32("general.quantization_version", 2)
    u32 = {
        "vocab_size": cfg.n_vocab, "context_length": cfg.context_length, "embedding_length": cfg.n_embd,
        "block_count": cfg.n_layer, "feed_forward_length": cfg.dense_ff, "attention.head_count": cfg.n_head,
        "expert_count": cfg.n_expert, "expert_used_count": cfg.n_expert_used, "ssm.conv_kernel": cfg.ssm_conv_kernel,
        "kda.head_dim": cfg.kda_head_dim, "attention.q_lora_rank": cfg.q_lora_rank,
        "attention.kv_lora_rank": cfg.kv_lora_rank, "rope.dimension_count": cfg.rope_dim,
        "attention.key_length": cfg.key_length, "attention.value_length": cfg.value_length,
        "attention.key_length_mla": cfg.key_length_mla, "attention.value_length_mla": cfg.value_length_mla,
        "expert_feed_forward_length": cfg.expert_ff, "expert_shared_count": cfg.n_expert_shared,
        "leading_dense_block_count": cfg.n_layer_dense_lead, "expert_gating_func": cfg.expert_gating_func,
        "expert_latent_length": cfg.expert_latent_length, "attn_res.block_size": cfg.attn_res_block_size,
    }
    for k, v in u32.items():
        w.add_uint32(key(k), int(v))
    w.add_array(key("attention.head_count_kv"), [int(h) for h in cfg.head_count_kv])  # int32 per layer
    f32 = {"attention.layer_norm_rms_epsilon": cfg.rms_norm_eps, "kda.gate_lower_bound": cfg.kda_gate_lower_bound,
           "expert_weights_scale": cfg.expert_weights_scale, "activation.situ_beta": cfg.situ_beta,
           "activation.situ_linear_beta": cfg.situ_linear_beta}
    for k, x in f32.items():
        if x is None:  # a kimi-linear style config (no gate lower bound): not a K3 preset
            raise InputError(f"spec {spec.name}: {k} is unset; the generator writes K3 presets only")
        w.add_float32(key(k), float(x))
    w.add_bool(key("expert_weights_norm"), cfg.expert_weights_norm)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(list(tok.tokens))
    w.add_token_types(tok.token_types)
    w.add_token_merges([f"{a} {b}" for a, b in tok.merges])
    w.add_bos_token_id(tok.bos_id)
    w.add_eos_token_id(tok.eos_id)
    w.add_add_bos_token(False)
    # provenance (ignored by llama.cpp): what produced these bytes
    w.add_string("scoreboard.spec", spec.name)
    w.add_uint64("scoreboard.seed", int(seed))
    w.add_uint32("scoreboard.generator_version", GENERATOR_VERSION)
    w.add_array(DECLARED_KEY, [int(x) for x in spec.full_attn_layers])  # 1-indexed
    w.add_string("scoreboard.tokenizer_corpus_sha256", tok.corpus_sha256)


def generate(spec: str | K3Spec, out_dir: Path, seed: int | None = None,
             progress: Progress | None = None) -> list[Path]:
    """Write the spec's GGUF shard(s) into `out_dir` atomically; return their paths, first shard first."""
    from gguf import GGUFWriter

    spec = get_spec(spec) if isinstance(spec, str) else spec
    spec.validate()
    seed = spec.default_seed if seed is None else int(seed)
    cfg = spec.config()
    plan = [(name, shapes[0]) for name, shapes in expected_tensors(cfg).items()]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = shard_names(spec)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}.", dir=out_dir))
    try:
        split: dict[str, Any] = {}
        if spec.n_shards > 1:
            split["split_max_size"] = _split_size([_nbytes(s, spec.weight_type) for _, s in plan], spec.n_shards)
        w = GGUFWriter(tmp / f"{spec.name}.gguf", ARCH, **split)
        _write_metadata(w, spec, cfg, seed)
        for i, (name, shape) in enumerate(plan):
            np_shape, dtype, raw = _declared(shape, spec.weight_type)

            def make(name: str = name, shape: tuple[int, ...] = shape) -> tuple[np.ndarray, Any]:
                return _encode(_init(spec, seed, name, shape), shape, spec.weight_type)

            def done(name: str = name, i: int = i) -> None:
                if progress:
                    progress(f"{spec.name}: {name}", (i + 1) / len(plan))

            w.add_tensor(name, _Deferred(make, np_shape, dtype, done), raw_dtype=raw)  # type: ignore[arg-type]
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        produced = sorted(p.name for p in tmp.iterdir())
        if produced != sorted(names):
            raise InputError(f"generator wrote {produced}, expected {names}", "report this as a bug")
        for n in names:
            os.replace(tmp / n, out_dir / n)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [out_dir / n for n in names]
