"""Triton kernels for sparkinfer's batch-1 decode: the routed experts of one token in two launches.

The torch form of one token's routed experts (model.K3Model._decode_experts) gathers the selected experts'
weights into new tensors (``w[e]``: a copy of every active expert's matrices, then a second read by the
product), rounds the activation to f16, multiplies, and applies situ and the weighted sum in ~15 launches.
On the K3-width slice one MoE layer's 16 active experts are 16 x (6144 x 3584 + 3584 x 3072) f16 = 1.06 GB,
so the copy alone moves 2.1 GB per layer per token.

Here each kernel reads an expert's rows where they lie (the index is a pointer offset, no copy):

* ``experts_in_situ``: for the k selected experts, both halves of the stacked gate|up matrix times x (f32
  activation, f16 weights, f32 accumulation, as llama.cpp's CUDA mat-vec for F16 weights computes), then
  situ, in one launch: a [k, F] f32;
* ``experts_down_sum``: each expert's down matrix times its row of a, weighted by the router and summed
  over the k experts in a fixed order inside each program (no atomics: the sum is the same every run, which
  a CUDA-graph replay and the round's greedy check need), in one launch: [1, lat] f32.

Loop bounds are compile-time constants (the model's widths), so one compile per model; the kernels never
read a host value, so a CUDA graph records them as they are. Tested on CPU through Triton's interpreter
(``TRITON_INTERPRET=1``, tests/test_sparkinfer_kernels.py); on CUDA they compile at the first (untimed)
warm-up step, before any graph capture.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

Tensor = torch.Tensor

BLOCK_F = 32  # output columns of a per program in experts_in_situ (each reads 2 x BLOCK_F weight rows)
BLOCK_L = 16  # output rows per program in experts_down_sum
BLOCK_K = 128  # reduction step (f16 weights: 256 bytes per row per step)


@triton.jit
def _tanh(x):
    # tanh(x) = sign(x) (1 - e^(-2|x|)) / (1 + e^(-2|x|)): never overflows; absolute error ~1e-7
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


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
                      K_USED: tl.constexpr, F: tl.constexpr, LAT: tl.constexpr,
                      BL: tl.constexpr, BK: tl.constexpr):
    rows = tl.program_id(0) * BL + tl.arange(0, BL)  # [BL] output rows (latent dims)
    ok = rows < LAT
    acc = tl.zeros([BL], dtype=tl.float32)
    for m in range(K_USED):  # fixed order: the same sum every run
        e = tl.load(sel_ptr + m).to(tl.int64)
        base = w_ptr + e * (LAT * F)  # expert e's [LAT, F] down matrix
        part = tl.zeros([BL], dtype=tl.float32)
        for k0 in range(0, F, BK):
            kk = k0 + tl.arange(0, BK)
            kmask = kk < F
            av = tl.load(a_ptr + m * F + kk, mask=kmask, other=0.0)[None, :]
            wd = tl.load(base + rows[:, None].to(tl.int64) * F + kk[None, :], mask=ok[:, None] & kmask[None, :],
                         other=0.0)
            part += tl.sum(wd.to(tl.float32) * av, 1)
        acc += tl.load(wts_ptr + m) * part
    tl.store(out_ptr + rows, acc, mask=ok)


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
        F=f, LAT=lat, LINEAR_UP=linear_up, BF=BLOCK_F, BK=BLOCK_K)
    out = torch.empty(1, lat, dtype=torch.float32, device=xin.device)
    _experts_down_sum[(triton.cdiv(lat, BLOCK_L),)](
        a, w_down, sel, wts.float().contiguous(), out, K_USED=k, F=f, LAT=lat, BL=BLOCK_L, BK=BLOCK_K)
    return out
