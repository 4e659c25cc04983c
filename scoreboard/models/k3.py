"""Kimi K3 (`kimi-k3`) config read from GGUF metadata only, and the checks that refuse its known traps.

Key and tensor names/shapes follow the pinned llama.cpp (llama-cpp-python==0.3.36, vendor/llama.cpp =
ggml-org/llama.cpp@0c1e57098): ``src/models/kimi-k3.cpp`` (load_arch_hparams / load_arch_tensors),
``src/llama-arch.cpp`` (names), ``src/llama-hparams.h`` (LLAMA_MAX_EXPERTS), ``conversion/kimi_k3.py``
(1-indexed ``full_attn_layers`` -> per-layer ``head_count_kv``: 1 = MLA stored as MQA, 0 = KDA).

Shapes are in ggml order (``ne0`` first), as llama.cpp's ``create_tensor`` and gguf's tensor info
write them; numpy arrays hold the reverse.

Traps (files that load cleanly and emit fluent garbage) — each refusal message starts with ``trap: <name>``:
  required-key   expert_latent_length, attn_res.block_size, situ_beta, situ_linear_beta missing
  layer-kinds    head_count_kv not 0/1 per layer, or not matching the declared full-attention layers
  mla-as-mqa     MLA cache key/value widths not kv_lora(+rope) — MLA read as real multi-head attention
  latent-experts routed experts stored at the hidden width instead of the latent width
  expert-limit   more experts than the reference build can hold (LLAMA_MAX_EXPERTS)
  tensor-shapes  a tensor missing, unexpected, or mis-shaped for the declared config
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..errors import InputError

ARCH = "kimi-k3"
MAX_EXPERTS_REFERENCE = 1024  # LLAMA_MAX_EXPERTS, src/llama-hparams.h of the pinned llama.cpp
GATING_SIGMOID = 2  # llama_expert_gating_func_type LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID

# The four keys llama.cpp would otherwise default (or that a re-implementation would guess): never.
REQUIRED_K3_KEYS = ("expert_latent_length", "attn_res.block_size", "activation.situ_beta",
                    "activation.situ_linear_beta")

DECLARED_KEY = "scoreboard.full_attn_layers"  # 1-indexed, provenance written by the generator
SHARD_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def key(name: str) -> str:
    """The full GGUF key of an arch-scoped hyperparameter, e.g. ``kimi-k3.kda.head_dim``."""
    return f"{ARCH}.{name}"


@dataclass(frozen=True)
class K3Config:
    """Every hyperparameter a kimi-k3 forward pass needs (names mirror the GGUF keys)."""

    n_layer: int  # block_count
    n_embd: int  # embedding_length (hidden)
    n_vocab: int
    n_head: int  # attention.head_count: MLA heads = KDA heads
    head_count_kv: tuple[int, ...]  # per layer: 1 = MLA (stored as MQA), 0 = KDA
    rms_norm_eps: float
    # MLA (NoPE-only; cache row per token = kv_lora_rank + rope_dim, one "head")
    q_lora_rank: int  # 0 = no low-rank q (attn_q instead of attn_q_a/attn_q_b)
    kv_lora_rank: int
    rope_dim: int  # qk_rope_head_dim (rope.dimension_count); sizes k_pe though no RoPE is applied
    key_length_mla: int  # per-head q/k width = qk_nope + qk_rope
    value_length_mla: int  # per-head v width
    key_length: int  # cache key width = kv_lora_rank + rope_dim (576 for K3)
    value_length: int  # cache value width = kv_lora_rank
    # KDA (Kimi Delta Attention): n_head heads of kda_head_dim, f32 recurrent state
    kda_head_dim: int
    ssm_conv_kernel: int
    kda_gate_lower_bound: float | None  # None: kimi-linear softplus gate; K3: -5.0
    # FFN / latent MoE
    n_layer_dense_lead: int
    dense_ff: int  # feed_forward_length of the leading dense blocks
    n_expert: int
    n_expert_used: int
    n_expert_shared: int
    expert_ff: int  # expert_feed_forward_length
    expert_latent_length: int  # routed experts run at this width
    expert_weights_scale: float
    expert_weights_norm: bool
    expert_gating_func: int  # 2 = sigmoid
    # K3-specific, required
    situ_beta: float
    situ_linear_beta: float
    attn_res_block_size: int
    # optional parts, from tensor presence
    has_mla_output_gate: bool = True  # blk.N.attn_gate
    has_routed_norm: bool = True  # blk.N.ffn_routed_norm
    context_length: int = 0
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # files (empty for a config built from a spec)
    shards: tuple[Path, ...] = ()
    tensor_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict, compare=False, hash=False)
    tensor_types: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    @property
    def mla_layers(self) -> tuple[int, ...]:
        """0-indexed full-attention (MLA) layers."""
        return tuple(i for i, h in enumerate(self.head_count_kv) if h > 0)

    @property
    def kda_layers(self) -> tuple[int, ...]:
        """0-indexed linear-attention (KDA) layers."""
        return tuple(i for i, h in enumerate(self.head_count_kv) if h == 0)

    @property
    def full_attn_layers(self) -> tuple[int, ...]:
        """1-indexed MLA layers, as the HF config's ``linear_attn_config.full_attn_layers`` lists them."""
        return tuple(i + 1 for i in self.mla_layers)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(range(self.n_layer_dense_lead, self.n_layer))

    @property
    def qk_nope_dim(self) -> int:
        return self.key_length_mla - self.rope_dim

    @property
    def kda_inner(self) -> int:
        """d_inner of a KDA layer = n_head x kda_head_dim."""
        return self.n_head * self.kda_head_dim

    def mla_cache_bytes_per_token(self, bytes_per_elem: float = 2.0) -> float:
        """MLA latent cache (K only, llama.cpp is_mla): layers x (kv_lora + rope) x bytes."""
        return len(self.mla_layers) * (self.kv_lora_rank + self.rope_dim) * bytes_per_elem

    def kda_state_bytes_per_seq(self, bytes_per_elem: float = 4.0) -> float:
        """KDA recurrent state per sequence: delta-rule state hd^2 x heads + 3 conv states (k-1) x d_inner."""
        per_layer = self.kda_head_dim ** 2 * self.n_head + 3 * (self.ssm_conv_kernel - 1) * self.kda_inner
        return len(self.kda_layers) * per_layer * bytes_per_elem

    def n_params(self) -> int:
        """Parameter count from the expected tensor shapes."""
        total = 0
        for shapes in expected_tensors(self).values():
            n = 1
            for d in shapes[0]:
                n *= d
            total += n
        return total


# ----------------------------------------------------------------------------------------------
# expected tensors (load_arch_tensors of src/models/kimi-k3.cpp)

def expected_tensors(cfg: K3Config) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Tensor name -> allowed ggml shapes (first = canonical) for a config; order = file order."""
    e, v = cfg.n_embd, cfg.n_vocab
    out: dict[str, tuple[tuple[int, ...], ...]] = {"token_embd.weight": ((e, v),)}
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        t: dict[str, tuple[int, ...] | tuple[tuple[int, ...], ...]] = {
            "attn_norm.weight": (e,), "ffn_norm.weight": (e,)}
        if cfg.attn_res_block_size > 0:
            t.update({"attn_res_score.weight": (e,), "ffn_res_score.weight": (e,)})
        t.update(_kda_tensors(cfg) if cfg.head_count_kv[i] == 0 else _mla_tensors(cfg))
        t.update(_dense_tensors(cfg) if i < cfg.n_layer_dense_lead else _moe_tensors(cfg))
        for name, shp in t.items():
            out[b + name] = shp if isinstance(shp[0], tuple) else (shp,)  # type: ignore[assignment]
    if cfg.attn_res_block_size > 0:
        out["output_res_score.weight"] = ((e,),)
    out["output_norm.weight"] = ((e,),)
    out["output.weight"] = ((e, v),)
    return out


def _kda_tensors(cfg: K3Config) -> dict[str, Any]:
    e, h, hd, k, di = cfg.n_embd, cfg.n_head, cfg.kda_head_dim, cfg.ssm_conv_kernel, cfg.kda_inner
    conv = ((k, 1, di, 1), (k, 1, di))  # 4D as converted; 3D after quantization drops the trailing 1
    return {
        "ssm_conv1d_q.weight": conv, "ssm_conv1d_k.weight": conv, "ssm_conv1d_v.weight": conv,
        "attn_q.weight": (e, di), "attn_k.weight": (e, di), "attn_v.weight": (e, di),
        "ssm_f_a.weight": (e, hd), "ssm_f_b.weight": (hd, di), "ssm_beta.weight": (e, h),
        "ssm_a": (h,),  # holds -exp(A_log); no .weight suffix
        "ssm_dt.bias": (di,), "ssm_g.weight": (e, di), "ssm_norm.weight": (hd,),
        "attn_output.weight": (di, e),
    }


def _mla_tensors(cfg: K3Config) -> dict[str, Any]:
    e, h = cfg.n_embd, cfg.n_head
    out: dict[str, Any] = {}
    if cfg.q_lora_rank > 0:
        out["attn_q_a_norm.weight"] = (cfg.q_lora_rank,)
        out["attn_q_a.weight"] = (e, cfg.q_lora_rank)
        out["attn_q_b.weight"] = (cfg.q_lora_rank, h * cfg.key_length_mla)
    else:
        out["attn_q.weight"] = (e, h * cfg.key_length_mla)
    out["attn_kv_a_norm.weight"] = (cfg.kv_lora_rank,)
    out["attn_kv_a_mqa.weight"] = (e, cfg.kv_lora_rank + cfg.rope_dim)
    out["attn_k_b.weight"] = (cfg.qk_nope_dim, cfg.kv_lora_rank, h)
    out["attn_v_b.weight"] = (cfg.kv_lora_rank, cfg.value_length_mla, h)
    if cfg.has_mla_output_gate:
        out["attn_gate.weight"] = (e, h * cfg.value_length_mla)
    out["attn_output.weight"] = (h * cfg.value_length_mla, e)
    return out


def _dense_tensors(cfg: K3Config) -> dict[str, Any]:
    e, f = cfg.n_embd, cfg.dense_ff
    return {"ffn_gate.weight": (e, f), "ffn_down.weight": (f, e), "ffn_up.weight": (e, f)}


def _moe_tensors(cfg: K3Config) -> dict[str, Any]:
    e, lat, f, x = cfg.n_embd, cfg.expert_latent_length, cfg.expert_ff, cfg.n_expert
    out: dict[str, Any] = {
        "ffn_gate_inp.weight": (e, x),  # the router scores the full-width input
        "exp_probs_b.bias": (x,),
        "ffn_gate_exps.weight": (lat, f, x), "ffn_down_exps.weight": (f, lat, x), "ffn_up_exps.weight": (lat, f, x),
        "ffn_routed_down.weight": (e, lat), "ffn_routed_up.weight": (lat, e),
    }
    if cfg.has_routed_norm:
        out["ffn_routed_norm.weight"] = (lat,)
    if cfg.n_expert_shared > 0:
        fs = f * cfg.n_expert_shared
        out.update({"ffn_gate_shexp.weight": (e, fs), "ffn_down_shexp.weight": (fs, e), "ffn_up_shexp.weight": (e, fs)})
    return out


# ----------------------------------------------------------------------------------------------
# shards and metadata

def shard_paths(first_shard: Path) -> tuple[Path, ...]:
    """All shards of a model from its first: ``<prefix>-00001-of-0000N.gguf`` -> N paths; else itself."""
    first = Path(first_shard)
    m = SHARD_RE.match(first.name)
    if not m:
        return (first,)
    if int(m["no"]) != 1:
        first_name = f"{m['prefix']}-00001-of-{m['count']}.gguf"
        raise InputError(f"{first}: not the first shard (shard {int(m['no'])} of {int(m['count'])})",
                         f"pass {first.with_name(first_name)}")
    n = int(m["count"])
    return tuple(first.with_name(f"{m['prefix']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1))


def _field_value(fld: Any) -> Any:
    """A GGUFReader field's value (scalar, str, or list), without relying on ``contents()``."""
    from gguf import GGUFValueType

    t0 = fld.types[0]
    if t0 == GGUFValueType.ARRAY:
        if fld.types[-1] == GGUFValueType.STRING:
            return [bytes(fld.parts[i]).decode("utf-8", "replace") for i in fld.data]
        return [x for i in fld.data for x in fld.parts[i].tolist()]
    if t0 == GGUFValueType.STRING:
        return bytes(fld.parts[-1]).decode("utf-8", "replace")
    return fld.parts[-1].tolist()[0]


@dataclass(frozen=True)
class GGUFHeader:
    """Metadata of a (possibly sharded) GGUF: key/values of the first shard, tensor infos of all."""

    path: Path
    shards: tuple[Path, ...]
    kv: dict[str, Any]
    n_vocab_tokens: int  # length of tokenizer.ggml.tokens (0 if absent)
    tensor_shapes: dict[str, tuple[int, ...]]
    tensor_types: dict[str, str]


def read_header(first_shard: Path) -> GGUFHeader:
    """Read metadata (never tensor data) of every shard; missing shards and bad files are refused."""
    from gguf import GGUFReader

    shards = shard_paths(Path(first_shard))
    missing = [str(p) for p in shards if not p.is_file()]
    if missing:
        raise InputError(f"missing shard(s): {', '.join(missing)}",
                         "regenerate or re-download the weights (`scoreboard weights verify --target <target>` names them)")
    kv: dict[str, Any] = {}
    n_tokens = 0
    shapes: dict[str, tuple[int, ...]] = {}
    types: dict[str, str] = {}
    for no, p in enumerate(shards):
        try:
            reader = GGUFReader(p)
        except Exception as exc:  # gguf raises ValueError/struct errors on a bad file
            raise InputError(f"{p}: not a readable GGUF file ({exc})", "re-fetch or regenerate this shard") from exc
        for name, fld in reader.fields.items():
            if no == 0 and not name.startswith("GGUF."):
                if name == "tokenizer.ggml.tokens":
                    n_tokens = len(fld.data)
                elif not name.startswith("tokenizer.ggml."):
                    kv[name] = _field_value(fld)
            elif name == "split.no" and _field_value(fld) != no:
                raise InputError(f"{p}: split.no is {_field_value(fld)}, expected {no}", "the shard files are mixed up")
        for t in reader.tensors:
            if t.name in shapes:
                raise InputError(f"{p}: tensor {t.name} appears in more than one shard", "re-split the model")
            shapes[t.name] = tuple(int(d) for d in t.shape)
            types[t.name] = t.tensor_type.name
        if no == 0:
            for k in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
                if k in reader.fields:
                    kv[k] = _field_value(reader.fields[k])
    count = kv.get("split.count", 1) or 1
    if int(count) != len(shards):
        raise InputError(f"{shards[0]}: split.count is {count} but the file name says {len(shards)} shard(s)",
                         "use the original shard names")
    return GGUFHeader(Path(first_shard), shards, kv, n_tokens, shapes, types)


# ----------------------------------------------------------------------------------------------
# config + checks

class _Problems(list):
    def trap(self, name: str, msg: str) -> None:
        self.append(f"trap: {name}: {msg}")


def _uniform(value: Any, what: str, layers: Iterable[int], problems: _Problems) -> int:
    """A key that may be a scalar or a per-layer array; K3 uses one value (over `layers` if an array)."""
    if not isinstance(value, list):
        return int(value)
    vals = {int(value[i]) for i in layers if i < len(value)}
    if len(vals) != 1:
        problems.append(f"config: {key(what)} varies across layers {sorted(vals)}; kimi-k3 uses one value")
        return max(vals) if vals else 0
    return vals.pop()


def config_from_header(hdr: GGUFHeader, full_attn_layers: Sequence[int] | None = None) -> K3Config:
    """Build a K3Config from metadata and run every check; raise InputError listing all problems."""
    kv = hdr.kv
    arch = kv.get("general.architecture")
    if arch != ARCH:
        raise InputError(f"{hdr.path}: general.architecture is {arch!r}, expected {ARCH!r}",
                         "this check is for Kimi K3 family GGUFs only")
    problems = _Problems()
    for k in REQUIRED_K3_KEYS:
        if key(k) not in kv:
            problems.trap("required-key", f"required key {key(k)} is missing (never defaulted: a default "
                                          "loads cleanly and produces fluent garbage)")

    def get(name: str, default: Any = None, required: bool = True) -> Any:
        full = key(name)
        if full in kv:
            return kv[full]
        if required:
            problems.append(f"config: key {full} is missing")
        return default

    n_layer = int(get("block_count", 0))
    hkv_raw = get("attention.head_count_kv", [])
    hkv = tuple(int(x) for x in hkv_raw) if isinstance(hkv_raw, list) else (int(hkv_raw),) * n_layer
    if not isinstance(hkv_raw, list) and key("attention.head_count_kv") in kv:
        problems.trap("layer-kinds", f"{key('attention.head_count_kv')} is the scalar {hkv_raw}; it must be a "
                                     "per-layer array (0 = KDA, 1 = MLA stored as MQA)")
    dense_lead = int(get("leading_dense_block_count", 0, required=False))
    moe = range(dense_lead, n_layer)
    lb = get("kda.gate_lower_bound", None, required=False)
    n_vocab = (int(kv.get(key("vocab_size"), 0)) or hdr.n_vocab_tokens
               or hdr.tensor_shapes.get("output.weight", (0, 0))[1])
    cfg = K3Config(
        n_layer=n_layer, n_embd=int(get("embedding_length", 0)), n_vocab=int(n_vocab),
        n_head=_uniform(get("attention.head_count", 0), "attention.head_count", range(n_layer), problems),
        head_count_kv=hkv, rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 0.0)),
        q_lora_rank=int(get("attention.q_lora_rank", 0, required=False)),
        kv_lora_rank=int(get("attention.kv_lora_rank", 0)), rope_dim=int(get("rope.dimension_count", 0)),
        key_length_mla=int(get("attention.key_length_mla", 0)),
        value_length_mla=int(get("attention.value_length_mla", 0)),
        key_length=int(get("attention.key_length", 0)), value_length=int(get("attention.value_length", 0)),
        kda_head_dim=int(get("kda.head_dim", 0)), ssm_conv_kernel=int(get("ssm.conv_kernel", 0)),
        kda_gate_lower_bound=None if lb is None else float(lb),
        n_layer_dense_lead=dense_lead, dense_ff=_uniform(get("feed_forward_length", 0, dense_lead > 0),
                                                         "feed_forward_length", range(dense_lead), problems),
        n_expert=int(get("expert_count", 0)),
        n_expert_used=_uniform(get("expert_used_count", 0), "expert_used_count", moe, problems),
        n_expert_shared=int(get("expert_shared_count", 0)),
        expert_ff=_uniform(get("expert_feed_forward_length", 0), "expert_feed_forward_length", moe, problems),
        expert_latent_length=int(kv.get(key("expert_latent_length"), 0)),
        expert_weights_scale=float(get("expert_weights_scale", 0.0, required=False)),
        expert_weights_norm=bool(get("expert_weights_norm", False, required=False)),
        expert_gating_func=int(get("expert_gating_func", 0)),
        situ_beta=float(kv.get(key("activation.situ_beta"), 0.0)),
        situ_linear_beta=float(kv.get(key("activation.situ_linear_beta"), 0.0)),
        attn_res_block_size=int(kv.get(key("attn_res.block_size"), 0)),
        has_mla_output_gate=any(n.endswith(".attn_gate.weight") for n in hdr.tensor_shapes),
        has_routed_norm=any(n.endswith(".ffn_routed_norm.weight") for n in hdr.tensor_shapes),
        context_length=int(get("context_length", 0)),
        bos_token_id=kv.get("tokenizer.ggml.bos_token_id"), eos_token_id=kv.get("tokenizer.ggml.eos_token_id"),
        shards=hdr.shards, tensor_shapes=dict(hdr.tensor_shapes), tensor_types=dict(hdr.tensor_types),
    )
    if full_attn_layers is None and isinstance(kv.get(DECLARED_KEY), list):
        full_attn_layers = kv[DECLARED_KEY]  # written by scoreboard's generator
    if not problems:  # shape checks need a complete set of keys
        check_config(cfg, problems, full_attn_layers)
    if problems:
        raise InputError(f"{hdr.path}: kimi-k3 config check failed ({len(problems)} problem(s)):\n"
                         + "\n".join(f"  {p}" for p in problems),
                         "the file is not a correct kimi-k3 GGUF: regenerate it (`scoreboard weights generate`) "
                         "or re-convert it with the pinned llama.cpp converter")
    return cfg


def check_config(cfg: K3Config, problems: _Problems, full_attn_layers: Sequence[int] | None = None) -> None:
    """Append every trap/consistency problem of `cfg` (with its tensor shapes, if any) to `problems`."""
    n_before = len(problems)
    _check_layer_kinds(cfg, problems, full_attn_layers)
    kinds_ok = len(problems) == n_before
    _check_mla_as_mqa(cfg, problems)
    _check_experts(cfg, problems)
    if cfg.tensor_shapes and len(cfg.head_count_kv) == cfg.n_layer:
        _check_layer_tensors(cfg, problems)
        if kinds_ok:  # with the layer kinds wrong, every attention tensor would be listed: the kinds say it
            _check_tensor_shapes(cfg, problems)


def _check_layer_kinds(cfg: K3Config, problems: _Problems, declared: Sequence[int] | None) -> None:
    hkv = cfg.head_count_kv
    if len(hkv) != cfg.n_layer:
        problems.trap("layer-kinds", f"{key('attention.head_count_kv')} has {len(hkv)} entries for "
                                     f"{cfg.n_layer} layers (it must be a per-layer array: 0 = KDA, 1 = MLA)")
        return
    bad = [(i, h) for i, h in enumerate(hkv) if h not in (0, 1)]
    if bad:
        problems.trap("layer-kinds", f"{key('attention.head_count_kv')} must be 0 (KDA) or 1 (MLA stored as MQA) "
                                     f"per layer; got {', '.join(f'layer {i}: {h}' for i, h in bad)} — MLA read as "
                                     "real multi-head KV heads")
    if not cfg.mla_layers or not cfg.kda_layers:
        problems.trap("layer-kinds", f"kimi-k3 needs at least one KDA and one MLA layer; head_count_kv = {list(hkv)}")
    if declared is None:
        return
    want = tuple(sorted(int(x) - 1 for x in declared))
    if cfg.mla_layers != want:
        zero_read = tuple(sorted(int(x) for x in declared if int(x) < cfg.n_layer))
        why = (" — the 1-indexed full_attn_layers were read 0-indexed" if cfg.mla_layers == zero_read
               else "")
        problems.trap("layer-kinds", f"MLA layers (0-indexed) are {list(cfg.mla_layers)} but the declared "
                                     f"full_attn_layers {list(declared)} (1-indexed, as the HF config) mean "
                                     f"{list(want)}{why}")


def _check_mla_as_mqa(cfg: K3Config, problems: _Problems) -> None:
    want_k = cfg.kv_lora_rank + cfg.rope_dim
    if cfg.key_length != want_k or cfg.value_length != cfg.kv_lora_rank:
        problems.trap("mla-as-mqa", f"MLA is stored as MQA with one latent head: {key('attention.key_length')} must be "
                                    f"kv_lora_rank + rope = {want_k} and value_length kv_lora_rank = "
                                    f"{cfg.kv_lora_rank}; "
                                    f"got {cfg.key_length} / {cfg.value_length}")
    if cfg.key_length_mla <= cfg.rope_dim:
        problems.trap("mla-as-mqa", f"{key('attention.key_length_mla')} ({cfg.key_length_mla}) must exceed the rope "
                                    f"width ({cfg.rope_dim}): it is the per-head qk_nope + qk_rope")


def _check_experts(cfg: K3Config, problems: _Problems) -> None:
    if cfg.n_expert > MAX_EXPERTS_REFERENCE:
        problems.trap("expert-limit", f"{cfg.n_expert} experts exceed the reference build's LLAMA_MAX_EXPERTS "
                                      f"({MAX_EXPERTS_REFERENCE})")
    if cfg.n_layer_dense_lead < cfg.n_layer and not 0 < cfg.n_expert_used <= cfg.n_expert:
        problems.trap("expert-limit", f"expert_used_count {cfg.n_expert_used} must be in 1..expert_count "
                                      f"({cfg.n_expert})")
    if cfg.expert_latent_length <= 0:
        problems.trap("latent-experts", f"{key('expert_latent_length')} must be positive, "
                                        f"got {cfg.expert_latent_length}")
    if cfg.expert_gating_func != GATING_SIGMOID:
        problems.append(f"config: {key('expert_gating_func')} is {cfg.expert_gating_func}; kimi-k3 routes with "
                        f"sigmoid ({GATING_SIGMOID})")
    if cfg.situ_beta <= 0:
        problems.append(f"config: {key('activation.situ_beta')} must be positive, got {cfg.situ_beta}")


def _check_tensor_shapes(cfg: K3Config, problems: _Problems) -> None:
    want = expected_tensors(cfg)
    have = cfg.tensor_shapes
    for il in cfg.moe_layers:  # the latent-width trap first, with its own name
        for part in ("gate", "up", "down"):
            name = f"blk.{il}.ffn_{part}_exps.weight"
            shp = have.get(name)
            if shp is None or shp in want[name]:
                continue
            axis = 1 if part == "down" else 0
            if len(shp) == 3 and shp[axis] == cfg.n_embd != cfg.expert_latent_length:
                problems.trap("latent-experts", f"{name} is {list(shp)}: experts at the hidden width {cfg.n_embd} "
                                                f"instead of the latent width {cfg.expert_latent_length}")
    for name, shapes in want.items():
        if name not in have:
            problems.trap("tensor-shapes", f"tensor {name} is missing (expected {list(shapes[0])})")
        elif have[name] not in shapes and not any(name in p for p in problems):
            problems.trap("tensor-shapes", f"tensor {name} is {list(have[name])}, expected {list(shapes[0])}")
    extra = sorted(set(have) - set(want))
    if extra:
        problems.trap("tensor-shapes", f"unexpected tensor(s) for this config: {', '.join(extra[:8])}"
                                       + (f" (+{len(extra) - 8} more)" if len(extra) > 8 else ""))


def _check_layer_tensors(cfg: K3Config, problems: _Problems) -> None:
    """Each layer's attention tensors agree with its kind by head_count_kv."""
    have = cfg.tensor_shapes
    for il in range(cfg.n_layer):
        kind = "MLA" if cfg.head_count_kv[il] else "KDA"
        other = f"blk.{il}.ssm_a" if kind == "MLA" else f"blk.{il}.attn_kv_a_mqa.weight"
        if other in have:
            problems.trap("layer-kinds", f"layer {il} is {kind} by head_count_kv but carries "
                                         f"{'KDA' if kind == 'MLA' else 'MLA'} tensors ({other})")


def load_k3_config(first_shard: Path, full_attn_layers: Sequence[int] | None = None) -> K3Config:
    """Read a kimi-k3 GGUF's metadata (all shards beside the first), check it, return its config.

    `full_attn_layers` (1-indexed, as the HF config) is checked against the per-layer head_count_kv
    when given. Raises :class:`InputError` whose message names every trap found.
    """
    return config_from_header(read_header(Path(first_shard)), full_attn_layers)
