"""Triton kernels for sparkinfer on CUDA: one decoded token's layers in a handful of launches, and the
prefill's two launch-bound loops in one launch each.

Eager torch launches one kernel per op, and a decoded token of the GPU targets was ~680 of them (profile at
step 5, docs/diagnosis.md): launch-bound, far from the bandwidth ceiling. These kernels fuse each chain
between two weight reads. For one token:

* ``linear_vec``: an f32 activation times an f16 (or f32) matrix with f32 accumulation, optionally with the
  RMSNorm that feeds it in its prologue and the residual add in its epilogue (the torch form: cast, product,
  cast back, plus the norm and the add);
* ``kda_step``: a KDA layer between its products — conv + silu (conv state shifted in place), l2 norms, the
  gate, the delta rule on the state in place, the head norm and output gate — one program per head;
* ``mla_decode``: MLA's latent row written at pos and q absorbed through wk_b; flash-decoding over the cache
  rows (each program reads its rows once for a block of heads, the scores on the tensor cores); the combine
  of the splits, and out through wv_b and the gate: four launches;
* ``res_mix``, ``route``, ``situ_vec``: the residual mix, the router's top-k and weights, situ;
* ``decode_experts``: the routed experts in two launches that read each selected expert's rows where they lie
  (the torch form gathers them into a copy first: on the K3-width slice 16 x (6144 x 3584 + 3584 x 3072) f16 =
  1.06 GB per MoE layer per token, copied and read again), the weighted sum over experts in a fixed order
  inside each program (no atomics: the same sum every run, which graph replays and the round's greedy check
  need).

For the prefill: ``chunk_scan`` (the KDA chunk-to-chunk recurrence, three launches per 16-token chunk in torch),
``grouped_mm`` (the routed experts' grouped products; torch's f16 path loops over the experts hit) and
``mla_attend`` (MLA's causal attention over the latent cache in one launch, reading only the rows on or below
the diagonal; torch's form computes every score in f32 on CUDA cores).

Numerics: f32 activations and accumulation throughout, f16/bf16 weights and cache read as stored, products
in full f32 (``input_precision="ieee"``) where both sides are f32. MLA's two attention kernels multiply on the
tensor cores with f16 operands and f32 sums: q against the f16 latent rows (one f16 part, each row scaled by a
power of two first: ~11 bits of every value; in the prefill q are f16 values already, and the decode can take hi +
lo parts, ~22 bits, with MLA_DECODE_Q_SPLIT) and the softmax weights, rounded to f16 (~2^-12 relative each),
against the same rows. No kernel reads a host value inside a
decoded token, so a CUDA graph records them as they are. Every sandboxed worker compiles afresh (its cache is
private to the launch), so widths are runtime values where a loop allows it. K3Model.enable_kernels compiles
and checks each against its torch form at prepare; tests/test_sparkinfer_kernels.py runs them on CPU
through Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


def libcuda_dir(maps: str) -> str | None:
    """The directory of the CUDA driver library a process has mapped (the text of /proc/self/maps: the mapped
    file is the resolved one, e.g. libcuda.so.580.159.03 beside its libcuda.so.1 link), or None."""
    for line in maps.splitlines():
        path = line.split()[-1] if line.count("/") else ""
        if os.path.basename(path).startswith("libcuda.so"):
            return os.path.dirname(path)
    return None


def _point_triton_at_libcuda() -> None:
    """Triton's launcher finds libcuda through `/sbin/ldconfig -p` unless TRITON_LIBCUDA_PATH says where. In a
    sandboxed worker the environment is an allow-list and the linker cache may not list the driver's mount, while
    the driver torch already loaded is right here: point Triton at its directory."""
    if os.environ.get("TRITON_LIBCUDA_PATH") or not torch.cuda.is_initialized():
        return
    try:
        found = libcuda_dir(Path("/proc/self/maps").read_text())
    except OSError:
        return
    if found:
        os.environ["TRITON_LIBCUDA_PATH"] = found


_point_triton_at_libcuda()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

Tensor = torch.Tensor

# The routed experts' tiles, from bench/h200_kernel_sweep.py on one H200 (2026-12-02,
# bench/results-h200-2026-12-02-session6): both launches of one MoE layer's token took 50 us on k3-gpu and 502 us
# on k3-wide at (32, 128, 8, 128); at these tiles 22 us and 257 us (4.1 TB/s), the output within 4e-7 relative
# (the f32 sums' order only). Fewer rows per program with a wide F step puts more bytes in flight per program.
BLOCK_F = 16  # output columns of a per program in experts_in_situ (each reads 2 x BLOCK_F weight rows)
BLOCK_L = 2  # output rows per program in experts_down_sum (k3-gpu's latent 1024: 512 programs)
BLOCK_SITU = 1024  # columns per program in situ_vec
# res_mix's output columns per program; 0: one program mixes every column (one launch of one program is a chain
# of dependent loads on a single multiprocessor: 4.8 us per call in the eager profile at c1b1c3a, 16 calls per
# k3-gpu token). bench/h200_kernel_sweep.py times the splits before a step sets one
RES_MIX_COLS = 0
# mla_decode's split (flash-decoding): each program reads its latent rows once for MLA_BH heads (a tl.dot needs
# at least 16 rows: k3-gpu's 16 heads are one block of 16, k3-wide's 96 three of 32), MLA_BT rows per step. About
# MLA_PROGRAMS programs (two per multiprocessor of an H200's 132) share the rows 0..pos, at least MLA_ROWS_MIN rows
# each; the combine merges MLA_COMBINE_SPLITS splits per step in programs of MLA_COMBINE_COLS latent columns. The
# tile (64 rows, 4 warps, 2 stages) was the fastest of bench/mla_depth.py's grid on one H200 (2026-12-02, Triton
# 3.6, bench/results-h200-2026-12-02-mla-depth): one token over 262,044 rows of k3-gpu's widths in 106 us (2.85 TB/s
# of latent rows; 32 rows, 8 warps, 3 stages: 184 us). 32 heads per program, not 16: on one H100 at span 131072
# (2026-12-07, bench/results-h100-2026-12-07-session16) k3-wide's 96 heads took 144 us a call, against 181 us at 16
# (six programs per split each reading the split's rows, against three); 64 heads took 504 us; k3-gpu's 16
# heads are one block of 16 either way (77-78 us)
MLA_BH = 32
# mla_decode's split in the rows form (_mla_split_rows: the products turned over, M the latent rows, N the heads)
# for models of at least MLA_ROWS_FORM_HEADS heads (0: none), MLA_ROWS_BH heads per program, at
# WARPS/STAGES["mla_split_rows"]; others run _mla_split at MLA_BH. Rows per step (MLA_BT) and programs
# (MLA_PROGRAMS) are the two forms' own. Off: on the same H100 grid every rows-form tile was slower than the head
# form (k3-wide 208-535 us a call against 144; k3-gpu 81-124 us against 77), though it compiles to Hopper's
# warpgroup products
MLA_ROWS_FORM_HEADS = 0
MLA_ROWS_BH = 32
MLA_BT = 64
MLA_ROWS_MIN = 128
MLA_PROGRAMS = 264
MLA_COMBINE_SPLITS = 64
MLA_COMBINE_COLS = 64
# mla_decode's scores from q in one f16 part (each row scaled by a power of two first, so ~11 bits of every value
# whatever its magnitude), as mla_attend's prefill scores already are on the f16 targets and as llama.cpp's CUDA
# flash attention takes its q; True: hi + lo parts (~22 bits), two more tensor-core products per step. On one
# H100 (bench/results-h100-2026-12-05-session11) k3-wide's 96 heads spent 225 us per call over 131,072 rows with
# the two parts, 0.67 TB/s of latent rows: the products (41.9 GFLOP in six head blocks; 27.4 in one part), not
# the row bytes, look like what binds it. Not yet timed with one part
MLA_DECODE_Q_SPLIT = False
MLA_P_SPLIT = False  # the softmax weights as one f16 part (see _mla_step), as flash attention does
# mla_attend (the prefill's causal attention): MLA_BM query rows (token, head) per program, MLA_CAUSAL_BT rows
# per step. MLA_CAUSAL_Q_SPLIT: the scores from hi + lo f16 parts of q; off, q in one f16 part, which loses
# nothing on the f16 targets: there q_abs and q_pe are outputs of f16 products (model._mla), f16 values already.
# (32 rows, 128 per step, 8 warps, 2 stages) was the fastest of bench/mla_depth.py's grid on one H200 (2026-12-02):
# a 2048-token call after 14,336 rows at k3-gpu's widths 10.1 ms at (32, 32, 8 warps, 3 stages) -> 4.74 ms (231
# TFLOP/s of the causal half's 2 (2 kvr + rope) per pair), k3-wide's 96 heads 59.0 -> 28.3 ms; the q split
# costs 1.5x
MLA_BM = 32
MLA_CAUSAL_BT = 128
MLA_CAUSAL_Q_SPLIT = False
LOG2E = 1.4426950408889634  # the kernels' softmaxes run in base 2: exp(x) = exp2(x log2 e)
# grouped_mm's tile (rows, columns, reduction step; 8 warps, 3 stages below): the fastest of bench/grouped_tiles.py's
# grid on one H200 (2026-12-02, Triton 3.6, bench/results-h200-2026-12-02-grouped-tiles): one 2048-token call's
# two products of a MoE layer at k3-wide's widths 12.66 + 6.47 ms at (64, 64, 32, 4 warps) -> 3.45 + 1.96 ms (419
# and 368 TFLOP/s), at k3-gpu's 0.744 + 0.591 -> 0.518 + 0.379 ms; the outputs equal (f32 sums of exact products)
GMM_BM, GMM_BN, GMM_BK = 128, 256, 64
SCAN_BV = 16  # value columns per chunk_scan program
# warps per program where the default 4 spills: ptxas for sm_90 (Triton 3.6, bench/triton_compile.py) gave
# kda_step 255 registers + 72 B stack at 8 warps (104 B at 16), chunk_scan 172 and no stack at 8 warps with 16
# value columns (255 + 264 B at 4 warps with 32); mla_split at its tile above: 255 + 664 B (Triton 3.8), which
# still beat every tile that does not spill; experts_down_sum at 8 for its tile of every selected expert's rows
# (DOWN_TILE elements: 64 registers of weights and activations per thread at 8 warps, 128 at 4)
WARPS = {"experts_down_sum": 8, "kda_step": 8, "chunk_scan": 8, "mla_split": 4, "mla_split_rows": 8, "mla_causal": 8,
         "grouped_mm": 8}
STAGES = {"mla_split": 2, "mla_split_rows": 2, "mla_causal": 2, "grouped_mm": 3}  # software-pipelined loads in flight per loop (Triton's default 3)
# experts_in_situ's widest reduction step over the latent (f16 weights: 2 KB per row per step): in_situ_tile takes the
# widest power of two up to it that divides the latent, so k3-gpu's 1024 is one step (all of a program's 2 x 16 rows
# requested at once; at 512 the second step's loads waited for the first's) and k3-wide's 3584 seven steps of 512
BLOCK_K = 1024
# experts_down_sum's widest reduction step over F (down_sum_tile narrows it until one tile of every selected
# expert's rows fits DOWN_TILE). At 128 the old per-expert loop kept LAT x 128 x 2 bytes in flight (256 KB on k3-gpu)
# where an H200 wants a few MB; 1024 was the sweep's best
BLOCK_KD = 1024
IN_SITU_TILE_4_WARPS = 16384  # experts_in_situ: weight elements per step above which a program runs 8 warps
DOWN_TILE = 16384  # experts_down_sum: weight elements per tile (16 K f16 = 32 KB in flight per program)


@triton.jit
def _tanh(x):
    # |x| >= 1/4: sign(x) (1 - e^(-2|x|)) / (1 + e^(-2|x|)), which never overflows; below, where 1 - e^(-2|x|)
    # would cancel, the series x - x^3/3 + 2x^5/15 - 17x^7/315 (next term 62x^9/2835: < 2e-7 relative at 1/4)
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    x2 = x * x
    small = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    return tl.where(a < 0.25, small, tl.where(x < 0, -big, big))


@triton.jit
def _experts_in_situ(x_ptr, w_ptr, sel_ptr, out_ptr, inv_beta, inv_lb, beta_lb,
                     F: tl.constexpr, LAT: tl.constexpr, LINEAR_UP: tl.constexpr,
                     BF: tl.constexpr, BK: tl.constexpr):
    m = tl.program_id(0)  # which selected expert
    cols = tl.program_id(1) * BF + tl.arange(0, BF)  # [BF] columns of the gate half (and of the up half)
    e = tl.load(sel_ptr + m).to(tl.int64)
    base = w_ptr + e * (2 * F * LAT)  # expert e's [2F, LAT] stacked gate|up rows
    ok = cols < F
    g = tl.zeros([BF], dtype=tl.float32)
    u = tl.zeros([BF], dtype=tl.float32)
    for k0 in range(0, LAT, BK):
        kk = k0 + tl.arange(0, BK)
        kmask = kk < LAT
        xv = tl.load(x_ptr + kk, mask=kmask, other=0.0).to(tl.float32)[None, :]
        wmask = ok[:, None] & kmask[None, :]
        wg = tl.load(base + cols[:, None].to(tl.int64) * LAT + kk[None, :], mask=wmask, other=0.0)
        wu = tl.load(base + (cols[:, None].to(tl.int64) + F) * LAT + kk[None, :], mask=wmask, other=0.0)
        g += tl.sum(wg.to(tl.float32) * xv, 1)
        u += tl.sum(wu.to(tl.float32) * xv, 1)
    # situ(g, u) = beta tanh(g / beta) sigmoid(g) * lb tanh(u / lb)  (lb <= 0: u linear)
    if LINEAR_UP:
        a = _tanh(g * inv_beta) * tl.sigmoid(g) * u * beta_lb
    else:
        a = _tanh(g * inv_beta) * tl.sigmoid(g) * _tanh(u * inv_lb) * beta_lb
    tl.store(out_ptr + m * F + cols, a, mask=ok)


@triton.jit
def _experts_down_sum(a_ptr, w_ptr, sel_ptr, wts_ptr, out_ptr,
                      K_USED: tl.constexpr, KP: tl.constexpr, F: tl.constexpr, LAT: tl.constexpr,
                      BL: tl.constexpr, BK: tl.constexpr):
    # one [KP, BL, BK] tile holds the BL rows of every selected expert (KP: K_USED padded to a power of two), so
    # each step's loads go out together: a loop over the experts waited for one expert's rows before asking for
    # the next one's (k3-gpu: 8 round trips to memory per program, one per step now)
    mk = tl.arange(0, KP)  # [KP] which selected expert
    used = mk < K_USED
    rows = tl.program_id(0) * BL + tl.arange(0, BL)  # [BL] output rows (latent dims)
    ok = rows < LAT
    e = tl.load(sel_ptr + mk, mask=used, other=0).to(tl.int64)
    wrow = e[:, None, None] * (LAT * F) + rows[None, :, None].to(tl.int64) * F  # [KP, BL, 1] row starts
    wmask = used[:, None, None] & ok[None, :, None]
    part = tl.zeros([KP, BL], dtype=tl.float32)
    for k0 in range(0, F, BK):
        kk = k0 + tl.arange(0, BK)
        kmask = kk < F
        av = tl.load(a_ptr + mk[:, None, None] * F + kk[None, None, :], mask=used[:, None, None] & kmask[None, None, :],
                     other=0.0)  # [KP, 1, BK] each expert's activation
        wd = tl.load(w_ptr + wrow + kk[None, None, :], mask=wmask & kmask[None, None, :], other=0.0)
        part += tl.sum(wd.to(tl.float32) * av, 2)
    wts = tl.load(wts_ptr + mk, mask=used, other=0.0)
    tl.store(out_ptr + rows, tl.sum(part * wts[:, None], 0), mask=ok)  # over the experts: a fixed tree order


@triton.jit
def _linear_vec(x_ptr, w_ptr, out_ptr, norm_ptr, add_ptr, N, K, eps, HAS_NORM: tl.constexpr, HAS_ADD: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)  # [BN] output columns
    ok = rows < N
    r = 1.0
    if HAS_NORM:  # RMSNorm of the activation first: every program sums x^2 itself (x is K floats, from cache)
        sq = tl.zeros([BK], dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            xv = tl.load(x_ptr + kk, mask=kk < K, other=0.0)
            sq += xv * xv
        r = 1.0 / tl.sqrt(tl.sum(sq, 0) / K + eps)
    acc = tl.zeros([BN, BK], dtype=tl.float32)  # reduced once at the end: independent partial sums in flight
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        kmask = kk < K
        xv = tl.load(x_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
        if HAS_NORM:
            xv = xv * r * tl.load(norm_ptr + kk, mask=kmask, other=0.0)
        wt = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + kk[None, :], mask=ok[:, None] & kmask[None, :],
                     other=0.0)
        acc += wt.to(tl.float32) * xv[None, :]
    y = tl.sum(acc, 1)
    if HAS_ADD:  # the residual stream added in the epilogue
        y += tl.load(add_ptr + rows, mask=ok, other=0.0)
    tl.store(out_ptr + rows, y, mask=ok)


def linear_vec(x: Tensor, w: Tensor, norm: Tensor | None = None, eps: float = 0.0,
               add: Tensor | None = None) -> Tensor:
    """x [1, K] (f32) times w [N, K] (f16/bf16/f32, contiguous) -> [1, N] f32 in one launch: the activation stays
    f32 and the products accumulate in f32 (the torch form takes three launches: x to f16, the product, the
    result back to f32). With `norm` [K], x is RMS-normed first (x / sqrt(mean(x^2) + eps) * norm, the launch
    a separate RMSNorm would take); with `add` [1, N], the result is add + x w^T (the residual add's launch).
    Neither width is a compile-time constant: every product shares one compile (each sandboxed worker compiles
    afresh, so compiles are paid per launch)."""
    n, k = w.shape
    xv = x.reshape(-1).float()
    if xv.shape[0] != k:
        raise ValueError(f"activation of {xv.shape[0]} values for a [{n}, {k}] matrix")
    if norm is not None and norm.numel() != k or add is not None and add.numel() != n:
        raise ValueError(f"norm weight / addend do not fit a [{n}, {k}] matrix")
    out = torch.empty(1, n, dtype=torch.float32, device=x.device)
    nv = out if norm is None else norm.reshape(-1).float().contiguous()  # a placeholder pointer when unused
    av = out if add is None else add.reshape(-1).float().contiguous()
    bn, bk, warps = vec_blocks(n, k)
    _linear_vec[(triton.cdiv(n, bn),)](xv.contiguous(), w, out, nv, av, n, k, eps, HAS_NORM=norm is not None,
                                       HAS_ADD=add is not None, BN=bn, BK=bk, num_warps=warps)
    return out


def vec_blocks(n: int, k: int) -> tuple[int, int, int]:
    """linear_vec's (rows, reduction step, warps) per program. A mat-vec is bound by the bytes in flight: each
    program streams a [BN, BK] tile per step. Chosen from bench/h200_kernel_sweep.py on one H200 (2026-12-02,
    bench/results-h200-2026-12-02-session6), one token's products summed: k3-gpu 236.7 -> 220.5 us, k3-wide
    87.4 -> 76.2 us, against (16 or 8 or 4 rows, 512, 4 warps) before:
    - BK: the widest power of two up to 1024 that divides K (a partial last step costs a whole one: K = 1536
      at 1024 was slower than at 512);
    - BN: 8 rows where that still gives two programs per multiprocessor (132 on an H200), else 4, and 2 for
      the narrowest products (the router's 64 rows: 3.9 -> 2.6 us);
    - 8 warps where there are few programs and a long reduction (K >= 1024), else 4."""
    many = n >= 8 * 2 * 132
    bn = 8 if many else (4 if n >= 1024 else 2)
    return bn, widest_step(k, 1024), 4 if many or k < 1024 else 8


def widest_step(k: int, top: int) -> int:
    """The widest power of two up to `top` that divides k (at least 16): a reduction over k in whole steps (a
    partial last step costs a whole one; a step that divides k is at most k, so no clamp is needed)."""
    bk = top
    while bk > 16 and k % bk:
        bk //= 2
    return bk


@triton.jit
def _route(logits_ptr, bias_ptr, sel_ptr, wts_ptr, wsum_min, scale, X: tl.constexpr, K_USED: tl.constexpr,
           BX: tl.constexpr, SIGMOID: tl.constexpr, NORM: tl.constexpr, SCALE: tl.constexpr):
    offs = tl.arange(0, BX)
    ok = offs < X
    z = tl.load(logits_ptr + offs, mask=ok, other=-float("inf"))
    if SIGMOID:
        p = tl.sigmoid(z)
    else:
        ez = tl.exp(z - tl.max(z, 0))
        p = ez / tl.sum(ez, 0)
    p = tl.where(ok, p, 0.0)
    s = tl.where(ok, p + tl.load(bias_ptr + offs, mask=ok, other=0.0), -float("inf"))  # selection score
    ks = tl.arange(0, K_USED)
    sv = tl.zeros([K_USED], dtype=tl.int64)
    wv = tl.zeros([K_USED], dtype=tl.float32)
    for i in range(K_USED):  # the k largest scores, largest first (torch.topk's order)
        j = tl.argmax(s, 0)
        w = tl.sum(tl.where(offs == j, p, 0.0), 0)  # the unbiased probability of the chosen expert
        sv = tl.where(ks == i, j.to(tl.int64), sv)
        wv = tl.where(ks == i, w, wv)
        s = tl.where(offs == j, -float("inf"), s)
    if NORM:
        wv = wv / tl.maximum(tl.sum(wv, 0), wsum_min)
    if SCALE:
        wv = wv * scale
    tl.store(sel_ptr + ks, sv)
    tl.store(wts_ptr + ks, wv)


def route(logits: Tensor, bias: Tensor, k: int, sigmoid: bool, norm: bool, scale: float,
          wsum_min: float) -> tuple[Tensor, Tensor]:
    """The router's choice for one token in one launch: probabilities (sigmoid or softmax of logits [1, X]),
    the k experts of largest probability + bias [X] (largest first), their unbiased probabilities, normalized
    to sum 1 (the sum clamped at wsum_min) when `norm`, times `scale` unless it is 0 or 1.
    -> sel [k] long, wts [k] f32. k must be a power of two (K3's 16; the generated models' 2, 8, 16)."""
    n = int(logits.shape[-1])
    if k & (k - 1) or not 0 < k <= n:
        raise ValueError(f"route: k = {k} must be a power of two in 1..{n}")
    sel = torch.empty(k, dtype=torch.long, device=logits.device)
    wts = torch.empty(k, dtype=torch.float32, device=logits.device)
    scaled = scale not in (0.0, 1.0)
    _route[(1,)](logits.reshape(-1).float().contiguous(), bias.reshape(-1).float().contiguous(), sel, wts,
                 wsum_min, scale if scaled else 1.0, X=n, K_USED=k, BX=triton.next_power_of_2(n), SIGMOID=sigmoid,
                 NORM=norm, SCALE=scaled)
    return sel, wts


@triton.jit
def _situ(h_ptr, out_ptr, inv_beta, inv_lb, beta_lb, F, LINEAR_UP: tl.constexpr, BF: tl.constexpr):
    cols = tl.program_id(0) * BF + tl.arange(0, BF)
    ok = cols < F
    g = tl.load(h_ptr + cols, mask=ok, other=0.0)
    u = tl.load(h_ptr + F + cols, mask=ok, other=0.0)
    if LINEAR_UP:
        a = _tanh(g * inv_beta) * tl.sigmoid(g) * u * beta_lb
    else:
        a = _tanh(g * inv_beta) * tl.sigmoid(g) * _tanh(u * inv_lb) * beta_lb
    tl.store(out_ptr + cols, a, mask=ok)


def situ_vec(h: Tensor, beta: float, linear_beta: float) -> Tensor:
    """situ of one token's h = [g | u] [1, 2F] f32 (a gate|up product) -> [1, F] f32 in one launch (F is not a
    compile-time constant: the dense FFN and the shared experts share one compile)."""
    hv = h.reshape(-1)
    f = int(hv.shape[0]) // 2
    out = torch.empty(1, f, dtype=torch.float32, device=h.device)
    linear_up = not linear_beta > 0
    _situ[(triton.cdiv(f, BLOCK_SITU),)](hv.float().contiguous(), out, 1.0 / beta,
                                        0.0 if linear_up else 1.0 / linear_beta,
                                        beta if linear_up else beta * linear_beta, f, LINEAR_UP=linear_up,
                                        BF=BLOCK_SITU)
    return out


@triton.jit
def _res_mix(bank_ptr, cur_ptr, score_ptr, out_ptr, C, eps, E: tl.constexpr, CP: tl.constexpr, BE: tl.constexpr,
             COLS: tl.constexpr):
    # every program scores all rows (pass 1, the same sums in the same order), then mixes its own COLS columns. Both
    # loops are unrolled (E, BE and COLS are compile-time constants), so each pass's loads go out together: as loops,
    # every step waited for its rows before the next step asked (k3-gpu: 4 + 4 dependent steps of 8 x 512 floats)
    rows = tl.arange(0, CP)  # checkpoints 0..C-1 from the bank, row C the current stream, the rest padding
    is_bank = rows < C
    is_row = rows <= C
    sq = tl.zeros([CP, BE], dtype=tl.float32)
    xw = tl.zeros([CP, BE], dtype=tl.float32)
    for e0 in tl.static_range(0, E, BE):  # pass 1: sum x^2 and sum x * score_w of every row
        cols = e0 + tl.arange(0, BE)
        cm = cols < E
        xb = tl.load(bank_ptr + rows[:, None] * E + cols[None, :], mask=is_bank[:, None] & cm[None, :], other=0.0)
        xc = tl.load(cur_ptr + cols, mask=cm, other=0.0)
        x = tl.where((rows == C)[:, None], xc[None, :], xb)
        sq += x * x
        xw += x * tl.load(score_ptr + cols, mask=cm, other=0.0)[None, :]
    # score_c = sum_e rmsnorm(x_c)_e w_e = (sum_e x_c,e w_e) / sqrt(mean_e x_c,e^2 + eps); softmax over rows
    sc = tl.sum(xw, 1) / tl.sqrt(tl.sum(sq, 1) / E + eps)
    sc = tl.where(is_row, sc, -float("inf"))
    p = tl.exp(sc - tl.max(sc, 0))
    p = p / tl.sum(p, 0)
    c0 = tl.program_id(0) * COLS
    for e0 in tl.static_range(0, COLS, BE):  # pass 2: the mix of the raw rows, this program's columns
        cols = c0 + e0 + tl.arange(0, BE)
        cm = cols < E
        xb = tl.load(bank_ptr + rows[:, None] * E + cols[None, :], mask=is_bank[:, None] & cm[None, :], other=0.0)
        xc = tl.load(cur_ptr + cols, mask=cm, other=0.0)
        x = tl.where((rows == C)[:, None], xc[None, :], xb)
        tl.store(out_ptr + cols, tl.sum(x * p[:, None], 0), mask=cm)


def res_mix(bank: Tensor, cur: Tensor, score_w: Tensor, eps: float, max_rows: int) -> Tensor:
    """One token's softmax mix of the banked checkpoints bank [1, C, E] and the current stream cur [1, E]
    (f32), scored on their RMS-normed values with score_w [E]: -> [1, E] f32 in one launch (one program: two
    passes over C + 1 rows; with RES_MIX_COLS, programs of that many output columns, each scoring every row
    itself). max_rows >= C + 1 sets the padded row count, so every layer shares one compile."""
    _, c, e = bank.shape
    cp = triton.next_power_of_2(max_rows)
    if c + 1 > max_rows:
        raise ValueError(f"res_mix: {c} checkpoints + the current row exceed max_rows {max_rows}")
    out = torch.empty(1, e, dtype=torch.float32, device=cur.device)
    be, cols = res_mix_blocks(e, cp)
    _res_mix[(triton.cdiv(e, cols),)](bank.float().contiguous(), cur.float().contiguous(),
                                      score_w.float().contiguous(), out, c, eps, E=e, CP=cp, BE=be, COLS=cols)
    return out


def res_mix_blocks(e: int, cp: int) -> tuple[int, int]:
    """res_mix's (columns per step, output columns per program) for width e and cp padded rows: a step holds
    about 4096 floats (cp x BE, BE at least 16), and RES_MIX_COLS <= 0 puts every column in one program."""
    be = max(16, min(1024, 4096 // cp))
    cols = triton.cdiv(e, be) * be if RES_MIX_COLS <= 0 else triton.next_power_of_2(RES_MIX_COLS)
    return min(be, cols), cols


@triton.jit
def _conv_silu(x_ptr, state_ptr, w_ptr, ch, KC: tl.constexpr):
    # one token through the causal depthwise conv of channels ch [HD]: taps 0..KC-2 weigh the state (the last
    # KC-1 inputs), tap KC-1 the new input; the state shifts by one and keeps the new input; then silu
    x = tl.load(x_ptr)
    acc = x * tl.load(w_ptr + ch * KC + (KC - 1))
    prev = x  # the value state[ch, j] takes: state[ch, j + 1], and the new input for j = KC - 2
    for jj in range(KC - 1):
        j = KC - 2 - jj  # from the last tap down, so each old value is read before it is overwritten
        old = tl.load(state_ptr + ch * (KC - 1) + j)
        acc += old * tl.load(w_ptr + ch * KC + j)
        tl.store(state_ptr + ch * (KC - 1) + j, prev)
        prev = old
    return acc * tl.sigmoid(acc)


@triton.jit
def _kda_step(q_ptr, k_ptr, v_ptr, gf_ptr, beta_ptr, gout_ptr, conv_ptr, convw_ptr, na_ptr, dtna_ptr, s_ptr,
              norm_ptr, out_ptr, lower_bound, eps, scale, DI: tl.constexpr, HD: tl.constexpr, KC: tl.constexpr):
    h = tl.program_id(0)
    d = tl.arange(0, HD)
    c = h * HD + d  # this head's channels within q, k, v (and its dims within the gates)
    q = _conv_silu(q_ptr + c, conv_ptr, convw_ptr, c, KC)
    k = _conv_silu(k_ptr + c, conv_ptr, convw_ptr, DI + c, KC)
    v = _conv_silu(v_ptr + c, conv_ptr, convw_ptr, 2 * DI + c, KC)
    q = q / tl.sqrt(tl.sum(q * q, 0) + eps)  # l2 norms
    k = k / tl.sqrt(tl.sum(k * k, 0) + eps)
    # K3's gate: lb * sigmoid(exp(A_log) * (f + dt_bias)) = lb * sigmoid(dt_na + f * na), a log decay <= 0
    g = lower_bound * tl.sigmoid(tl.load(dtna_ptr + c) + tl.load(gf_ptr + c) * tl.load(na_ptr + h))
    beta = tl.sigmoid(tl.load(beta_ptr + h))
    sp = s_ptr + h * HD * HD + d[:, None] * HD + d[None, :]  # S[i = key dim, j = value dim]
    st = tl.load(sp) * tl.exp(g)[:, None]  # S' = diag(exp(g)) S
    u = beta * (v - tl.sum(k[:, None] * st, 0))  # beta (v - S'^T k)
    st = st + k[:, None] * u[None, :]  # S = S' + k u^T
    tl.store(sp, st)
    o = scale * tl.sum(q[:, None] * st, 0)  # scale * S^T q
    o = o / tl.sqrt(tl.sum(o * o, 0) / HD + eps) * tl.load(norm_ptr + d)  # rms norm over the head
    o = o * tl.sigmoid(tl.load(gout_ptr + c))  # the full-rank output gate
    tl.store(out_ptr + c, o)


def kda_step(q: Tensor, k: Tensor, v: Tensor, gf: Tensor, beta: Tensor, gout: Tensor, conv: Tensor,
             conv_w: Tensor, na: Tensor, dt_na: Tensor, s: Tensor, norm_w: Tensor, lower_bound: float, eps: float,
             scale: float) -> Tensor:
    """One token of a KDA layer after its input product, in one launch (one program per head): the causal
    conv + silu of q, k, v (conv [3di, K-1] updated in place), l2 norms, K3's lower-bounded gate, the delta
    rule on the state s [H, dk, dv] (updated in place), the head's RMS norm and the output gate.

    q, k, v, gout [1, di], gf [1, di] (the gate's f_b product), beta [1, H]: f32 rows (views of a product);
    conv_w [3di, 1, K]; na [H] = exp(A_log); dt_na [H, hd] = dt_bias * exp(A_log); norm_w [hd]. -> [1, di] f32."""
    h, hd, _ = s.shape
    di = h * hd
    kc = int(conv_w.shape[-1])
    if conv.shape != (3 * di, kc - 1) or hd & (hd - 1):
        raise ValueError(f"kda_step: conv state {tuple(conv.shape)} / head dim {hd} do not fit {h} heads")
    out = torch.empty(1, di, dtype=torch.float32, device=s.device)
    rows = [z.reshape(-1).float().contiguous() for z in (q, k, v, gf, beta, gout)]
    _kda_step[(h,)](*rows, conv, conv_w.contiguous(), na.reshape(-1).contiguous(), dt_na.reshape(-1).contiguous(),
                    s, norm_w.contiguous(), out, lower_bound, eps, scale, DI=di, HD=hd, KC=kc,
                    num_warps=WARPS["kda_step"])
    return out


@triton.jit
def _mla_qabs(q_ptr, wkb_ptr, kv_ptr, norm_ptr, lat_ptr, pos_ptr, qa_ptr, eps, KVR: tl.constexpr, ROPE: tl.constexpr,
              NOPE: tl.constexpr, BC: tl.constexpr):
    # q absorbed into the latent space, qa[h] = q_abs[h] | q_pe[h] with q_abs[h, c] = sum_n q_nope[h, n] wk_b[h, c, n]
    # (f32); program (0, 0) also writes the token's latent row (RMS-normed kv | k_pe, f16) at row pos
    h = tl.program_id(0)
    cb = tl.program_id(1)
    cc = cb * BC + tl.arange(0, BC)
    n = tl.arange(0, NOPE)
    r = tl.arange(0, ROPE)
    qn = tl.load(q_ptr + h * (NOPE + ROPE) + n)
    wk = tl.load(wkb_ptr + h * KVR * NOPE + cc[:, None] * NOPE + n[None, :]).to(tl.float32)
    tl.store(qa_ptr + h * (KVR + ROPE) + cc, tl.sum(wk * qn[None, :], 1))
    if cb == 0:
        tl.store(qa_ptr + h * (KVR + ROPE) + KVR + r, tl.load(q_ptr + h * (NOPE + ROPE) + NOPE + r))
        if h == 0:
            c = tl.arange(0, KVR)
            kv = tl.load(kv_ptr + c)
            kv = kv / tl.sqrt(tl.sum(kv * kv, 0) / KVR + eps) * tl.load(norm_ptr + c)
            row = lat_ptr + tl.load(pos_ptr).to(tl.int64) * (KVR + ROPE)
            tl.store(row + c, kv.to(tl.float16))
            tl.store(row + KVR + r, tl.load(kv_ptr + KVR + r).to(tl.float16))


@triton.jit
def _mla_q(qa_ptr, rows, ok, qscale, KVR: tl.constexpr, ROPE: tl.constexpr):
    # BM query rows of qa [rows, KVR + ROPE] f32 as f16 tensor-core operands: each row scaled by a power of two
    # 2^-e (exact) so its largest value is in [1, 2), then split hi = f16(x), lo = f16(x - hi): hi + lo keeps ~22
    # bits of every value whatever its magnitude (f16 alone keeps 11, and overflows past 65504), and a row of
    # f16 values (an f16 product's output) is hi alone, exactly. -> (hi, lo of the latent part [BM, KVR], hi, lo
    # of the rope part [BM, ROPE], the scores' scale 2^e * qscale [BM])
    c = tl.arange(0, KVR)
    r = tl.arange(0, ROPE)
    base = qa_ptr + rows.to(tl.int64)[:, None] * (KVR + ROPE)
    qa = tl.load(base + c[None, :], mask=ok[:, None], other=0.0)
    qp = tl.load(base + KVR + r[None, :], mask=ok[:, None], other=0.0)
    amax = tl.maximum(tl.max(tl.abs(qa), 1), tl.max(tl.abs(qp), 1))  # [BM]
    ebits = tl.maximum(amax.to(tl.int32, bitcast=True) & 0x7F800000, 1 << 23)  # 2^e, e = floor(log2 amax)
    inv = ((254 << 23) - ebits).to(tl.float32, bitcast=True)  # 2^-e
    qa = qa * inv[:, None]
    qp = qp * inv[:, None]
    ah = qa.to(tl.float16)
    ph = qp.to(tl.float16)
    al = (qa - ah.to(tl.float32)).to(tl.float16)
    pl = (qp - ph.to(tl.float32)).to(tl.float16)
    return ah, al, ph, pl, ebits.to(tl.float32, bitcast=True) * qscale


@triton.jit
def _mla_step(ah, al, ph, pl, sw, lat_ptr, t, rows_ok, seen, m_i, l_i, acc, KVR: tl.constexpr, ROPE: tl.constexpr,
              Q_SPLIT: tl.constexpr, P_SPLIT: tl.constexpr):
    # one tile of latent rows t [BT] (rows_ok: the rows to load) against BM query rows (_mla_q's parts), every
    # query row sharing the one latent "MQA" row per token: scores s [BM, BT] = q_abs . kv + q_pe . k_pe on the
    # tensor cores (f16 operands, f32 sums; products of f16 values are exact in f32), then scaled by sw [BM] into
    # the log2 domain (sw = 2^e * scale * log2 e); `seen` [BM, BT]: the pairs the softmax counts. The online softmax's running max
    # m_i [BM], sum l_i [BM] and weighted latent sum acc [BM, KVR] are updated and returned. P_SPLIT: the
    # weights in hi + lo f16 parts as q (else one f16 part: ~2^-12 relative per weight, in sum and numerator)
    c = tl.arange(0, KVR)
    r = tl.arange(0, ROPE)
    rowp = lat_ptr + t.to(tl.int64)[:, None] * (KVR + ROPE)
    kv = tl.load(rowp + c[None, :], mask=rows_ok[:, None], other=0.0)  # [BT, KVR] f16
    pe = tl.load(rowp + KVR + r[None, :], mask=rows_ok[:, None], other=0.0)  # [BT, ROPE] f16
    kvt = tl.trans(kv)
    pet = tl.trans(pe)
    sc = tl.dot(ah, kvt)
    sc = tl.dot(ph, pet, sc)
    if Q_SPLIT:
        sc = tl.dot(al, kvt, sc)
        sc = tl.dot(pl, pet, sc)
    sc = tl.where(seen, sc * sw[:, None], -float("inf"))
    m_new = tl.maximum(m_i, tl.max(sc, 1))
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # a query row with no row seen yet
    p = tl.exp2(sc - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    p_hi = p.to(tl.float16)
    acc = tl.dot(p_hi, kv, acc * alpha[:, None])
    if P_SPLIT:
        acc = tl.dot((p - p_hi.to(tl.float32)).to(tl.float16), kv, acc)
        l_i = l_i * alpha + tl.sum(p, 1)
    else:
        l_i = l_i * alpha + tl.sum(p_hi.to(tl.float32), 1)
    return m_new, l_i, acc


@triton.jit
def _mla_rows_per(pos, n_split, rows_min, BT: tl.constexpr):
    # rows per split at this position: the live rows 0..pos over the n_split splits, in whole steps of BT rows,
    # at least rows_min (a shallow position in a large graph span still fills the splits it needs)
    return tl.maximum(tl.cdiv(tl.cdiv(pos + 1, n_split), BT) * BT, rows_min)


@triton.jit
def _mla_split_span(pos_ptr, sp, n_split, rows_min, BT: tl.constexpr):
    # split sp's latent rows [lo, hi) at the position read on the device; lo >= hi: a split past pos
    pos = tl.load(pos_ptr).to(tl.int32)
    rows_per = _mla_rows_per(pos, n_split, rows_min, BT)
    lo = sp * rows_per
    return lo, tl.minimum(lo + rows_per, pos + 1)


@triton.jit(do_not_specialize=["H", "n_split", "rows_min"])
def _mla_split(qa_ptr, lat_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr, H, n_split, rows_min, qscale, KVR: tl.constexpr,
               ROPE: tl.constexpr, BH: tl.constexpr, BT: tl.constexpr, Q_SPLIT: tl.constexpr,
               P_SPLIT: tl.constexpr):
    # flash-decoding: one (block of BH heads, split of the latent rows 0..pos); the split's rows are read once
    # for all BH heads. Rows per split follow pos (read on the device), so every split holds live rows whatever
    # the span; a split past pos (a shallow position) exits at once and writes nothing (the combine reads only
    # the splits that hold a row <= pos). Writes the split's running max, sum and weighted latent sum per head:
    # m, l [n_split, H], acc [n_split, H, KVR]
    hb = tl.program_id(0)
    sp = tl.program_id(1)
    lo, hi = _mla_split_span(pos_ptr, sp, n_split, rows_min, BT)
    if lo < hi:
        heads = hb * BH + tl.arange(0, BH)
        hm = heads < H
        ah, al, ph, pl, sw = _mla_q(qa_ptr, heads, hm, qscale, KVR, ROPE)
        m_i = tl.full([BH], -float("inf"), dtype=tl.float32)
        l_i = tl.zeros([BH], dtype=tl.float32)
        acc = tl.zeros([BH, KVR], dtype=tl.float32)
        for t0 in range(lo, hi, BT):
            t = t0 + tl.arange(0, BT)
            ok = t < hi
            m_i, l_i, acc = _mla_step(ah, al, ph, pl, sw, lat_ptr, t, ok, ok[None, :], m_i, l_i, acc, KVR, ROPE,
                                      Q_SPLIT, P_SPLIT)
        at = sp.to(tl.int64) * H + heads
        tl.store(m_ptr + at, m_i, mask=hm)
        tl.store(l_ptr + at, l_i, mask=hm)
        tl.store(acc_ptr + at[:, None] * KVR + tl.arange(0, KVR)[None, :], acc, mask=hm[:, None])


@triton.jit(do_not_specialize=["H", "n_split", "rows_min"])
def _mla_split_rows(qa_ptr, lat_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr, H, n_split, rows_min, qscale,
                    KVR: tl.constexpr, ROPE: tl.constexpr, BH: tl.constexpr, BT: tl.constexpr, Q_SPLIT: tl.constexpr,
                    P_SPLIT: tl.constexpr):
    # _mla_split with the products turned over: the latent rows are the products' M side and the heads their N
    # side, scores^T [BT, BH] = kv [BT, KVR] . q_abs^T (+ k_pe . q_pe^T) and the weighted sum acc^T [KVR, BH] +=
    # kv^T [KVR, BT] . p^T [BT, BH]. The head form's products have M = BH = 16 (a tensor-core step of 16 rows, the
    # tile too small for Hopper's warpgroup products, which take 64 rows); here M is BT or KVR, so the products can
    # run as warpgroup products, and BH (N) can grow past 16 without growing M. The split, the online softmax
    # (here over axis 0) and the partials written (m, l [n_split, H], acc [n_split, H, KVR]) are _mla_split's
    hb = tl.program_id(0)
    sp = tl.program_id(1)
    lo, hi = _mla_split_span(pos_ptr, sp, n_split, rows_min, BT)
    if lo < hi:
        heads = hb * BH + tl.arange(0, BH)
        hm = heads < H
        ah, al, ph, pl, sw = _mla_q(qa_ptr, heads, hm, qscale, KVR, ROPE)
        aht = tl.trans(ah)  # [KVR, BH]
        pht = tl.trans(ph)  # [ROPE, BH]
        alt = tl.trans(al)
        plt = tl.trans(pl)
        c = tl.arange(0, KVR)
        r = tl.arange(0, ROPE)
        m_i = tl.full([BH], -float("inf"), dtype=tl.float32)
        l_i = tl.zeros([BH], dtype=tl.float32)
        acc = tl.zeros([KVR, BH], dtype=tl.float32)
        for t0 in range(lo, hi, BT):
            t = t0 + tl.arange(0, BT)
            ok = t < hi
            rowp = lat_ptr + t.to(tl.int64)[:, None] * (KVR + ROPE)
            kv = tl.load(rowp + c[None, :], mask=ok[:, None], other=0.0)  # [BT, KVR] f16
            pe = tl.load(rowp + KVR + r[None, :], mask=ok[:, None], other=0.0)  # [BT, ROPE] f16
            sc = tl.dot(kv, aht)  # [BT, BH]
            sc = tl.dot(pe, pht, sc)
            if Q_SPLIT:
                sc = tl.dot(kv, alt, sc)
                sc = tl.dot(pe, plt, sc)
            sc = tl.where(ok[:, None], sc * sw[None, :], -float("inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 0))
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            p = tl.exp2(sc - m_safe[None, :])
            alpha = tl.exp2(m_i - m_safe)
            p_hi = p.to(tl.float16)
            kvt = tl.trans(kv)  # [KVR, BT]
            acc = tl.dot(kvt, p_hi, acc * alpha[None, :])
            if P_SPLIT:
                acc = tl.dot(kvt, (p - p_hi.to(tl.float32)).to(tl.float16), acc)
                l_i = l_i * alpha + tl.sum(p, 0)
            else:
                l_i = l_i * alpha + tl.sum(p_hi.to(tl.float32), 0)
            m_i = m_new
        at = sp.to(tl.int64) * H + heads
        tl.store(m_ptr + at, m_i, mask=hm)
        tl.store(l_ptr + at, l_i, mask=hm)
        tl.store(acc_ptr + at[None, :] * KVR + c[:, None], acc, mask=hm[None, :])


@triton.jit(do_not_specialize=["H", "n_split", "rows_min"])
def _mla_combine(m_ptr, l_ptr, acc_ptr, pos_ptr, olat_ptr, H, n_split, rows_min, KVR: tl.constexpr,
                 BT: tl.constexpr, BS: tl.constexpr, BC: tl.constexpr):
    # one (head, block of BC latent columns): the live splits (those holding a row <= pos, as _mla_split cut
    # them) merged by their running maxima, looping over them BS at a time; -> the normalized latent mix
    # olat [H, KVR]
    h = tl.program_id(0)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    pos = tl.load(pos_ptr).to(tl.int32)
    n_live = tl.minimum(pos // _mla_rows_per(pos, n_split, rows_min, BT) + 1, n_split)
    mv = tl.full([BS], -float("inf"), dtype=tl.float32)
    for s0 in range(0, n_live, BS):
        s = s0 + tl.arange(0, BS)
        mv = tl.maximum(mv, tl.load(m_ptr + s.to(tl.int64) * H + h, mask=s < n_live, other=-float("inf")))
    mx = tl.max(mv, 0)  # finite: split 0 always holds row 0
    lv = tl.zeros([BS], dtype=tl.float32)
    av = tl.zeros([BS, BC], dtype=tl.float32)
    for s0 in range(0, n_live, BS):
        s = s0 + tl.arange(0, BS)
        ok = s < n_live
        at = s.to(tl.int64) * H + h
        w = tl.where(ok, tl.exp2(tl.load(m_ptr + at, mask=ok, other=0.0) - mx), 0.0)
        lv += w * tl.load(l_ptr + at, mask=ok, other=0.0)
        av += w[:, None] * tl.load(acc_ptr + at[:, None] * KVR + cols[None, :], mask=ok[:, None], other=0.0)
    tl.store(olat_ptr + h * KVR + cols, tl.sum(av, 0) / tl.sum(lv, 0))


@triton.jit
def _mla_vout(olat_ptr, wvb_ptr, gate_ptr, out_ptr, HAS_GATE: tl.constexpr, KVR: tl.constexpr, V: tl.constexpr,
              BV: tl.constexpr):
    # out of the latent space: out[h, v] = sum_c olat[h, c] wv_b[h, v, c] (times the sigmoid output gate)
    h = tl.program_id(0)
    vv = tl.program_id(1) * BV + tl.arange(0, BV)
    c = tl.arange(0, KVR)
    o_lat = tl.load(olat_ptr + h * KVR + c)
    wv = tl.load(wvb_ptr + h * V * KVR + vv[:, None] * KVR + c[None, :]).to(tl.float32)  # [BV, KVR]
    o = tl.sum(wv * o_lat[None, :], 1)
    if HAS_GATE:
        o = o * tl.sigmoid(tl.load(gate_ptr + h * V + vv))
    tl.store(out_ptr + h * V + vv, o)


@triton.jit(do_not_specialize=["n_rows", "H", "pos0"])
def _mla_causal(qa_ptr, lat_ptr, out_ptr, n_rows, H, pos0, qscale, KVR: tl.constexpr, ROPE: tl.constexpr,
                BM: tl.constexpr, BT: tl.constexpr, Q_SPLIT: tl.constexpr, P_SPLIT: tl.constexpr):
    # causal flash attention of a prefill call's query rows (token t, head h) = row t * H + h, at position
    # pos0 + t, over the latent rows 0..pos0 + t: one program per BM rows, reading only the rows up to its last
    # token's position (the masked half above the diagonal is never read); -> olat [n_rows, KVR] normalized.
    # The blocks run last-first, the longest first
    mb = tl.num_programs(0) - 1 - tl.program_id(0)
    rows = mb * BM + tl.arange(0, BM)
    ok = rows < n_rows
    qpos = pos0 + rows // H  # [BM] each row's last latent row
    last = pos0 + (tl.minimum(mb * BM + BM, n_rows) - 1) // H
    ah, al, ph, pl, sw = _mla_q(qa_ptr, rows, ok, qscale, KVR, ROPE)
    m_i = tl.full([BM], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, KVR], dtype=tl.float32)
    for t0 in range(0, last + 1, BT):
        t = t0 + tl.arange(0, BT)
        m_i, l_i, acc = _mla_step(ah, al, ph, pl, sw, lat_ptr, t, t <= last, t[None, :] <= qpos[:, None], m_i, l_i,
                                  acc, KVR, ROPE, Q_SPLIT, P_SPLIT)
    o = acc / tl.where(ok, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * KVR + tl.arange(0, KVR)[None, :], o, mask=ok[:, None])


def mla_attend(q_abs: Tensor, q_pe: Tensor, latent: Tensor, n_past: int, scale: float) -> Tensor:
    """Causal absorbed MLA attention of a prefill call's T tokens in one launch: token t (at position n_past + t)
    over the latent rows 0..n_past + t, softmax(scale * (q_abs . kv + q_pe . k_pe)) times kv, the scores on the
    tensor cores from hi + lo f16 parts of q (~f32 accuracy), only the rows on or below the diagonal read.

    q_abs [T, H, kvr] and q_pe [T, H, rope] f32; latent [n_ctx, kvr + rope] f16, rows n_past..n_past + T - 1
    written (kvr, rope powers of two). -> [T, H, kvr] f32, what model.attend returns for the absorbed form."""
    t, h, kvr = q_abs.shape
    rope = int(q_pe.shape[-1])
    if latent.shape[1] != kvr + rope or latent.dtype != torch.float16 or n_past + t > latent.shape[0]:
        raise ValueError(f"mla_attend: latent {tuple(latent.shape)} {latent.dtype} does not hold {n_past} + {t} "
                         f"rows of kvr {kvr} + rope {rope}")
    qa = torch.cat([q_abs, q_pe], -1).float().contiguous()  # [T, H, kvr + rope]
    out = torch.empty(t, h, kvr, dtype=torch.float32, device=q_abs.device)
    _mla_causal[(triton.cdiv(t * h, MLA_BM),)](qa, latent, out, t * h, h, n_past, scale * LOG2E, KVR=kvr, ROPE=rope, BM=MLA_BM,
                                               BT=MLA_CAUSAL_BT, Q_SPLIT=MLA_CAUSAL_Q_SPLIT, P_SPLIT=MLA_P_SPLIT,
                                               num_warps=WARPS["mla_causal"], num_stages=STAGES["mla_causal"])
    return out


def mla_splits(span: int, head_blocks: int) -> int:
    """mla_decode's splits of a span: about MLA_PROGRAMS programs over the head blocks, and no more than a span of
    MLA_ROWS_MIN-row splits holds (k3-gpu's 16 heads: 264 at span >= 33792; k3-wide's 96: 44)."""
    return max(1, min(triton.cdiv(span, MLA_ROWS_MIN), MLA_PROGRAMS // head_blocks))


def mla_rows_form(h: int) -> bool:
    """Whether mla_decode splits h heads' attention in the rows form (_mla_split_rows)."""
    return 0 < MLA_ROWS_FORM_HEADS <= h


def mla_head_block(h: int) -> int:
    """mla_decode's heads per split program: the form's tile (MLA_ROWS_BH or MLA_BH), or fewer where the heads are
    fewer (a tensor-core product needs at least 16: 16 heads stay one block of 16 whatever the tile)."""
    return max(16, min(MLA_ROWS_BH if mla_rows_form(h) else MLA_BH, triton.next_power_of_2(h)))


def mla_rows_per(pos: int, n_split: int) -> int:
    """The latent rows per split at position pos (what _mla_rows_per computes on the device)."""
    return max(triton.cdiv(triton.cdiv(pos + 1, n_split), MLA_BT) * MLA_BT, MLA_ROWS_MIN)


def mla_decode(q: Tensor, kv: Tensor, kv_norm: Tensor, latent: Tensor, pos: Tensor, span: int, wk_b: Tensor,
               wv_b: Tensor, gate: Tensor | None, scale: float, eps: float) -> Tensor:
    """One token of MLA's absorbed attention in four launches: q absorbed through wk_b (and the token's latent
    row, RMS-normed kv | k_pe in f16, written at `pos`); the split softmax over rows 0..pos of the first `span`
    rows, each program reading its rows once for a block of heads (tensor-core scores from q in one f16 part, or
    hi + lo parts with MLA_DECODE_Q_SPLIT); the combine of the live splits; out through wv_b (times the sigmoid
    output gate). kvr, rope, nope and v must be powers of two; the head count need not be.

    q [1, H, nope + rope] f32; kv [1, kvr + rope] f32; kv_norm [kvr]; latent [n_ctx, kvr + rope] f16 (written in
    place); pos [1] long on the device; wk_b [H, kvr, nope], wv_b [H, v, kvr] f16; gate [1, H * v] or None.
    -> [1, H * v] f32."""
    _, h, qlen = q.shape
    kvr, nope, v = int(wk_b.shape[1]), int(wk_b.shape[2]), int(wv_b.shape[1])
    rope = qlen - nope
    if latent.shape[1] != kvr + rope or latent.dtype != torch.float16 or wv_b.shape != (h, v, kvr):
        raise ValueError(f"mla_decode: latent {tuple(latent.shape)} {latent.dtype} / wv_b {tuple(wv_b.shape)} do "
                         f"not fit kvr {kvr} + rope {rope}, {h} heads")
    dev = q.device
    qa = torch.empty(h, kvr + rope, dtype=torch.float32, device=dev)
    bc = min(kvr, 32)
    _mla_qabs[(h, kvr // bc)](q.reshape(-1).float().contiguous(), wk_b, kv.reshape(-1).float().contiguous(),
                              kv_norm.float().contiguous(), latent, pos, qa, eps, KVR=kvr, ROPE=rope,
                              NOPE=nope, BC=bc)
    bh = mla_head_block(h)
    hb = triton.cdiv(h, bh)
    n_split = mla_splits(span, hb)
    m = torch.empty(n_split, h, dtype=torch.float32, device=dev)
    lsum = torch.empty(n_split, h, dtype=torch.float32, device=dev)
    acc = torch.empty(n_split, h, kvr, dtype=torch.float32, device=dev)
    name = "mla_split_rows" if mla_rows_form(h) else "mla_split"
    split = _mla_split_rows if name == "mla_split_rows" else _mla_split
    split[(hb, n_split)](qa, latent, pos, m, lsum, acc, h, n_split, MLA_ROWS_MIN, scale * LOG2E, KVR=kvr, ROPE=rope,
                         BH=bh, BT=MLA_BT, Q_SPLIT=MLA_DECODE_Q_SPLIT, P_SPLIT=MLA_P_SPLIT,
                         num_warps=WARPS[name], num_stages=STAGES[name])
    olat = torch.empty(h, kvr, dtype=torch.float32, device=dev)
    bcc = min(kvr, MLA_COMBINE_COLS)
    _mla_combine[(h, kvr // bcc)](m, lsum, acc, pos, olat, h, n_split, MLA_ROWS_MIN, KVR=kvr, BT=MLA_BT,
                                  BS=MLA_COMBINE_SPLITS,
                                  BC=bcc)
    out = torch.empty(1, h * v, dtype=torch.float32, device=dev)
    g = out if gate is None else gate.reshape(-1).float().contiguous()
    bv = min(v, 32)
    _mla_vout[(h, v // bv)](olat, wv_b, g, out, HAS_GATE=gate is not None, KVR=kvr, V=v, BV=bv)
    return out


@triton.jit
def _chunk_scan(u0_ptr, w_ptr, kt_ptr, dec_ptr, s_ptr, starts_ptr, us_ptr, N, H: tl.constexpr, C: tl.constexpr,
                DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):
    # the chunked delta rule's sequential part for one (head, block of value columns), the state in registers:
    # per chunk, U = u0 - w S and S <- diag(decay) S + k_tail^T U (columns of S are independent, so value
    # blocks are separate programs)
    h = tl.program_id(0)
    i_c = tl.arange(0, C)
    i_k = tl.arange(0, DK)
    i_v = tl.program_id(1) * BV + tl.arange(0, BV)
    st = tl.load(s_ptr + h * DK * DV + i_k[:, None] * DV + i_v[None, :])  # [DK, BV]
    for i in range(N):
        blk = (i * H + h).to(tl.int64)
        tl.store(starts_ptr + blk * DK * DV + i_k[:, None] * DV + i_v[None, :], st)
        w = tl.load(w_ptr + blk * C * DK + i_c[:, None] * DK + i_k[None, :])  # [C, DK]
        u = tl.load(u0_ptr + blk * C * DV + i_c[:, None] * DV + i_v[None, :]) - tl.dot(w, st, input_precision="ieee")
        tl.store(us_ptr + blk * C * DV + i_c[:, None] * DV + i_v[None, :], u)
        kt = tl.load(kt_ptr + blk * C * DK + i_c[:, None] * DK + i_k[None, :])  # [C, DK]
        dec = tl.load(dec_ptr + blk * DK + i_k)  # [DK]
        st = dec[:, None] * st + tl.dot(tl.trans(kt), u, input_precision="ieee")
    tl.store(s_ptr + h * DK * DV + i_k[:, None] * DV + i_v[None, :], st)


def chunk_scan(u0: Tensor, w: Tensor, k_tail: Tensor, decay: Tensor, s: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The chunked delta rule's chunk-to-chunk recurrence in one launch (the torch form: three per chunk):
    for chunk i, starts[i] = S; U_i = u0_i - w_i S; S <- diag(decay_i) S + k_tail_i^T U_i. f32, products in
    full f32 (no tf32), as torch's baddbmm.

    u0 [N, H, C, dv], w [N, H, C, dk], k_tail [N, H, C, dk], decay [N, H, dk], s [H, dk, dv] (not modified)
    -> (starts [N, H, dk, dv], U [N, H, C, dv], final S [H, dk, dv]). C, dk, dv: powers of two >= 16."""
    n, h, c, dv = u0.shape
    dk = int(w.shape[-1])
    if any(x < 16 or x & (x - 1) for x in (c, dk, dv)):
        raise ValueError(f"chunk_scan: chunk {c}, dk {dk}, dv {dv} must be powers of two >= 16")
    starts = torch.empty(n, h, dk, dv, dtype=torch.float32, device=s.device)
    us = torch.empty(n, h, c, dv, dtype=torch.float32, device=s.device)
    final = s.float().contiguous().clone()
    bv = min(dv, SCAN_BV)
    _chunk_scan[(h, dv // bv)](u0.float().contiguous(), w.float().contiguous(), k_tail.float().contiguous(),
                               decay.float().contiguous(), final, starts, us, n, H=h, C=c, DK=dk, DV=dv, BV=bv,
                               num_warps=WARPS["chunk_scan"])
    return starts, us, final


@triton.jit
def _grouped_mm(x_ptr, w_ptr, tiles_ptr, out_ptr, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # one tile of rows of one group (group, first row, end row from the tile table) times that group's
    # matrix, on the tensor cores (f16/bf16 products are exact in the f32 accumulator)
    t = tl.program_id(0)
    g = tl.load(tiles_ptr + 3 * t).to(tl.int64)
    r0 = tl.load(tiles_ptr + 3 * t + 1)
    r1 = tl.load(tiles_ptr + 3 * t + 2)
    rows = r0 + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    rm, cm = rows < r1, cols < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        km = kk < K
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + kk[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        b = tl.load(w_ptr + g * N * K + cols[:, None].to(tl.int64) * K + kk[None, :], mask=cm[:, None] & km[None, :],
                    other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], acc, mask=rm[:, None] & cm[None, :])


def grouped_mm(x: Tensor, w: Tensor, counts: list[int]) -> Tensor:
    """Row groups of x [n, K] (f16/bf16, group g's counts[g] rows after group g-1's) times their own matrix
    w[g] [N, K] -> [n, N] f32, in one launch over a table of (group, row range) tiles. What torch._grouped_mm
    computes; its f16 path on sm_90 loops over the groups (one product per expert hit)."""
    n, k = x.shape
    g, nn, kk = w.shape
    if kk != k or len(counts) != g or sum(counts) != n:
        raise ValueError(f"grouped_mm: x [{n}, {k}], w {tuple(w.shape)}, {len(counts)} counts summing to {sum(counts)}")
    tiles, r = [], 0
    for grp, cnt in enumerate(counts):
        tiles += [(grp, r0, min(r0 + GMM_BM, r + cnt)) for r0 in range(r, r + cnt, GMM_BM)]
        r += cnt
    out = torch.empty(n, nn, dtype=torch.float32, device=x.device)
    if not tiles:
        return out
    table = torch.tensor(tiles, dtype=torch.int32).to(x.device, non_blocking=True)
    _grouped_mm[(len(tiles), triton.cdiv(nn, GMM_BN))](x.contiguous(), w, table, out, nn, k, BM=GMM_BM, BN=GMM_BN,
                                                       BK=GMM_BK, num_warps=WARPS["grouped_mm"],
                                                       num_stages=STAGES["grouped_mm"])
    return out


def decode_experts(xin: Tensor, sel: Tensor, wts: Tensor, w_in: Tensor, w_down: Tensor, beta: float,
                   linear_beta: float) -> Tensor:
    """sum_m wts[m] * down_sel[m](situ(gate_sel[m](x), up_sel[m](x))) for one token.

    xin [1, lat] f32; sel [k] long and wts [k] f32 on the device; w_in [X, 2F, lat] (gate rows then up rows
    of each expert) and w_down [X, lat, F], f16 or bf16, contiguous. -> [1, lat] f32."""
    k = int(sel.shape[0])
    n_exp, two_f, lat = w_in.shape
    f = two_f // 2
    if w_down.shape != (n_exp, lat, f):
        raise ValueError(f"down weights {tuple(w_down.shape)} do not match gate|up {tuple(w_in.shape)}")
    x = xin.reshape(-1).float().contiguous()
    a = torch.empty(k, f, dtype=torch.float32, device=xin.device)
    linear_up = not linear_beta > 0
    _experts_in_situ[(k, triton.cdiv(f, BLOCK_F))](
        x, w_in, sel, a, 1.0 / beta, 0.0 if linear_up else 1.0 / linear_beta,
        beta if linear_up else beta * linear_beta,
        F=f, LAT=lat, LINEAR_UP=linear_up, BF=BLOCK_F, BK=(tile := in_situ_tile(lat))[0], num_warps=tile[1])
    out = torch.empty(1, lat, dtype=torch.float32, device=xin.device)
    kp, bk = down_sum_tile(k, f)
    _experts_down_sum[(triton.cdiv(lat, BLOCK_L),)](
        a, w_down, sel, wts.float().contiguous(), out, K_USED=k, KP=kp, F=f, LAT=lat, BL=BLOCK_L, BK=bk,
        num_warps=WARPS["experts_down_sum"])
    return out


def down_sum_tile(k: int, f: int) -> tuple[int, int]:
    """experts_down_sum's (experts padded to a power of two, reduction step over F): the step is BLOCK_KD, cut
    down until one tile (KP x BLOCK_L x step weights) holds at most DOWN_TILE elements (k3-gpu's 8 experts:
    16 x 1024, F in one step; k3-wide's 16: 32 x 512, six steps over F = 3072), and at most F rounded up to a
    power of two."""
    kp = triton.next_power_of_2(k)
    bk = min(BLOCK_KD, triton.next_power_of_2(f))
    while bk > 16 and kp * BLOCK_L * bk > DOWN_TILE:
        bk //= 2
    return kp, bk


def in_situ_tile(lat: int) -> tuple[int, int]:
    """experts_in_situ's (reduction step over the latent, warps): the step is widest_step(lat, BLOCK_K); a program
    whose step holds more than IN_SITU_TILE_4_WARPS weight elements (2 x BLOCK_F rows) runs 8 warps, else 4."""
    bk = widest_step(lat, BLOCK_K)
    return bk, 8 if 2 * BLOCK_F * bk > IN_SITU_TILE_4_WARPS else 4
