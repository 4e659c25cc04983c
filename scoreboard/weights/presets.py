"""Named, typed specs of generated Kimi-K3-architecture models (chosen by explicit key, never by file name)."""

from __future__ import annotations

import dataclasses
import difflib
import struct
from dataclasses import dataclass

from ..errors import InputError
from ..models.k3 import GATING_SIGMOID, K3Config

WEIGHT_TYPES = ("f32", "f16", "q8_0")
CORPUS_V1 = "d999925c74e975a3c0522c2315b04b6bd19bba1a4980c68143170acef1d8bbe3"  # sha256 of data/corpus.txt


def _f32(x: float) -> float:
    """The value a float32 GGUF key reads back as."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


@dataclass(frozen=True)
class K3Spec:
    """Everything that determines a generated kimi-k3 GGUF, byte for byte (with the seed)."""

    name: str
    description: str
    # architecture
    n_layer: int
    full_attn_layers: tuple[int, ...]  # 1-indexed MLA layers, as the HF config lists them
    n_embd: int
    n_head: int
    kda_head_dim: int
    ssm_conv_kernel: int
    kda_gate_lower_bound: float
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_dim: int
    rope_dim: int
    v_head_dim: int
    n_layer_dense_lead: int
    dense_ff: int
    n_expert: int
    n_expert_used: int
    n_expert_shared: int
    expert_ff: int
    expert_latent_length: int
    expert_weights_scale: float
    situ_beta: float
    situ_linear_beta: float
    attn_res_block_size: int
    n_vocab: int  # 256 byte symbols + learned merges + [BOS] + [EOS]
    corpus_sha256: str  # the tokenizer's training text (scoreboard/data/corpus.txt): an input to the bytes
    context_length: int
    rms_norm_eps: float = 1e-5
    # file
    weight_type: str = "f16"  # matrices; 1-D tensors, conv and ssm_a stay f32
    n_shards: int = 1
    default_seed: int = 0
    # damping (random K3 weights are chaotic unless damped: near-hard-max residual softmax, routing flips)
    res_score_std: float = 0.03  # cross-layer residual scores: softmax stays near uniform
    branch_gain: float = 0.5  # RMS of each residual branch relative to its normalized input
    gate_preact_std: float = 3.0  # situ gate pre-activation: comparable to situ_beta so the key matters
    router_logit_std: float = 2.0  # wide router logits: fewer near-ties, fewer top-k flips
    logit_std: float = 2.5  # output logits
    expert_bias_std: float = 0.1  # exp_probs_b: the expert-score correction bias added before top-k
    # Routing code (see generate.py, "routing code"): off = the router reads the whole stream at random.
    route_code: bool = False
    route_code_amp: float = 1.0  # code values in the embedding: +-amp*(1..1.5), like the other dims (std 1)
    route_margin: float = 4.0  # nominal router logit of the weakest selected expert (and minus, strongest unselected)
    router_context_std: float = 0.0  # with the code: std of the router's context term (logit units)

    @property
    def code_dims(self) -> tuple[int, ...]:
        """Residual-stream dims that carry the routing code (the last n_expert), or () without one."""
        return tuple(range(self.n_embd - self.n_expert, self.n_embd)) if self.route_code else ()

    def config(self) -> K3Config:
        """The K3Config a GGUF written from this spec declares (no files)."""
        hkv = tuple(1 if (il + 1) in self.full_attn_layers else 0 for il in range(self.n_layer))
        return K3Config(
            n_layer=self.n_layer, n_embd=self.n_embd, n_vocab=self.n_vocab, n_head=self.n_head, head_count_kv=hkv,
            rms_norm_eps=_f32(self.rms_norm_eps), q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
            rope_dim=self.rope_dim, key_length_mla=self.qk_nope_dim + self.rope_dim, value_length_mla=self.v_head_dim,
            key_length=self.kv_lora_rank + self.rope_dim, value_length=self.kv_lora_rank,
            kda_head_dim=self.kda_head_dim, ssm_conv_kernel=self.ssm_conv_kernel,
            kda_gate_lower_bound=self.kda_gate_lower_bound, n_layer_dense_lead=self.n_layer_dense_lead,
            dense_ff=self.dense_ff, n_expert=self.n_expert, n_expert_used=self.n_expert_used,
            n_expert_shared=self.n_expert_shared, expert_ff=self.expert_ff,
            expert_latent_length=self.expert_latent_length, expert_weights_scale=self.expert_weights_scale,
            expert_weights_norm=True, expert_gating_func=GATING_SIGMOID, situ_beta=self.situ_beta,
            situ_linear_beta=self.situ_linear_beta, attn_res_block_size=self.attn_res_block_size,
            context_length=self.context_length, bos_token_id=self.n_vocab - 2, eos_token_id=self.n_vocab - 1,
        )

    def validate(self) -> None:
        """Refuse a spec llama.cpp could not load or that would not exercise the architecture."""
        problems = []
        if self.weight_type not in WEIGHT_TYPES:
            problems.append(f"weight_type {self.weight_type!r} is not one of {WEIGHT_TYPES}")
        if any(not 1 <= x <= self.n_layer for x in self.full_attn_layers):
            problems.append(f"full_attn_layers {list(self.full_attn_layers)} must be 1-indexed in 1..{self.n_layer}")
        if not self.full_attn_layers or len(set(self.full_attn_layers)) == self.n_layer:
            problems.append("need at least one KDA and one MLA layer (llama.cpp aborts at context creation)")
        if self.n_vocab < 258 + 1:
            problems.append(f"n_vocab {self.n_vocab} leaves no room for merges (256 bytes + 2 specials)")
        if not 1 <= self.n_expert_used <= self.n_expert:
            problems.append(f"n_expert_used {self.n_expert_used} must be in 1..{self.n_expert}")
        if self.route_code and not 16 <= 4 * self.n_expert <= self.n_embd:
            problems.append(f"route_code needs 4 <= n_expert <= n_embd/4 (code dims are part of the stream), "
                            f"got {self.n_expert} experts at n_embd {self.n_embd}")
        if self.route_code and self.n_expert_used >= self.n_expert:
            problems.append("route_code with every expert active routes nothing: n_expert_used < n_expert")
        if self.n_shards < 1:
            problems.append(f"n_shards must be >= 1, got {self.n_shards}")
        if self.weight_type == "q8_0":
            cfg = self.config()
            from ..models.k3 import expected_tensors
            bad = [n for n, s in expected_tensors(cfg).items() if len(s[0]) in (2, 3) and s[0][0] % 32]
            if bad:
                problems.append(f"q8_0 needs rows that are multiples of 32: {', '.join(bad[:4])}")
        if problems:
            raise InputError(f"spec {self.name!r}: " + "; ".join(problems),
                             "fix the preset in scoreboard/weights/presets.py")


_K3_MINI = K3Spec(
    name="k3-mini",
    description="tiny Kimi K3 for CPU rounds and CI: 6 layers (4 KDA + 2 MLA at 1-indexed 3, 6), latent MoE "
                "8 experts top-2 + 1 shared, situ, residual attention every 2 layers, byte-level BPE vocab 512",
    n_layer=6, full_attn_layers=(3, 6), n_embd=256, n_head=2, kda_head_dim=128, ssm_conv_kernel=4,
    kda_gate_lower_bound=-5.0, q_lora_rank=128, kv_lora_rank=128, qk_nope_dim=64, rope_dim=64, v_head_dim=64,
    n_layer_dense_lead=1, dense_ff=256, n_expert=8, n_expert_used=2, n_expert_shared=1, expert_ff=128,
    expert_latent_length=128, expert_weights_scale=2.0, situ_beta=4.0, situ_linear_beta=25.0,
    attn_res_block_size=2, n_vocab=512, corpus_sha256=CORPUS_V1, context_length=8192,
    weight_type="f32", n_shards=3, default_seed=0,
)

_K3_MINI_SMOOTH = dataclasses.replace(
    _K3_MINI, name="k3-mini-smooth", n_expert_used=8,
    description="k3-mini with every routed expert active (no top-k routing flips), for tight numerical checks")

_K3_MID = K3Spec(
    name="k3-mid",
    description="about 1.7 B parameters for GPU runs: 8 layers (6 KDA + 2 MLA at 1-indexed 4, 8), n_embd 2048, "
                "16 heads, 64 experts top-8 + 1 shared; generated on the GPU box, never committed",
    n_layer=8, full_attn_layers=(4, 8), n_embd=2048, n_head=16, kda_head_dim=128, ssm_conv_kernel=4,
    kda_gate_lower_bound=-5.0, q_lora_rank=1536, kv_lora_rank=512, qk_nope_dim=128, rope_dim=64, v_head_dim=128,
    n_layer_dense_lead=1, dense_ff=8192, n_expert=64, n_expert_used=8, n_expert_shared=1, expert_ff=1024,
    expert_latent_length=1024, expert_weights_scale=2.0, situ_beta=4.0, situ_linear_beta=25.0,
    attn_res_block_size=2, n_vocab=1024, corpus_sha256=CORPUS_V1, context_length=65536,
    weight_type="f16", n_shards=4, default_seed=0,
)

# Kimi K3's real per-layer widths (its public config), 3 layers: KDA (dense lead), KDA + MoE, MLA + MoE. Two MoE
# layers of 896 experts are 59.2 B parameters: q8_0 on disk (63 GB), then llama-quantize to IQ1_S with an
# importance matrix on the 8x H200 box (an IQ1_S without one is refused by llama-quantize). Never on CI.
_K3_SLICE = K3Spec(
    name="k3-slice",
    description="Kimi K3 at its real per-layer widths for the 8x H200 scaling runs: hidden 7168, 96 MLA/KDA heads, "
                "896 experts top-16 + 2 shared at latent 3584 / FFN 3072, dense FFN 33792; 3 layers (2 KDA, "
                "MLA at 1-indexed 3), 2 of them MoE",
    n_layer=3, full_attn_layers=(3,), n_embd=7168, n_head=96, kda_head_dim=128, ssm_conv_kernel=4,
    kda_gate_lower_bound=-5.0, q_lora_rank=1536, kv_lora_rank=512, qk_nope_dim=128, rope_dim=64, v_head_dim=128,
    n_layer_dense_lead=1, dense_ff=33792, n_expert=896, n_expert_used=16, n_expert_shared=2, expert_ff=3072,
    expert_latent_length=3584, expert_weights_scale=2.0, situ_beta=4.0, situ_linear_beta=25.0,
    attn_res_block_size=12, n_vocab=1024, corpus_sha256=CORPUS_V1, context_length=262144,
    weight_type="q8_0", n_shards=8, default_seed=0,
)

# The GPU-target models. Both route through the routing code (generate.py), so f16/bf16 rounding cannot
# flip a top-k choice, and scale the residual-score init with 1/sqrt(n_embd) so the cross-layer mix stays
# soft at any width (score std 0.5; a fixed 0.03 per dim gives std 2.5 at 7168).
_K3_GPU = dataclasses.replace(
    _K3_MID, name="k3-gpu",
    description="about 1.7 B parameters for the one-H200 target: k3-mid's shape (8 layers, 6 KDA + 2 MLA at "
                "1-indexed 4, 8; n_embd 2048, 16 heads, 64 experts top-8 + 1 shared) with the routing code, "
                "so f16 rounding cannot flip a routing choice; generated on the GPU box, never committed",
    res_score_std=0.5 / 2048 ** 0.5, expert_bias_std=0.02, route_code=True, router_context_std=0.1,
)

# One Kimi K3 layer's per-token work on one H200: K3's widths (hidden 7168, 96 MLA/KDA heads, q_lora 1536,
# kv_lora 512, dense FFN 33792, top-16 at latent 3584 / FFN 3072, 2 shared experts) in 3 layers (KDA dense
# lead, KDA + MoE, MLA + MoE). 64 routed experts, not 896: batch-1 decode reads only the 16 selected, so
# its bytes and FLOPs per token are a K3 layer's at any count >= 16, while 896 would be 59 B parameters
# (118 GB at F16: past the box's 64 GiB disk, and about 20 minutes to generate). 64 keeps routing a real
# choice (a quarter active, a different set per token and layer) and prefill spreading over many experts,
# at 6.5 B parameters (12.9 GB F16; 154 s to generate on one H200 box). Residual block size 2 gives
# the MLA layer two checkpoints, so the bank's stride trap is observable.
_K3_WIDE = dataclasses.replace(
    _K3_SLICE, name="k3-wide",
    description="a Kimi K3 width slice for the one-H200 target: hidden 7168, 96 MLA/KDA heads, dense FFN "
                "33792, 64 routed experts top-16 + 2 shared at latent 3584 / FFN 3072; 3 layers (2 KDA, MLA "
                "at 1-indexed 3), 2 of them MoE, with the routing code; generated on the GPU box, never committed",
    n_expert=64, attn_res_block_size=2, context_length=65536, weight_type="f16",
    res_score_std=0.5 / 7168 ** 0.5, expert_bias_std=0.02, route_code=True, router_context_std=0.1,
)

# The flagship's context on one H200: the same tensors as k3-gpu / k3-wide (every tensor's stream is seeded by the
# seed and the tensor's name alone, generate.py), declaring a context of 262144 so decode can be scored at depth
# 131072 (the flagship's DECODE_128K) with headroom; 65536 stopped both presets short of it. New names, new pins:
# the depth-1024 targets keep their own files and history.
_K3_GPU_LONG = dataclasses.replace(
    _K3_GPU, name="k3-gpu-long", context_length=262144,
    description="k3-gpu's tensors (8 layers, 6 KDA + 2 MLA, 64 experts top-8, routing code) declaring a 262144-token "
                "context, for decode at depth 131072 and prefill 32768 on one H200")
_K3_WIDE_LONG = dataclasses.replace(
    _K3_WIDE, name="k3-wide-long", context_length=262144,
    description="k3-wide's tensors (hidden 7168, 96 heads, 64 experts top-16 at latent 3584) declaring a 262144-token "
                "context, for decode at depth 131072 and prefill 32768 on one H200")

PRESETS: dict[str, K3Spec] = {s.name: s for s in (_K3_MINI, _K3_MINI_SMOOTH, _K3_MID, _K3_SLICE, _K3_GPU, _K3_WIDE,
                                                  _K3_GPU_LONG, _K3_WIDE_LONG)}


def get_spec(name: str) -> K3Spec:
    """A preset by its exact name; unknown names get did-you-mean."""
    if name in PRESETS:
        return PRESETS[name]
    close = difflib.get_close_matches(name, PRESETS, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"presets: {', '.join(PRESETS)}"
    raise InputError(f"unknown model spec {name!r}", hint)
