"""Kimi K3 (`kimi-k3`) forward pass in pure torch: no I/O, no clocks, no config defaults.

An independent implementation of the architecture the pinned llama.cpp runs
(``src/models/kimi-k3.cpp`` of llama-cpp-python==0.3.36's vendor/llama.cpp). Shapes in comments:
T = tokens in this call, S = tokens in the cache, E = n_embd, H = heads, V = vocab.

Numerics, chosen to agree with llama.cpp's CPU backend:
- norms, softmaxes, router, KDA state and conv state in float32, whatever the compute dtype;
- with float32 compute, a matmul's activation is rounded as ggml rounds it for the weight's GGUF type
  (none for F32, f16 for F16, q8_0/q8_K blocks for quantized weights; see Mat);
- the MLA latent cache is stored in float16 (llama.cpp's default KV cache type), attention over it in f32 (with
  the CUDA kernels on: one decoded token's scores from q in one f16 part, kernels.mla_decode;
  a prefill call's attention in f16 through torch's fused attention over the decompressed keys and values,
  mla_sdpa, as llama.cpp's CUDA flash attention takes f16 q and k);
- KDA: the gated delta rule in a chunked (WY) form for prefill, the recurrent form for one token.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from .faults import Faults

Tensor = torch.Tensor

KDA_CHUNK_MAX = 16  # tokens per KDA chunk (llama.cpp's chunked KDA uses 16 too)
ATTN_SCORE_BUDGET = 1 << 26  # max elements of one MLA score block [T_blk, H, S]
CACHE_DTYPE = torch.float16  # llama.cpp's default KV cache type
ROUTER_WSUM_MIN = 6.103515625e-5  # build_moe_ffn clamps the weight sum to the smallest f16 normal


# ----------------------------------------------------------------------------------------------
# elementwise pieces

def rms_norm(x: Tensor, w: Tensor | None, eps: float) -> Tensor:
    """x / sqrt(mean(x^2) + eps) * w over the last axis, in float32. [..., D] -> [..., D] f32.

    torch's fused RMSNorm: one kernel on CUDA where the composite form launched six (pow, mean, add, rsqrt
    and two muls), and a decode step runs about 70 norms."""
    return F.rms_norm(x.float(), (x.shape[-1],), w, eps)


def l2_norm(x: Tensor, eps: float) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last axis (llama.cpp build_gdn_l2_norm). f32.

    sum(x^2) + eps = D * (mean(x^2) + eps / D): the fused RMSNorm at eps / D, scaled by 1 / sqrt(D)."""
    d = x.shape[-1]
    return F.rms_norm(x.float(), (d,), _inv_sqrt(d, x.device), eps / d)


_CONSTS: dict[tuple[Any, ...], Tensor] = {}


def _const(key: tuple[Any, ...], device: torch.device, make: Any) -> Tensor:
    """A small constant tensor, made once per (key, device) on first use (eagerly: the warm-up before a CUDA graph
    capture makes it, the captured step only reads it)."""
    full = (*key, str(device))
    if full not in _CONSTS:
        _CONSTS[full] = make().to(device)
    return _CONSTS[full]


def _inv_sqrt(d: int, device: torch.device) -> Tensor:
    """A [d] f32 vector of 1/sqrt(d): l2_norm's scale as RMSNorm's weight (one launch instead of two)."""
    return _const(("inv_sqrt", d), device, lambda: torch.full((d,), 1.0 / math.sqrt(d)))


def situ(g: Tensor, u: Tensor, beta: float, linear_beta: float) -> Tensor:
    """situ(g, u) = beta*tanh(g/beta)*sigmoid(g) * lb*tanh(u/lb); lb <= 0 leaves u linear."""
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta > 0:
        u = linear_beta * torch.tanh(u / linear_beta)
    return a * u


def situ_joint(h: Tensor, beta: float, linear_beta: float) -> Tensor:
    """situ of h = [g | u] [.., 2F] (one product of a stacked gate|up matrix) -> [.., F] f32, in five launches
    (scale, tanh, two products, sigmoid) where situ(g, u) takes nine: both tanh arguments scaled at once, the
    constants beta * lb folded into one multiply-add."""
    f = h.shape[-1] // 2
    g, u = h[..., :f], h[..., f:]
    if linear_beta > 0:
        t = torch.tanh(h * _situ_scale(f, beta, linear_beta, h.device))
        a = torch.addcmul(_zero(h.device), t[..., :f], t[..., f:], value=beta * linear_beta)
    else:
        a = torch.addcmul(_zero(h.device), torch.tanh(g * (1.0 / beta)), u, value=beta)
    return a * torch.sigmoid(g)


def _situ_scale(f: int, beta: float, linear_beta: float, device: torch.device) -> Tensor:
    """[2F] f32: 1/beta for the gate half, 1/lb for the up half."""
    return _const(("situ", f, beta, linear_beta), device,
                  lambda: torch.cat([torch.full((f,), 1.0 / beta), torch.full((f,), 1.0 / linear_beta)]))


def _zero(device: torch.device) -> Tensor:
    return _const(("zero",), device, lambda: torch.zeros(()))


@dataclass
class Mat:
    """A weight matrix [out, in] (or stacked [n, out, in]) in the compute dtype, plus how its activation is
    rounded before the product: llama.cpp's CPU matmul converts the activation to the weight type's
    vec_dot_type (f16 for F16 weights, q8_0 blocks for Q8_0, q8_K for K/IQ quants). None = not at all."""

    w: Tensor
    act: str | None = None
    splits: tuple[int, ...] = ()  # a fused stack of several matrices: their output widths


# matrices that read the same input, fused into one product at load when they share a type (weights.py);
# exps_in stacks each expert's gate and up rows ([X, 2F, lat]: one gathered or grouped product for both)
FUSED = {
    "kda_in": ("attn_q", "attn_k", "attn_v", "ssm_f_a", "ssm_beta", "ssm_g"),
    "mla_in": ("attn_q_a", "attn_q", "attn_kv_a_mqa", "attn_gate"),
    "dense_in": ("ffn_gate", "ffn_up"),
    "moe_in": ("ffn_routed_down", "ffn_gate_shexp", "ffn_up_shexp"),
    "exps_in": ("ffn_gate_exps", "ffn_up_exps"),
}


class Products(dict[str, Tensor]):
    """project()'s result, {key: [.., out]}; when the group was fused, the keys are column ranges of one
    product, and `span` reads neighbours joined (no copy)."""

    full: Tensor | None = None
    cols: dict[str, tuple[int, int]] = {}

    def span(self, first: str, last: str) -> Tensor | None:
        """Columns of `first` through `last` of the one product, or None when the group was not fused."""
        if self.full is None or first not in self.cols or last not in self.cols:
            return None
        return self.full[..., self.cols[first][0]:self.cols[last][1]]


def project(lw: dict[str, Any], group: str, x: Tensor, lin: Any = None) -> Products:
    """The products of x with every matrix of a FUSED group that the layer has: {key: [.., out]}
    (each through `lin`, default `linear`)."""
    lin = lin or linear
    if group not in lw:
        return Products({k: lin(x, lw[k]) for k in FUSED[group] if k in lw})
    m = lw[group]
    out = Products(zip(lw[group + ".keys"], (full := lin(x, m)).split(m.splits, -1)))
    ends = [sum(m.splits[:i + 1]) for i in range(len(m.splits))]
    out.full, out.cols = full, {k: (e - w, e) for k, w, e in zip(lw[group + ".keys"], m.splits, ends)}
    return out


def situ_of(p: Products, gate: str, up: str, beta: float, linear_beta: float) -> Tensor:
    """situ of two products: joined when they are neighbours of one fused product of equal widths."""
    h = p.span(gate, up)
    if h is not None and p[gate].shape[-1] == p[up].shape[-1]:
        return situ_joint(h, beta, linear_beta)
    return situ(p[gate], p[up], beta, linear_beta)


def round_act(x: Tensor, kind: str | None) -> Tensor:
    """x [..., in] f32 rounded as ggml rounds a matmul's activation to `kind` (see Mat)."""
    if kind is None:
        return x
    if kind == "f16":
        return x.half().float()
    if kind == "bf16":
        return x.bfloat16().float()
    block = {"q8_0": 32, "q8_K": 256}[kind]
    shp = x.shape
    xb = x.float().reshape(*shp[:-1], shp[-1] // block, block)
    if kind == "q8_0":  # d = amax/127 stored as f16, q = round(x * 127/amax)
        amax = xb.abs().amax(-1, keepdim=True)
        iscale = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
        d = (amax / 127.0).half().float()
        q = torch.round(xb * iscale)
    else:  # q8_K: the signed value of largest magnitude maps to -127; d = 1/iscale in f32
        idx = xb.abs().argmax(-1, keepdim=True)
        mx = xb.gather(-1, idx)
        iscale = torch.where(mx != 0, -127.0 / mx, torch.zeros_like(mx))
        d = torch.where(mx != 0, 1.0 / iscale, torch.zeros_like(mx))
        q = torch.round(xb * iscale).clamp(max=127)
    return (q * d).reshape(shp)


def linear(x: Tensor, m: Mat) -> Tensor:
    """x @ w.T in the compute dtype, result f32. x [.., in], w [out, in] -> [.., out]."""
    return F.linear(round_act(x.float(), m.act).to(m.w.dtype), m.w).float()


# ----------------------------------------------------------------------------------------------
# state

@dataclass
class KDAState:
    conv: Tensor  # [3*d_inner, d_conv-1] f32: the last d_conv-1 pre-conv q|k|v projections
    s: Tensor  # [H, dk, dv] f32: the delta-rule state S[i=key, j=value]


@dataclass
class MLAState:
    latent: Tensor  # [n_ctx, kv_lora + rope] f16: normed compressed kv | k_pe, one row per token


@dataclass
class K3Cache:
    """Everything one sequence carries between calls. `n_past` = tokens already consumed."""

    layers: dict[int, Any]
    n_ctx: int
    n_past: int = 0


# ----------------------------------------------------------------------------------------------
# the model

@dataclass
class K3Weights:
    """Weights in torch layouts (see weights.py): globals and one dict per layer; matrices are Mat,
    vectors (norms, scores, biases, ssm_a) and the conv taps are float32 tensors."""

    tok_embd: Tensor  # [V, E]
    output_norm: Tensor  # [E] f32
    output: Mat  # [V, E]
    output_res_score: Tensor | None  # [E] f32
    layers: list[dict[str, Any]] = field(default_factory=list)


class K3Model:
    """A loaded kimi-k3: `forward` consumes T tokens into a cache and returns the logits asked for."""

    def __init__(self, cfg: Any, w: K3Weights, faults: Faults | None = None):
        self.cfg = cfg
        self.w = w
        self.faults = faults = faults or Faults()
        self.device = w.tok_embd.device
        n = cfg.n_layer
        # which layer's attention block (kind, weights, cache) runs at each layer position
        self.attn_src = [(i - 1) % n if faults.full_attn_0_indexed else i for i in range(n)]
        # chunk of the chunked delta rule: bounded by the gate's lower bound (K3: -5 -> 16); without a
        # bound (kimi-linear's softplus gate) decays are unbounded and 1-token chunks are the safe form
        lb = cfg.kda_gate_lower_bound
        self.kda_chunk = 1 if lb is None else _kda_chunk_for(lb)
        # the Triton kernels (kernels.py) in place of torch ops: one token's layers, the prefill's KDA recurrence
        # and grouped experts. Set by enable_kernels once each kernel matched its torch form on these weights
        self.use_kernels = False
        self.kernel_errors: dict[str, float] = {}  # each kernel's relative error against its torch form
        self.mla_prefill = MLA_PREFILL_FORMS[0]  # the prefill's MLA attention with the kernels on (enable_kernels)
        # one token's MoE layer with the kernels: its router, shared expert and routed experts on two side streams of
        # the GPU (_moe_token); the expert-parallel model turns it off (its collective stays on one stream)
        self.moe_branches = True
        self._sides: tuple[Any, ...] = ()

    def enable_kernels(self) -> str:
        """Use the Triton kernels (kernels.py) — for one token: the products up to VEC_MAX_ELEMENTS with their
        norms and residual adds, KDA, MLA, the residual mix, routing, the routed experts and situ; for the
        prefill: the KDA chunk recurrence and the grouped expert products — once each agrees with the torch
        form it replaces on this model's own weights (relative error < KERNEL_CHECK_TOL on random inputs, the
        same experts chosen). Returns a note saying what was chosen and why, which the engine records in its
        identity. Compiles the kernels, so call it before any CUDA graph capture; off, every path is torch."""
        c = self.cfg
        moe = [lw for il, lw in enumerate(self.w.layers) if il >= c.n_layer_dense_lead]
        if not moe or any(_kernel_mats(lw) is None for lw in moe) or not _route_fits(c.n_expert_used):
            return "torch: the routed experts are not stacked gate|up in f16/bf16 with a power-of-two top-k"
        try:
            from . import kernels
        except ImportError as exc:
            return f"torch: triton unavailable ({exc})"
        try:
            errs = self._kernel_errors(kernels, moe[0])
            if all(e < KERNEL_CHECK_TOL for e in errs.values()):
                errs["forward"] = self._forward_error()
        except Exception as exc:  # a compile or launch failure on this box: the torch form still runs
            self.use_kernels = False
            return f"torch: a Triton kernel failed here ({type(exc).__name__}: {exc})"
        bad = [f"{k} {e:.3g}" for k, e in errs.items() if not e < KERNEL_CHECK_TOL]
        if bad:
            return "torch: the Triton kernels disagreed with the torch form (relative error " + ", ".join(bad) + ")"
        self.use_kernels = True
        self.kernel_errors = errs
        # what was checked, not the errors: the note is part of the engine identity, which every launch of a
        # round must repeat exactly (the errors are on the model, for diagnosis)
        branches = ", moe branches on 2 side streams" if self._side_streams() else ""
        return f"triton {kernels.triton.__version__}: " + ", ".join(errs) + branches

    def _forward_error(self) -> float:
        """The whole model with the kernels against the torch form, from fresh caches: a 32-token prefill (the
        KDA scan over two chunks, the grouped experts) and one decoded token fed the same token to both; the
        relative error of their logits. It also compiles every product variant the forward uses, so none
        compiles later in a timed step."""
        dev = self.device
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, self.cfg.n_vocab, (32,), generator=gen).to(dev)
        last, row0 = torch.tensor([31], device=dev), torch.zeros(1, dtype=torch.long, device=dev)
        cache = self.new_cache(64)
        first = self.forward(ids, cache, last)
        tok = first.argmax(-1)  # type: ignore[union-attr]  # rows were asked for: never None
        want = torch.cat([first, self.forward(tok, cache, row0)])  # type: ignore[list-item]

        def kernel_form() -> Tensor:  # the same prefill, then the same token fed
            kc = self.new_cache(64)
            return torch.cat([self.forward(ids, kc, last), self.forward(tok, kc, row0)])  # type: ignore[list-item]

        got = self._with_kernels(kernel_form)
        return float((got - want).norm() / want.norm().clamp_min(1e-30))

    def _with_kernels(self, fn: Any) -> Any:
        """fn() with the kernels on: the self-check's kernel form (they stay off until every check passes)."""
        self.use_kernels = True
        try:
            return fn()
        finally:
            self.use_kernels = False

    def _kernel_errors(self, kernels: Any, lw: dict[str, Any]) -> dict[str, float]:
        """Each kernel's relative error against the torch form (self.use_kernels is still off), on random
        inputs and this model's weights: the first MoE layer's experts and routing, a KDA layer's step, situ,
        the residual mix, and the smallest product of each kind the product kernel takes."""
        c, dev = self.cfg, self.device
        gen = torch.Generator().manual_seed(0)

        def rnd(*shape: int) -> Tensor:
            return torch.randn(*shape, generator=gen).to(dev)

        def rel(got: Tensor, want: Tensor) -> float:
            return float((got - want).norm() / want.norm().clamp_min(1e-30))

        xin, wts = rnd(1, c.expert_latent_length), torch.rand(c.n_expert_used, generator=gen).to(dev)
        sel = torch.randperm(c.n_expert, generator=gen)[:c.n_expert_used].to(dev)
        w_in, w_down = _kernel_mats(lw)  # type: ignore[misc]  # the caller checked every MoE layer
        errs = {"experts": rel(kernels.decode_experts(xin, sel, wts, w_in, w_down, c.situ_beta, c.situ_linear_beta),
                               self._decode_experts(lw, xin, sel, wts))}
        logits = rnd(1, c.n_expert)
        k_sel, k_wts = kernels.route(logits, lw["exp_probs_b"], c.n_expert_used, c.expert_gating_func == 2,
                                     bool(c.expert_weights_norm), c.expert_weights_scale, ROUTER_WSUM_MIN)
        t_sel, t_wts = self._route(lw, logits)
        errs["route"] = rel(k_wts, t_wts[0]) if torch.equal(k_sel, t_sel[0]) else float("inf")
        h = rnd(1, 2 * c.expert_ff)
        errs["situ"] = rel(kernels.situ_vec(h, c.situ_beta, c.situ_linear_beta),
                           situ_joint(h, c.situ_beta, c.situ_linear_beta))
        vec = [m for m in (self.w.output, *(v for lw in self.w.layers for v in lw.values()))
               if isinstance(m, Mat) and _vec_fits(m)]
        kda = [il for il in range(c.n_layer) if c.head_count_kv[il] == 0]
        if kda and self._kda_kernel_fits():  # one KDA layer's step from a random state, both forms
            klw, x = self.w.layers[kda[0]], rnd(1, c.n_embd)
            state = self.new_cache(1).layers[kda[0]]
            state.conv.copy_(rnd(*state.conv.shape))
            state.s.copy_(rnd(*state.s.shape) * 0.1)
            twin = KDAState(conv=state.conv.clone(), s=state.s.clone())
            want = self._kda(klw, x, twin)
            got = self._with_kernels(lambda: self._kda(klw, x, state))
            errs["kda"] = max(rel(got, want), rel(state.s, twin.s), rel(state.conv, twin.conv))
        scan = self._scan_if_on(c.kda_head_dim)
        # the prefill's chunk recurrence, both forms, over 3 and 16 chunks (Triton compiles an integer argument
        # divisible by 16 apart: a 2048-token call is 128 chunks, and no variant should compile in a timed rep)
        for n_chunks in (3, 16) if kda and scan is not None else ():
            h, hd, ch = c.n_head, c.kda_head_dim, self.kda_chunk
            tt = n_chunks * ch
            qq, kk, vv = l2_norm(rnd(tt, h, hd), 1e-6), l2_norm(rnd(tt, h, hd), 1e-6), rnd(tt, h, hd)
            g = -torch.rand(tt, h, hd, generator=gen).to(dev)
            beta, s0 = torch.rand(tt, h, generator=gen).to(dev), rnd(h, hd, hd)
            o_t, s_t = delta_rule_chunked(qq, kk, vv, g, beta, s0, 0.1, ch)
            o_k, s_k = delta_rule_chunked(qq, kk, vv, g, beta, s0, 0.1, ch, scan)
            errs[f"chunk scan {n_chunks}"] = max(rel(o_k, o_t), rel(s_k, s_t))
        counts = [0] * c.n_expert  # the prefill's grouped products: an empty group, a partial tile, several tiles
        counts[0], counts[-1], counts[c.n_expert // 2] = 3, 70, 1
        xg = rnd(sum(counts), c.expert_latent_length)
        offs = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
        errs["grouped"] = rel(grouped_linear(xg, lw["exps_in"], offs, counts, kernels.grouped_mm),
                              grouped_linear(xg, lw["exps_in"], offs, counts))
        mla = [il for il in range(c.n_layer) if c.head_count_kv[il] > 0]
        if mla:  # one MLA layer's token at position 37 over a random cache, both forms
            mlw, x = self.w.layers[mla[0]], rnd(1, c.n_embd)
            mst: MLAState = self.new_cache(64).layers[mla[0]]
            if self._mla_kernel_fits(mlw, mst):
                mst.latent.copy_(rnd(*mst.latent.shape).to(mst.latent.dtype))
                mtwin = MLAState(latent=mst.latent.clone())
                at = torch.tensor([37], device=dev)
                want = self._mla(mlw, x, mtwin, at, 64)
                got = self._with_kernels(lambda: self._mla(mlw, x, mst, at, 64))
                errs["mla"] = max(rel(got, want), rel(mst.latent.float(), mtwin.latent.float()))
                errs.update(self._mla_prefill_error(mlw, mtwin, rnd(40, c.n_embd), rel))
        if c.attn_res_block_size > 0:
            e, rows = c.n_embd, self._res_rows()
            for n_ckpt in sorted({1, rows - 1}):
                bank, cur, score = rnd(1, n_ckpt, e), rnd(1, e), rnd(e) * 0.05
                want = self._res_mix(cur, bank, score)
                errs[f"res_mix {n_ckpt}"] = rel(kernels.res_mix(bank, cur, score, c.rms_norm_eps, rows), want)
        # Triton specializes an integer argument on its divisibility by 16: one product of each kind compiles
        # here, so none compiles in a timed step
        by_kind = {(m.w.shape[0] % 16 == 0, m.w.shape[1] % 16 == 0): m for m in sorted(vec, key=lambda v: -v.w.numel())}
        for m in by_kind.values():
            xv = rnd(1, m.w.shape[1])
            errs[f"product {tuple(m.w.shape)}"] = rel(kernels.linear_vec(xv, m.w), linear(xv, m))
        if vec:  # with the RMSNorm prologue and/or the residual epilogue (each combination is its own compile)
            m = min(vec, key=lambda v: v.w.numel())
            xv, nw, add = rnd(1, m.w.shape[1]), rnd(m.w.shape[1]).abs(), rnd(1, m.w.shape[0])
            for use_norm, use_add in ((True, False), (False, True), (True, True)):
                n_, a_ = (nw if use_norm else None), (add if use_add else None)
                want = linear(rms_norm(xv, nw, c.rms_norm_eps) if use_norm else xv, m)
                want = want if a_ is None else a_ + want
                name = "product" + "+norm" * use_norm + "+add" * use_add
                errs[name] = rel(kernels.linear_vec(xv, m.w, n_, c.rms_norm_eps, a_), want)
        return errs

    def _mla_prefill_error(self, lw: dict[str, Any], st: MLAState, x: Tensor, rel: Any) -> dict[str, float]:
        """The prefill's MLA attention with the kernels (a call of x's T tokens after 24 cached rows of st) against
        the torch form, in the first of MLA_PREFILL_FORMS that runs on this box and agrees; sets mla_prefill to it.
        -> {"mla prefill <form>": relative error} (of the last form tried, when none agrees)."""
        want = self._mla(lw, x, MLAState(latent=st.latent.clone()), 24)
        err, form = float("inf"), MLA_PREFILL_FORMS[-1]
        for form in MLA_PREFILL_FORMS:
            self.mla_prefill = form
            try:
                got = self._with_kernels(lambda: self._mla(lw, x, MLAState(latent=st.latent.clone()), 24))
            except RuntimeError:  # e.g. no fused attention kernel takes these shapes here
                continue
            err = rel(got, want)
            if err < KERNEL_CHECK_TOL:
                break
        return {f"mla prefill {form}": err}

    # -- state ---------------------------------------------------------------------------------
    def new_cache(self, n_ctx: int) -> K3Cache:
        c, dev = self.cfg, self.device
        layers: dict[int, Any] = {}
        for i in range(c.n_layer):
            if c.head_count_kv[i] == 0:
                di = c.kda_inner
                layers[i] = KDAState(conv=torch.zeros(3 * di, c.ssm_conv_kernel - 1, device=dev),
                                     s=torch.zeros(c.n_head, c.kda_head_dim, c.kda_head_dim, device=dev))
            else:
                layers[i] = MLAState(latent=torch.zeros(n_ctx, c.kv_lora_rank + c.rope_dim, dtype=CACHE_DTYPE,
                                                        device=dev))
        return K3Cache(layers=layers, n_ctx=n_ctx)

    # -- forward -------------------------------------------------------------------------------
    def forward(self, ids: Tensor, cache: K3Cache, out_rows: Tensor | None = None, pos: Tensor | None = None,
                span: int = 0) -> Tensor | None:
        """Consume ids [T] at positions n_past.. into `cache`; logits [R, V] f32 for rows `out_rows` [R].

        Static single-token mode (the CUDA-graph step, graph.py): with `pos` [1] long on the device, the one
        token goes to position pos and attends over the first `span` latent rows, those beyond pos masked;
        cache.n_past is neither read nor advanced, so no shape and no host value depends on the position.
        """
        c = self.cfg
        t = int(ids.shape[0])
        if pos is not None:
            if t != 1 or not 0 < span <= cache.n_ctx:
                raise ValueError(f"static step: needs 1 token (got {t}) and 0 < span {span} <= n_ctx {cache.n_ctx}")
        elif cache.n_past + t > cache.n_ctx:
            raise ValueError(f"context overflow: {cache.n_past} + {t} tokens > n_ctx {cache.n_ctx}")
        x = self.w.tok_embd[ids].float()  # [T, E] residual stream, f32
        fuse = self.use_kernels and t == 1
        bank: Tensor | None = None  # [T, C, E] raw checkpoints of the residual stream
        use_res = c.attn_res_block_size > 0
        for il in range(c.n_layer):
            lw = self.w.layers[il]
            prefix = x
            cur = self._res_mix(prefix, bank, lw["attn_res_score"]) if use_res else prefix
            banked = use_res and il % c.attn_res_block_size == 0
            if banked:  # bank the RAW layer input, then restart the stream from the attention output
                bank = prefix[:, None] if bank is None else torch.cat([bank, prefix[:, None]], 1)
            # one token with the decode kernels: each norm runs inside the product that reads it, each residual
            # add in the epilogue of the product that ends the block (kernels.linear_vec)
            norm = lw["attn_norm"] if fuse else None
            if not fuse:
                cur = rms_norm(cur, lw["attn_norm"], c.rms_norm_eps)
            res = prefix if fuse and not banked else None
            src = self.attn_src[il]
            if c.head_count_kv[src] == 0:
                cur = self._kda(self.w.layers[src], cur, cache.layers[src], norm, res)
            else:
                at = cache.n_past if pos is None else pos
                cur = self._mla(self.w.layers[src], cur, cache.layers[src], at, span, norm, res)
            prefix = cur if banked or fuse else prefix + cur
            cur = self._res_mix(prefix, bank, lw["ffn_res_score"]) if use_res else prefix
            ffn = self._dense if il < c.n_layer_dense_lead else self._moe
            if fuse:
                x = ffn(lw, cur, lw["ffn_norm"], prefix)
            else:
                x = prefix + ffn(lw, rms_norm(cur, lw["ffn_norm"], c.rms_norm_eps))
        if pos is None:
            cache.n_past += t
        if out_rows is None:
            return None
        if use_res:  # per token, so narrow to the output rows first
            score = self.w.output_res_score  # use_res: the model has one
            x = self._res_mix(x[out_rows], None if bank is None else bank[out_rows], score)  # type: ignore[arg-type]
        else:
            x = x[out_rows]
        return self._linear(x, self.w.output, self.w.output_norm)  # [R, V], normed first

    def _linear(self, x: Tensor, m: Mat, norm: Tensor | None = None, add: Tensor | None = None) -> Tensor:
        """add + linear(rms_norm(x, norm), m) (norm, add optional); for one token with the decode kernels on and
        a matrix they take, in one launch (kernels.linear_vec)."""
        if self.use_kernels and x.shape[0] == 1 and x.dim() == 2 and _vec_fits(m):
            from . import kernels

            return kernels.linear_vec(x, m.w, norm, self.cfg.rms_norm_eps, add)
        if norm is not None:
            x = rms_norm(x, norm, self.cfg.rms_norm_eps)
        y = linear(x, m)
        return y if add is None else add + y

    def _situ_of(self, p: Products, gate: str, up: str, beta: float, linear_beta: float) -> Tensor:
        """`situ_of`, or for one token with the decode kernels on and the halves joined, kernels.situ_vec."""
        h = p.span(gate, up)
        if self.use_kernels and h is not None and h.shape[0] == 1 and p[gate].shape[-1] == p[up].shape[-1]:
            from . import kernels

            return kernels.situ_vec(h, beta, linear_beta)
        return situ_of(p, gate, up, beta, linear_beta)

    def _gmm(self) -> Any:
        """kernels.grouped_mm for the prefill's routed experts when the kernels are on."""
        if not self.use_kernels:
            return None
        from . import kernels

        return kernels.grouped_mm

    def _scan(self, hd: int) -> Any:
        """kernels.chunk_scan for the prefill's KDA recurrence when the kernels are on and the shapes fit."""
        return self._scan_if_on(hd) if self.use_kernels else None

    def _scan_if_on(self, hd: int) -> Any:
        c = self.kda_chunk
        if all(x >= 16 and not x & (x - 1) for x in (c, hd)):
            from . import kernels

            return kernels.chunk_scan
        return None

    def _mla_kernel_fits(self, lw: dict[str, Any], st: MLAState) -> bool:
        """kernels.mla_decode's case: the absorbed form (not the mla_as_mqa fault), power-of-two widths, f16
        absorption matrices and cache."""
        c = self.cfg
        widths = (c.kv_lora_rank, c.rope_dim, c.qk_nope_dim, c.value_length_mla)
        wk, wv = lw["attn_k_b"], lw["attn_v_b"]
        return (not self.faults.mla_as_mqa and all(w > 0 and not w & (w - 1) for w in widths)
                and wk.act is None and wv.act is None and wk.w.dtype == wv.w.dtype == torch.float16
                and st.latent.dtype == torch.float16 and wk.w.is_contiguous() and wv.w.is_contiguous())

    def _kda_kernel_fits(self) -> bool:
        """kernels.kda_step's case: K3's lower-bounded gate and a power-of-two head dim."""
        hd = self.cfg.kda_head_dim
        return self.cfg.kda_gate_lower_bound is not None and hd > 0 and not hd & (hd - 1)

    def _res_rows(self) -> int:
        """Rows of the largest residual mix: every banked checkpoint (one per attn_res block) + the current."""
        c = self.cfg
        return -(-c.n_layer // c.attn_res_block_size) + 1 if c.attn_res_block_size > 0 else 1

    # -- cross-layer residual attention --------------------------------------------------------
    def _res_mix(self, cur: Tensor, bank: Tensor | None, score_w: Tensor) -> Tensor:
        """Softmax mix of the banked checkpoints and the current stream, scored on their RMS-normed
        values with `score_w` [E]; the sum uses the raw values. cur [T, E], bank [T, C, E] -> [T, E]."""
        if bank is None:
            return cur
        if self.use_kernels and cur.shape[0] == 1:
            from . import kernels

            return kernels.res_mix(bank, cur, score_w, self.cfg.rms_norm_eps, self._res_rows())
        t, n_ckpt, e = bank.shape
        if self.faults.res_strides_transposed:  # the [T, C, E] memory read as if it were [C, T, E]
            bank = bank.contiguous().view(n_ckpt, t, e).transpose(0, 1)
        # one pass over [checkpoints | current]: five launches (cat, fused norm, sum, softmax, one batched
        # product) where scoring the two apart and summing by broadcast took about twenty
        allc = torch.cat([bank, cur[:, None]], 1)  # [T, C+1, E]
        sc = rms_norm(allc, score_w, self.cfg.rms_norm_eps).sum(-1)  # [T, C+1]
        p = torch.softmax(sc, -1)
        return torch.bmm(p[:, None, :], allc)[:, 0]  # [T, E]

    # -- KDA (Kimi Delta Attention) ------------------------------------------------------------
    def _kda(self, lw: dict[str, Any], x: Tensor, st: KDAState, norm: Tensor | None = None,
             residual: Tensor | None = None) -> Tensor:
        """x [T, E] (normed, or RMS-normed here by `norm`) -> [T, E] (+ residual); updates st.conv and st.s in
        place (a CUDA graph holds their storage)."""
        c = self.cfg
        t, h, hd, di = x.shape[0], c.n_head, c.kda_head_dim, c.kda_inner
        p = project(lw, "kda_in", x, partial(self._linear, norm=norm))
        if self.use_kernels and t == 1 and self._kda_kernel_fits():
            from . import kernels

            na, dt_na = _kda_gate_consts(lw, h, hd)
            o = kernels.kda_step(p["attn_q"], p["attn_k"], p["attn_v"], self._linear(p["ssm_f_a"], lw["ssm_f_b"]),
                                 p["ssm_beta"], p["ssm_g"], st.conv, lw["ssm_conv1d"], na, dt_na, st.s,
                                 lw["ssm_norm"], c.kda_gate_lower_bound, c.rms_norm_eps, 1.0 / math.sqrt(hd))
            return self._linear(o, lw["attn_output"], add=residual)
        qkv = torch.cat([p["attn_q"], p["attn_k"], p["attn_v"]], -1)  # [T, 3*di]
        xx = torch.cat([st.conv, qkv.T], 1)  # [3*di, K-1+T]
        st.conv.copy_(xx[:, t:])  # the last K-1 inputs
        y = (xx.unfold(1, c.ssm_conv_kernel, 1) * lw["ssm_conv1d"]).sum(-1)  # [3*di, T] causal depthwise conv
        y = F.silu(y).T  # [T, 3*di]
        q, k, v = (z.reshape(t, h, hd) for z in y.split(di, -1))
        g = self._linear(p["ssm_f_a"], lw["ssm_f_b"]).view(t, h, hd)  # [T, H, hd]
        a = lw["ssm_a"].view(1, h, 1)  # holds -exp(A_log)
        if c.kda_gate_lower_bound is not None:  # K3: lb * sigmoid(exp(A_log) * (f_b(f_a(x)) + dt_bias))
            na, dt_na = _kda_gate_consts(lw, h, hd)  # exp(A_log) and dt_bias * exp(A_log)
            g = c.kda_gate_lower_bound * torch.sigmoid(torch.addcmul(dt_na, g, na))
        else:  # kimi-linear: -exp(A_log) * softplus(...)
            g = F.softplus(g + lw["ssm_dt_b"].view(1, h, hd)) * a
        beta = torch.sigmoid(p["ssm_beta"])  # [T, H]
        q, k = l2_norm(q, c.rms_norm_eps), l2_norm(k, c.rms_norm_eps)
        scale = 1.0 / math.sqrt(hd)
        if t == 1:  # in place on the state (a CUDA graph holds its storage)
            o = delta_rule_step_(q, k, v, g, beta, st.s, scale)
        else:
            o, s = delta_rule_chunked(q, k, v, g, beta, st.s, scale, self.kda_chunk, self._scan(hd))
            st.s.copy_(s)
        o = rms_norm(o, lw["ssm_norm"], c.rms_norm_eps)  # [T, H, hd]
        o = o * torch.sigmoid(p["ssm_g"]).view(t, h, hd)  # full-rank output gate
        return self._linear(o.reshape(t, di), lw["attn_output"], add=residual)

    # -- MLA (multi-head latent attention, NoPE, stored as one latent MQA head) -----------------
    def _mla(self, lw: dict[str, Any], x: Tensor, st: MLAState, n_past: int | Tensor, span: int = 0,
             norm: Tensor | None = None, residual: Tensor | None = None) -> Tensor:
        """x [T, E] (normed, or RMS-normed here by `norm`) -> [T, E] (+ residual); appends T latent rows to
        st.latent at n_past (a [1] device tensor in the static step, which then attends over the first `span`
        rows)."""
        c = self.cfg
        t, h, kvr, nope = x.shape[0], c.n_head, c.kv_lora_rank, c.qk_nope_dim
        p = project(lw, "mla_in", x, partial(self._linear, norm=norm))
        if c.q_lora_rank > 0:
            q = self._linear(p["attn_q_a"], lw["attn_q_b"], lw["attn_q_a_norm"])  # normed first
        else:
            q = p["attn_q"]
        q = q.view(t, h, c.key_length_mla)
        if self.use_kernels and t == 1 and self._mla_kernel_fits(lw, st):
            from . import kernels

            pos = n_past if isinstance(n_past, Tensor) else torch.tensor([n_past], device=x.device)
            rows = span if isinstance(n_past, Tensor) else n_past + 1
            gate = p["attn_gate"] if "attn_gate" in p else None
            o = kernels.mla_decode(q, p["attn_kv_a_mqa"], lw["attn_kv_a_norm"], st.latent, pos, rows,
                                   lw["attn_k_b"].w, lw["attn_v_b"].w, gate, 1.0 / math.sqrt(c.key_length_mla),
                                   c.rms_norm_eps)
            return self._linear(o, lw["attn_output"], add=residual)
        q_nope, q_pe = q[..., :nope], q[..., nope:]  # [T, H, nope], [T, H, rope]
        kv = p["attn_kv_a_mqa"]  # [T, kvr + rope]
        kv = torch.cat([rms_norm(kv[:, :kvr], lw["attn_kv_a_norm"], c.rms_norm_eps), kv[:, kvr:]], -1)
        if isinstance(n_past, Tensor):  # static step: row pos written on the device, keys beyond it masked
            st.latent.index_copy_(0, n_past, kv.to(CACHE_DTYPE))
            lat = st.latent[:span]
        else:
            st.latent[n_past:n_past + t] = kv.to(CACHE_DTYPE)
            lat = st.latent[:n_past + t]  # [S, kvr + rope] f16
        if self.faults.mla_as_mqa:  # read the latent head as a real MQA k/v head: no absorption
            k_all = torch.cat([lat[:, :nope], lat[:, kvr:]], -1).float()  # [S, key_length_mla]
            o = attend(q, k_all, lat[:, :c.value_length_mla].float(), n_past, 1.0 / math.sqrt(c.key_length_mla))
        else:
            o = self._mla_prefill(lw, st, q_nope, q_pe, lat, n_past)
        if "attn_gate" in p:  # K3: sigmoid output gate on the normed layer input
            o = o * torch.sigmoid(p["attn_gate"]).view(t, h, -1)
        return self._linear(o.reshape(t, -1), lw["attn_output"], add=residual)

    def _mla_prefill(self, lw: dict[str, Any], st: MLAState, q_nope: Tensor, q_pe: Tensor, lat: Tensor,
                     n_past: int | Tensor) -> Tensor:
        """The absorbed MLA attention of T tokens over the latent rows lat [S, kvr + rope] (f16, the call's rows
        written): [T, H, nope], [T, H, rope] -> [T, H, v] f32. With the kernels on, a call at a known n_past
        runs the form `mla_prefill` names (enable_kernels chose it): "sdpa" (mla_sdpa, decompressed) or "triton"
        (kernels.mla_attend, absorbed); else torch's `attend` over the absorbed queries."""
        c = self.cfg
        kvr, scale = c.kv_lora_rank, 1.0 / math.sqrt(c.key_length_mla)
        wk_b, wv_b = lw["attn_k_b"], lw["attn_v_b"]  # [H, kvr, nope], [H, v, kvr]
        fast = self.use_kernels and not isinstance(n_past, Tensor) and self._mla_kernel_fits(lw, st)
        if fast and self.mla_prefill == "sdpa":
            return mla_sdpa(q_nope, q_pe, lat, *mla_sdpa_weights(lw), int(n_past), scale)
        qn = round_act(q_nope, wk_b.act).to(wk_b.w.dtype).transpose(0, 1)  # [H, T, nope]
        q_abs = torch.bmm(qn, wk_b.w.transpose(1, 2)).float().transpose(0, 1)  # [T, H, kvr]
        if fast:
            from . import kernels  # the causal attention over the f16 cache, in one launch

            o_lat = kernels.mla_attend(q_abs, q_pe, st.latent, int(n_past), scale)  # [T, H, kvr]
        else:
            k_all = lat.float()  # [S, kvr + rope]
            o_lat = attend(torch.cat([q_abs, q_pe], -1), k_all, k_all[:, :kvr], n_past, scale)  # [T, H, kvr]
        ol = round_act(o_lat, wv_b.act).to(wv_b.w.dtype).transpose(0, 1)  # [H, T, kvr]
        return torch.bmm(ol, wv_b.w.transpose(1, 2)).float().transpose(0, 1)  # [T, H, v]

    # -- FFN -----------------------------------------------------------------------------------
    def _dense(self, lw: dict[str, Any], x: Tensor, norm: Tensor | None = None,
               residual: Tensor | None = None) -> Tensor:
        """x [T, E] (normed, or RMS-normed here by `norm`) -> [T, E] (+ residual)."""
        c = self.cfg
        p = project(lw, "dense_in", x, partial(self._linear, norm=norm))
        a = self._situ_of(p, "ffn_gate", "ffn_up", c.situ_beta, c.situ_linear_beta)
        return self._linear(a, lw["ffn_down"], add=residual)

    def _moe(self, lw: dict[str, Any], x: Tensor, norm: Tensor | None = None,
             residual: Tensor | None = None) -> Tensor:
        """Latent MoE: router on the full-width x [T, E] (normed, or RMS-normed here by `norm`); experts at the
        latent width; shared at E. -> [T, E] (+ residual)."""
        c = self.cfg
        if self.use_kernels and x.shape[0] == 1 and residual is not None and not self.faults.experts_hidden_width:
            return self._moe_token(lw, x, norm, residual)
        if norm is not None and self.faults.experts_hidden_width:  # the fault reads the normed stream itself
            x, norm = rms_norm(x, norm, c.rms_norm_eps), None
        logits = self._linear(x, lw["ffn_gate_inp"], norm)  # [T, n_expert] (float32 router, not fused)
        p = project(lw, "moe_in", x, partial(self._linear, norm=norm))
        sel, wts = self._route(lw, logits)
        lat = c.expert_latent_length
        if self.faults.experts_hidden_width:
            xin = x[:, :lat]
        else:
            xin = p["ffn_routed_down"]  # [T, lat]
        out = self._experts(lw, xin, sel, wts)  # [T, lat]
        routed_norm = lw.get("ffn_routed_norm")
        if self.faults.experts_hidden_width:
            if routed_norm is not None:
                out = rms_norm(out, routed_norm, c.rms_norm_eps)
            out = F.pad(out, (0, c.n_embd - lat))
            out = out if residual is None else residual + out
        else:
            out = self._linear(out, lw["ffn_routed_up"], routed_norm, residual)  # [T, E]
        if "ffn_gate_shexp" in p:
            sh = self._situ_of(p, "ffn_gate_shexp", "ffn_up_shexp", c.situ_beta, c.situ_linear_beta)
            out = self._linear(sh, lw["ffn_down_shexp"], add=out)
        return out

    def _moe_token(self, lw: dict[str, Any], x: Tensor, norm: Tensor | None, residual: Tensor) -> Tensor:
        """One token's MoE layer with the decode kernels, its three independent chains on their own CUDA streams
        (CPU: in this order, one after another). At batch 1 each chain is a few small launches that leave most of
        the GPU idle, so side by side they overlap inside the captured graph, which records the forks and joins
        as edges:
          side 0: the router's product and the routing (sel, wts), beside moe_in's product on this stream;
          side 1: the shared expert (situ, its down product with the residual added), beside the routed experts;
          this stream: moe_in, then the routed experts once side 0 is done, then ffn_routed_up with side 1's sum
          as its addend. The one difference from _moe's order: residual + shared is summed first, then the
          routed part is added (f32 rounding only).
        Every tensor a side stream reads was made on this stream before the fork, and this stream waits for both
        sides before anything it made is freed, so the caching allocator cannot hand a block to one stream while
        another still reads it. x [1, E] (RMS-normed here by `norm`) -> [1, E]."""
        c = self.cfg
        sides = self._side_streams()
        with self._branch(sides, 0):
            sel, wts = self._route(lw, self._linear(x, lw["ffn_gate_inp"], norm))
        p = project(lw, "moe_in", x, partial(self._linear, norm=norm))
        base = residual
        if "ffn_gate_shexp" in p:
            with self._branch(sides, 1):
                sh = self._situ_of(p, "ffn_gate_shexp", "ffn_up_shexp", c.situ_beta, c.situ_linear_beta)
                base = self._linear(sh, lw["ffn_down_shexp"], add=residual)
        self._join(sides, 0)
        out = self._experts(lw, p["ffn_routed_down"], sel, wts)  # [1, lat]
        self._join(sides, 1)
        return self._linear(out, lw["ffn_routed_up"], lw.get("ffn_routed_norm"), base)

    def _side_streams(self) -> tuple[Any, ...] | None:
        """Two side streams of this model's GPU for _moe_token's branches (made once); None on CPU or with
        moe_branches off."""
        if self.device.type != "cuda" or not self.moe_branches:
            return None
        if not self._sides:
            self._sides = (torch.cuda.Stream(device=self.device), torch.cuda.Stream(device=self.device))
        return self._sides

    @contextmanager
    def _branch(self, sides: tuple[Any, ...] | None, i: int) -> Iterator[None]:
        """Run the block on side stream i, after all that this stream has queued (a fork); CPU: inline."""
        if sides is None:
            yield
            return
        sides[i].wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(sides[i]):
            yield

    def _join(self, sides: tuple[Any, ...] | None, i: int) -> None:
        """This stream waits for all that side stream i has queued."""
        if sides is not None:
            torch.cuda.current_stream(self.device).wait_stream(sides[i])

    def _route(self, lw: dict[str, Any], logits: Tensor) -> tuple[Tensor, Tensor]:
        """The top-k experts of logits [T, X] (by probability + bias) and their unbiased, normalized, scaled
        weights: ([T, k] long, [T, k] f32); for one token with the decode kernels on, kernels.route."""
        c = self.cfg
        if self.use_kernels and logits.shape[0] == 1:
            from . import kernels

            s1, w1 = kernels.route(logits, lw["exp_probs_b"], c.n_expert_used, c.expert_gating_func == 2,
                                   bool(c.expert_weights_norm), c.expert_weights_scale, ROUTER_WSUM_MIN)
            return s1.view(1, -1), w1.view(1, -1)
        probs = torch.sigmoid(logits) if c.expert_gating_func == 2 else torch.softmax(logits, -1)
        sel = torch.topk(probs + lw["exp_probs_b"], c.n_expert_used, -1).indices  # [T, k]
        wts = probs.gather(1, sel)  # [T, k], unbiased
        if c.expert_weights_norm:
            wts = wts / wts.sum(-1, keepdim=True).clamp_min(ROUTER_WSUM_MIN)
        if c.expert_weights_scale not in (0.0, 1.0):
            wts = wts * c.expert_weights_scale
        return sel, wts

    def _decode_experts(self, lw: dict[str, Any], xin: Tensor, e: Tensor, w: Tensor) -> Tensor:
        """One token through experts `e` [m] (indices into the stacked weights) weighted by w [m].
        xin [1, lat] -> [1, lat]."""
        c = self.cfg
        if self.use_kernels:
            from . import kernels

            w_in, w_down = _kernel_mats(lw)  # type: ignore[misc]  # checked for every MoE layer when enabled
            return kernels.decode_experts(xin, e, w, w_in, w_down, c.situ_beta, c.situ_linear_beta)
        down = lw["ffn_down_exps"]
        m = int(e.shape[0])

        def product(mat: Mat) -> Tensor:  # [m, 1, out]: x times each selected expert's matrix
            xa = round_act(xin, mat.act).to(mat.w.dtype).expand(m, -1)[:, None]  # [m, 1, lat]
            return torch.bmm(xa, mat.w[e].transpose(1, 2)).float()

        if "exps_in" in lw:  # gate|up stacked: one gather, one product
            a = situ_joint(product(lw["exps_in"]), c.situ_beta, c.situ_linear_beta)
        else:
            a = situ(product(lw["ffn_gate_exps"]), product(lw["ffn_up_exps"]), c.situ_beta, c.situ_linear_beta)
        a = round_act(a, down.act)
        y = torch.bmm(a.to(down.w.dtype), down.w[e].transpose(1, 2)).float()[:, 0]  # [m, lat]
        return (y * w[:, None]).sum(0, keepdim=True)

    def _experts(self, lw: dict[str, Any], xin: Tensor, sel: Tensor, wts: Tensor) -> Tensor:
        """Routed experts: sum_k wts[t,k] * down_e(situ(gate_e(x), up_e(x))). xin [T, lat] -> [T, lat]."""
        return self._held_experts(lw, xin, sel, wts, 0, self.cfg.n_expert)

    def _held_experts(self, lw: dict[str, Any], xin: Tensor, sel: Tensor, wts: Tensor, lo: int, hi: int) -> Tensor:
        """The routed sum over the experts held, [lo, hi) (stacked at index e - lo); the others add nothing.

        The one expert loop: the single-process model holds all of them, an expert-parallel rank its band.
        xin [T, lat], sel/wts [T, k] -> [T, lat]."""
        c = self.cfg
        t, k = sel.shape
        if t == 1:  # decode: gather the selected experts' weights, batched matmuls
            if (lo, hi) == (0, c.n_expert):  # all held: static shapes (a CUDA graph can capture it)
                return self._decode_experts(lw, xin, sel[0], wts[0])
            mine = (sel[0] >= lo) & (sel[0] < hi)  # [k]; the count held is data-dependent, 0..k
            local = sel[0][mine] - lo  # [m] local indices
            if int(local.shape[0]) == 0:
                return torch.zeros(1, xin.shape[1], device=xin.device)
            return self._decode_experts(lw, xin, local, wts[0][mine])
        # prefill: every assignment (token, slot) sorted by expert, then one grouped GEMM per matrix over
        # the held experts' consecutive row groups (was a Python loop of ~15 launches per expert hit)
        flat = sel.reshape(-1)  # [T*k]
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=c.n_expert).tolist()
        start, n = sum(counts[:lo]), sum(counts[lo:hi])
        if n == 0:
            return torch.zeros(t, xin.shape[1], device=xin.device)
        idx = order[start:start + n]  # the held assignments, grouped by expert
        rows = idx // k  # token of each
        held = counts[lo:hi]
        offs = torch.tensor(held, device=xin.device).cumsum(0).to(torch.int32)  # end row of each group
        xi = xin[rows]  # [n, lat]
        gl = partial(grouped_linear, gmm=self._gmm())
        if "exps_in" in lw:  # gate|up stacked [X, 2ff, lat]: one grouped product for both
            a = situ_joint(gl(xi, lw["exps_in"], offs, held), c.situ_beta, c.situ_linear_beta)
        else:
            a = situ(gl(xi, lw["ffn_gate_exps"], offs, held), gl(xi, lw["ffn_up_exps"], offs, held), c.situ_beta,
                     c.situ_linear_beta)
        y = gl(a, lw["ffn_down_exps"], offs, held) * wts.reshape(-1)[idx, None]  # [n, lat]
        # the routed sum per token in a fixed order: each assignment's row put back at its (token, slot) place,
        # then summed over the k slots. index_add_ over repeated rows adds by atomics on CUDA, in an order that
        # changes from run to run: on the H200 the same prompt then gave different greedy tokens (a REJECT)
        per_slot = torch.zeros(t * k, xin.shape[1], device=xin.device)
        per_slot[idx] = y
        return per_slot.view(t, k, -1).sum(1)


# matrices up to this many elements go through kernels.linear_vec for one token: every plain product the models
# have. The kernel saves two of the torch form's three launches (~3 us each), and on the H200 it also streamed
# faster than cuBLAS's f16 mat-vec on each of k3-wide's 12 products above the old cap of 32 M elements (44 to
# 484 M): 1,020.6 -> 956.0 us per token at 8 rows x a 1024 step (bench/h200_kernel_sweep.py, 2026-12-02,
# bench/results-h200-2026-12-02-session6). No product of these models reaches the bound (the largest: 484 M).
VEC_MAX_ELEMENTS = 1 << 31
KERNEL_CHECK_TOL = 1e-2  # enable_kernels: f16 rounding of the torch form is ~1e-3 relative
# the prefill's MLA attention with the kernels on, in order of preference: torch's fused attention over the
# decompressed form (model.mla_sdpa), else the Triton kernel over the absorbed form (kernels.mla_attend)
MLA_PREFILL_FORMS = ("sdpa", "triton")


def _vec_fits(m: Mat) -> bool:
    """A plain [out, in] f16/bf16/f32 matrix (f32: the router) whose activation is not rounded to a quantized type:
    linear_vec's case."""
    w = m.w
    return (w.dim() == 2 and m.act is None and w.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and w.numel() <= VEC_MAX_ELEMENTS and w.is_contiguous())


def _route_fits(k: int) -> bool:
    """kernels.route takes a power-of-two number of active experts (every preset's: 2, 8, 16)."""
    return k > 0 and not k & (k - 1)


def _kernel_mats(lw: dict[str, Any]) -> tuple[Tensor, Tensor] | None:
    """(gate|up [X, 2F, lat], down [X, lat, F]) for kernels.decode_experts: f16/bf16 weights whose activations
    are not rounded to a quantized type (act None), contiguous; None when the layer's experts do not fit."""
    m_in, down = lw.get("exps_in"), lw.get("ffn_down_exps")
    if m_in is None or down is None or m_in.act is not None or down.act is not None:
        return None
    if m_in.w.dtype not in (torch.float16, torch.bfloat16) or down.w.dtype != m_in.w.dtype:
        return None
    if m_in.splits[0] != m_in.splits[1] or not (m_in.w.is_contiguous() and down.w.is_contiguous()):
        return None
    return m_in.w, down.w


GROUPED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what torch._grouped_mm multiplies


def grouped_linear(x: Tensor, m: Mat, offs: Tensor, counts: list[int], gmm: Any = None) -> Tensor:
    """Row groups of x [n, in] times their own matrix: group g (rows offs[g-1]..offs[g], counts[g] of them)
    times m.w[g] [out, in] of a stacked [G, out, in] Mat. -> [n, out] f32, activation rounded as `linear`.
    `gmm`: kernels.grouped_mm (one launch) for f16/bf16 weights."""
    xa = round_act(x.float(), m.act).to(m.w.dtype)
    if gmm is not None and m.w.dtype in (torch.float16, torch.bfloat16) and m.w.is_contiguous():
        return gmm(xa, m.w, counts)
    if m.w.dtype in GROUPED_DTYPES:
        return torch._grouped_mm(xa, m.w.transpose(1, 2), offs=offs).float()
    parts, r = [], 0  # float64 (a CPU reference option): one product per non-empty group
    for g, cnt in enumerate(counts):
        if cnt:
            parts.append(xa[r:r + cnt] @ m.w[g].T)
            r += cnt
    return torch.cat(parts, 0).float()


# ----------------------------------------------------------------------------------------------
# attention over the latent cache

def attend(q: Tensor, k: Tensor, v: Tensor, n_past: int | Tensor, scale: float) -> Tensor:
    """Causal softmax attention of T new queries over S >= n_past + T keys, one shared KV head.

    q [T, H, D], k [S, D], v [S, Dv] (f32 copies of the f16 cache) -> [T, H, Dv] f32; query t sees keys
    0..n_past+t (n_past an int, or a [1] device tensor in the static step; later keys are masked). All
    in float32, as llama.cpp's tiled CPU flash attention over an f16 cache (which it uses for ubatches
    of >= 64 tokens; its per-row path for shorter ones rounds q and accumulates in f16). Scores are
    computed in blocks of query rows so [T_blk, H, S] stays under ATTN_SCORE_BUDGET, each block against
    the keys up to its last query only (the causal half above the diagonal is skipped).
    """
    t, h, _ = q.shape
    s = k.shape[0]
    blk = max(1, min(t, ATTN_SCORE_BUDGET // max(1, h * s)))
    out = []
    kpos = torch.arange(s, device=q.device)
    for t0 in range(0, t, blk):
        qb = q[t0:t0 + blk]
        # the keys past a block's last query are masked for all of its rows: never read (with an int n_past)
        sb = s if isinstance(n_past, Tensor) else min(s, n_past + t0 + int(qb.shape[0]))
        sc = (qb @ k[:sb].T) * scale  # [tb, H, sb]
        qpos = n_past + t0 + torch.arange(qb.shape[0], device=q.device)
        sc = sc.masked_fill((kpos[None, :sb] > qpos[:, None])[:, None, :], float("-inf"))
        out.append(torch.softmax(sc, -1) @ v[:sb])  # [tb, H, Dv]
    return torch.cat(out, 0)


def mla_sdpa(q_nope: Tensor, q_pe: Tensor, lat: Tensor, wk_cat: Tensor, wv_cat: Tensor, n_past: int,
             scale: float) -> Tensor:
    """MLA's causal attention of T new tokens in its decompressed form, through torch's fused attention: per head
    h, keys k_h = (kv wk_b[h] | k_pe) [S, nope + rope] and values v_h = kv wv_b[h]^T [S, v] in the cache's dtype
    (f16), and scaled_dot_product_attention with the causal mask aligned to the last T of the S keys. The same
    softmax as the absorbed form (q_abs . kv = q_nope . kv wk_b) at 2 (nope + rope + v) FLOPs per (query, key,
    head) instead of 2 (2 kvr + rope). v is zero-padded to the key width so flash attention takes it (it needs
    one head dim); only the fused kernels may run (the math fallback would hold [T, S] scores per head).

    q_nope [T, H, nope], q_pe [T, H, rope]; lat [S, kvr + rope] (S = n_past + T); wk_cat [kvr, H * nope] and
    wv_cat [kvr, H * v]: wk_b, wv_b laid out for one product each (mla_sdpa_weights). -> [T, H, v] f32."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    t, h, nope = q_nope.shape
    s, dt = int(lat.shape[0]), lat.dtype
    kvr = int(wk_cat.shape[0])
    v_dim = int(wv_cat.shape[1]) // h
    kv = lat[:, :kvr]
    k = torch.cat([(kv @ wk_cat).view(s, h, nope), lat[:, None, kvr:].expand(s, h, -1)], -1)  # [S, H, nope + rope]
    v = F.pad((kv @ wv_cat).view(s, h, v_dim), (0, k.shape[-1] - v_dim))  # [S, H, nope + rope], zeros past v
    q = torch.cat([q_nope, q_pe], -1).to(dt)  # [T, H, nope + rope]
    mask = causal_lower_right(t, s) if t != s else None
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           attn_mask=mask, is_causal=mask is None, scale=scale)
    return o[0, :, :, :v_dim].transpose(0, 1).float()  # [T, H, v]


def mla_sdpa_weights(lw: dict[str, Any]) -> tuple[Tensor, Tensor]:
    """wk_b [H, kvr, nope] and wv_b [H, v, kvr] as [kvr, H * nope] and [kvr, H * v] (one product each), made once
    per layer's weights."""
    if "mla_sdpa.wk" not in lw:
        wk, wv = lw["attn_k_b"].w, lw["attn_v_b"].w
        lw["mla_sdpa.wk"] = wk.permute(1, 0, 2).reshape(wk.shape[1], -1).contiguous()
        lw["mla_sdpa.wv"] = wv.permute(2, 0, 1).reshape(wv.shape[2], -1).contiguous()
    return lw["mla_sdpa.wk"], lw["mla_sdpa.wv"]


# ----------------------------------------------------------------------------------------------
# the gated delta rule with a per-key-dimension decay (KDA)
#
# Per head, state S [dk, dv], token t with q, k [dk] (L2-normed), v [dv], g [dk] (log decay <= 0),
# beta (scalar):  S' = diag(exp(g)) S;  u = beta * (v - S'^T k);  S = S' + k u^T;  o = scale * S^T q.
# (ggml-cpu ops.cpp gated_delta_net, kda branch.)

def delta_rule_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, s: Tensor,
                         scale: float) -> tuple[Tensor, Tensor]:
    """Token by token. q, k, g [T, H, dk], v [T, H, dv], beta [T, H], s [H, dk, dv] -> o [T, H, dv], s."""
    outs = []
    for i in range(q.shape[0]):
        s = s * torch.exp(g[i])[:, :, None]
        u = (v[i] - torch.bmm(k[i][:, None], s)[:, 0]) * beta[i][:, None]  # [H, dv]
        s = s + k[i][:, :, None] * u[:, None, :]
        outs.append(torch.bmm(q[i][:, None], s)[:, 0] * scale)
    return torch.stack(outs, 0), s


def _kda_gate_consts(lw: dict[str, Any], h: int, hd: int) -> tuple[Tensor, Tensor]:
    """exp(A_log) [1, H, 1] and dt_bias * exp(A_log) [1, H, hd], made once per layer's weights: the K3 gate's
    argument exp(A_log) * (f + dt_bias) is then one fused multiply-add."""
    if "kda_gate.na" not in lw:
        na = -lw["ssm_a"].view(1, h, 1)
        lw["kda_gate.na"], lw["kda_gate.dt_na"] = na, lw["ssm_dt_b"].view(1, h, hd) * na
    return lw["kda_gate.na"], lw["kda_gate.dt_na"]


def delta_rule_step_(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, s: Tensor, scale: float) -> Tensor:
    """One token of delta_rule_recurrent, updating s [H, dk, dv] in place: q, k, g [1, H, dk], v [1, H, dv],
    beta [1, H] -> o [1, H, dv]. Six launches (fused multiply-adds) where the general form takes eleven."""
    q1, k1 = q[0][:, None], k[0][:, None]  # [H, 1, dk]
    s.mul_(torch.exp(g[0])[:, :, None])  # S' = diag(exp(g)) S
    u = torch.baddbmm(v[0][:, None], k1, s, alpha=-1.0) * beta[0][:, None, None]  # beta (v - S'^T k) [H, 1, dv]
    s.baddbmm_(k1.transpose(1, 2), u)  # S = S' + k u^T
    return torch.baddbmm(u, q1, s, beta=0.0, alpha=scale).transpose(0, 1)  # scale * S^T q -> [1, H, dv]


def _kda_chunk_for(lower_bound: float) -> int:
    """Largest power-of-two chunk (<= KDA_CHUNK_MAX) whose half-chunk decay stays within exp(+-40)."""
    c = KDA_CHUNK_MAX
    while c > 1 and abs(lower_bound) * c / 2 > 40.0:
        c //= 2
    return c


def delta_rule_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, s: Tensor, scale: float,
                       chunk: int, scan: Any = None) -> tuple[Tensor, Tensor]:
    """Chunked (WY) form, same contract as delta_rule_recurrent.

    Within a chunk of C tokens with cumulative log decay G_t = sum_{i<=t} g_i [dk]:
      A_kk[t,j] = sum_d k_t k_j exp(G_t - G_j) (j < t),  A_qk[t,j] = sum_d q_t k_j exp(G_t - G_j) (j <= t)
      (I + diag(beta) A_kk) U = diag(beta) (V - (k * exp(G)) S0)          -> U [C, dv]
      O = scale * ((q * exp(G)) S0 + A_qk U);  S_C = exp(G_C) S0 + (k * exp(G_C - G))^T U
    The pairwise decays are factored around the chunk's middle token, exp(G_t - G_m) * exp(G_m - G_j),
    whose exponents stay within +-|lower bound| * C/2 (see _kda_chunk_for).
    """
    t, h, _ = q.shape
    dv = v.shape[-1]
    pad = (-t) % chunk
    if pad:  # zero k, v, beta and g: padded tokens neither decay nor write the state
        q, k, v, g = (F.pad(z, (0, 0, 0, 0, 0, pad)) for z in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    n = (t + pad) // chunk

    def blocks(z: Tensor) -> Tensor:  # [T', H, D] -> [N, H, C, D]
        return z.reshape(n, chunk, h, -1).permute(0, 2, 1, 3)

    q, k, v, g = blocks(q), blocks(k), blocks(v), blocks(g)
    b = beta.reshape(n, chunk, h).permute(0, 2, 1)[..., None]  # [N, H, C, 1]
    gc = torch.cumsum(g, 2)  # [N, H, C, dk]
    mid = gc[:, :, chunk // 2:chunk // 2 + 1]  # [N, H, 1, dk]
    k_in = k * torch.exp(mid - gc)  # k_j exp(G_m - G_j)
    a_kk = (k * torch.exp(gc - mid)) @ k_in.transpose(-1, -2)  # [N, H, C, C]
    a_qk = (q * torch.exp(gc - mid)) @ k_in.transpose(-1, -2)
    eye = torch.eye(chunk, device=q.device)
    lhs = eye + torch.tril(b * a_kk, -1)
    a_qk = torch.tril(a_qk)
    k_dec = k * torch.exp(gc)  # k_t exp(G_t)
    rhs = torch.cat([b * v, b * k_dec], -1)  # [N, H, C, dv + dk]
    sol = torch.linalg.solve_triangular(lhs, rhs, upper=False, unitriangular=True)
    u0, w = sol[..., :dv], sol[..., dv:]  # U = u0 - w S0
    q_dec = q * torch.exp(gc)  # [N, H, C, dk]
    g_last = gc[:, :, -1:]  # [N, H, 1, dk]
    k_tail = k * torch.exp(g_last - gc)  # k_j exp(G_C - G_j)
    # the chunk-to-chunk recurrence is sequential: three fused launches per chunk; the outputs, which
    # need each chunk's starting state, are then two batched products over all chunks
    if scan is not None:  # kernels.chunk_scan: the whole recurrence in one launch
        st, ut, s = scan(u0, w, k_tail, torch.exp(g_last)[:, :, 0], s)
        s0, uu = st.flatten(0, 1), ut.flatten(0, 1)
    else:
        neg_w, decay, k_tail_t = -w, torch.exp(g_last).transpose(-1, -2), k_tail.transpose(-1, -2)
        starts, us = [], []
        for i in range(n):
            starts.append(s)
            u = torch.baddbmm(u0[i], neg_w[i], s)  # U = u0 - w S0 [H, C, dv]
            us.append(u)
            s = torch.baddbmm(decay[i] * s, k_tail_t[i], u)
        s0, uu = torch.stack(starts, 0).flatten(0, 1), torch.stack(us, 0).flatten(0, 1)  # [N*H, dk, dv], [N*H, C, dv]
    o = torch.baddbmm(torch.bmm(a_qk.flatten(0, 1), uu), q_dec.flatten(0, 1), s0, beta=scale, alpha=scale)
    o = o.view(n, h, chunk, dv).permute(0, 2, 1, 3).reshape(n * chunk, h, dv)[:t]  # [T, H, dv]
    return o, s
