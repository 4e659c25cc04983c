"""sparkinfer's Triton decode kernels (engines/sparkinfer/kernels.py), run here through Triton's interpreter
(``TRITON_INTERPRET=1``: the same kernel source, executed on the CPU with numpy): against a float64
reference on fresh random inputs, and inside the model's static decode step against the torch form.
On CUDA the same source compiles; the engine's self-check (K3Model.enable_kernels) compares the two
forms on the real weights before the kernels are used."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from engines.sparkinfer.graph import StaticDecoder
from engines.sparkinfer.model import K3Model, Mat, _kernel_mats
from engines.sparkinfer.weights import load_weights
from scoreboard.models.k3 import load_k3_config
from scoreboard.weights.generate import generate


@pytest.fixture(scope="module")
def kernels():
    """The kernels module; without a GPU it must run in Triton's interpreter (tests/conftest.py sets it)."""
    from engines.sparkinfer import kernels as k

    if type(k._experts_in_situ).__name__ != "InterpretedFunction":  # these tests feed CPU tensors
        pytest.skip("triton compiles here (a GPU box): on the GPU the engine's own self-check compares the kernels")
    return k


def _reference(x, sel, wts, w_in, w_down, beta, lb):
    """The routed sum in float64 from the same f16 weights: sum_m wts[m] down_m(situ(gate_m x, up_m x))."""
    f = w_in.shape[1] // 2
    xd = x.double()[0]
    out = torch.zeros(w_down.shape[1], dtype=torch.float64)
    for m, e in enumerate(sel.tolist()):
        g, u = w_in[e, :f].double() @ xd, w_in[e, f:].double() @ xd
        a = beta * torch.tanh(g / beta) * torch.sigmoid(g) * (lb * torch.tanh(u / lb) if lb > 0 else u)
        out += wts[m].double() * (w_down[e].double() @ a)
    return out


@pytest.mark.parametrize("lb", [25.0, 0.0])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_experts_matches_float64(kernels, lb, dtype):
    gen = torch.Generator().manual_seed(int(lb) + (dtype == torch.bfloat16))
    # widths that are not multiples of the blocks, so the masks are exercised
    n_exp, f, lat, k = 7, 100, 72, 3
    w_in = (torch.randn(n_exp, 2 * f, lat, generator=gen) * 0.2).to(dtype)
    w_down = (torch.randn(n_exp, lat, f, generator=gen) * 0.2).to(dtype)
    x = torch.randn(1, lat, generator=gen) * 2
    sel = torch.randperm(n_exp, generator=gen)[:k]
    wts = torch.rand(k, generator=gen)
    got = kernels.decode_experts(x, sel, wts, w_in, w_down, 4.0, lb)
    want = _reference(x, sel, wts, w_in, w_down, 4.0, lb)
    assert got.shape == (1, lat) and got.dtype == torch.float32
    assert torch.isfinite(got).all()
    err = float((got[0].double() - want).norm() / want.norm())
    assert err < 1e-5, err  # f32 accumulation of exact f16/bf16 products
    # a different selection must give a different answer (the index is really read)
    other = kernels.decode_experts(x, sel.flip(0), wts, w_in, w_down, 4.0, lb)
    assert not torch.allclose(other, got)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_linear_vec_matches_float64(kernels, dtype):
    gen = torch.Generator().manual_seed(11)
    n, k = 37, 300  # neither a multiple of the blocks
    w = (torch.randn(n, k, generator=gen) * 0.1).to(dtype)
    base = torch.randn(1, k + 5, generator=gen)
    x = base[:, 5:]  # a column slice of a wider product, as the fused projections hand it on
    got = kernels.linear_vec(x, w)
    want = w.double() @ x[0].double()
    assert got.shape == (1, n) and got.dtype == torch.float32
    assert float((got[0].double() - want).norm() / want.norm()) < 1e-5
    with pytest.raises(ValueError, match="activation of 299 values"):
        kernels.linear_vec(base[:, 6:], w)
    # the RMSNorm prologue and the residual epilogue
    nw, add = torch.rand(k, generator=gen) + 0.5, torch.randn(1, n, generator=gen)
    xd = x[0].double()
    want = add[0].double() + w.double() @ (xd / (xd.pow(2).mean() + 1e-6).sqrt() * nw.double())
    got = kernels.linear_vec(x, w, nw, 1e-6, add)
    assert float((got[0].double() - want).norm() / want.norm()) < 1e-5
    with pytest.raises(ValueError, match="do not fit"):
        kernels.linear_vec(x, w, nw[:-1], 1e-6)


@pytest.mark.parametrize("sigmoid,norm,scale", [(True, True, 2.0), (False, False, 1.0), (True, False, 0.0)])
def test_route_matches_torch_topk(kernels, sigmoid, norm, scale):
    from engines.sparkinfer.model import ROUTER_WSUM_MIN

    gen = torch.Generator().manual_seed(3)
    n, k = 48, 8  # n not a power of two: the padded lanes must never be chosen
    for _ in range(5):  # fresh draws
        logits, bias = torch.randn(1, n, generator=gen) * 3, torch.randn(n, generator=gen) * 0.1
        sel, wts = kernels.route(logits, bias, k, sigmoid, norm, scale, ROUTER_WSUM_MIN)
        probs = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, -1)
        want_sel = torch.topk(probs + bias, k, -1).indices[0]
        want = probs[0, want_sel]
        if norm:
            want = want / want.sum().clamp_min(ROUTER_WSUM_MIN)
        if scale not in (0.0, 1.0):
            want = want * scale
        assert sel.dtype == torch.long and torch.equal(sel, want_sel)  # the same experts, largest first
        assert torch.allclose(wts, want, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="power of two"):
        kernels.route(logits, bias, 6, sigmoid, norm, scale, ROUTER_WSUM_MIN)


@pytest.mark.parametrize("lb", [25.0, 0.0])
def test_situ_vec_matches_the_torch_form(kernels, lb):
    from engines.sparkinfer.model import situ_joint

    h = torch.randn(1, 2 * 1500, generator=torch.Generator().manual_seed(4)) * 6  # 2 programs, one partial
    got = kernels.situ_vec(h, 4.0, lb)
    want = situ_joint(h, 4.0, lb)
    assert got.shape == (1, 1500)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)  # values up to beta * lb = 100


@pytest.mark.parametrize("n_ckpt", [1, 3])
@pytest.mark.parametrize("cols", [0, 128])  # one program, or programs of 128 columns (the last one partial)
def test_res_mix_matches_the_torch_form(kernels, n_ckpt, cols, monkeypatch):
    from engines.sparkinfer.model import rms_norm

    monkeypatch.setattr(kernels, "RES_MIX_COLS", cols)
    gen = torch.Generator().manual_seed(n_ckpt)
    e = 700  # not a multiple of the block
    bank, cur = torch.randn(1, n_ckpt, e, generator=gen) * 3, torch.randn(1, e, generator=gen)
    score = torch.randn(e, generator=gen) * 0.05
    allc = torch.cat([bank, cur[:, None]], 1)
    p = torch.softmax(rms_norm(allc, score, 1e-6).sum(-1), -1)
    want = torch.bmm(p[:, None, :], allc)[:, 0]
    got = kernels.res_mix(bank, cur, score, 1e-6, max_rows=5)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="exceed max_rows"):
        kernels.res_mix(bank, cur, score, 1e-6, max_rows=n_ckpt)


def test_kda_step_matches_a_float64_reference(kernels):
    """The fused KDA token (conv + silu, l2 norms, gate, delta rule, head norm, output gate) against the same
    arithmetic written out in float64; the conv and delta-rule states are updated in place."""
    gen = torch.Generator().manual_seed(8)
    h, hd, kc = 3, 32, 4
    di = h * hd

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    q, k, v, gf, gout = (r(1, di) for _ in range(5))
    beta, conv, conv_w = r(1, h), r(3 * di, kc - 1), r(3 * di, 1, kc, scale=0.5)
    na, dt_na, s, norm_w = r(h).abs() + 0.5, r(h, hd, scale=0.3), r(h, hd, hd, scale=0.1), r(hd).abs()
    lb, eps, scale = -5.0, 1e-6, hd ** -0.5
    conv0, s0 = conv.double().clone(), s.double().clone()
    got = kernels.kda_step(q, k, v, gf, beta, gout, conv, conv_w, na, dt_na, s, norm_w, lb, eps, scale)

    xx = torch.cat([conv0, torch.cat([q, k, v], -1).double().T], 1)  # [3di, K]
    y = (xx * conv_w[:, 0].double()).sum(-1)
    y = y * torch.sigmoid(y)
    qq, kk, vv = (z.view(h, hd) for z in y.split(di))
    qq = qq / (qq.pow(2).sum(-1, keepdim=True) + eps).sqrt()
    kk = kk / (kk.pow(2).sum(-1, keepdim=True) + eps).sqrt()
    g = lb * torch.sigmoid(dt_na.double() + gf.double().view(h, hd) * na.double()[:, None])
    b = torch.sigmoid(beta.double()).view(h, 1)
    st = s0 * torch.exp(g)[:, :, None]
    u = b * (vv - torch.einsum("hi,hij->hj", kk, st))
    st = st + kk[:, :, None] * u[:, None, :]
    o = scale * torch.einsum("hi,hij->hj", qq, st)
    o = o / (o.pow(2).mean(-1, keepdim=True) + eps).sqrt() * norm_w.double()
    o = o * torch.sigmoid(gout.double().view(h, hd))
    assert float((got.double().view(h, hd) - o).norm() / o.norm()) < 1e-5
    assert float((s.double() - st).norm() / st.norm()) < 1e-5
    assert torch.allclose(conv.double(), xx[:, 1:], rtol=0, atol=0)  # the state shifted by one token


def _q_one_f16_part(qa):
    """qa [H, kvr + rope] as mla_decode's scores take it in one f16 part: each row scaled by the power of two that
    puts its largest value in [1, 2), rounded to f16, scaled back."""
    amax = qa.abs().amax(-1, keepdim=True).clamp_min(2.0 ** -126)
    s = torch.exp2(torch.floor(torch.log2(amax)))
    return (qa / s).half().double() * s


def _mla_reference(q, kv, kv_norm, latent, pos, wk_b, wv_b, gate, scale, q_parts=2):
    """One MLA token in float64 over rows 0..pos of `latent` (which already holds the token's row at pos):
    (the row the kernel must have written, the output [H, v]). q_parts=1: q rounded as one f16 part."""
    h, v, kvr = wv_b.shape
    nope = wk_b.shape[2]
    kvd = kv[0].double()
    row = torch.cat([kvd[:kvr] / (kvd[:kvr].pow(2).mean() + 1e-6).sqrt() * kv_norm.double(), kvd[kvr:]])
    lat = latent[:pos + 1].double()
    qd = q[0].double()
    qa = torch.cat([torch.einsum("hn,hcn->hc", qd[:, :nope], wk_b.double()), qd[:, nope:]], -1)
    if q_parts == 1:
        qa = _q_one_f16_part(qa)
    sc = (qa[:, :kvr] @ lat[:, :kvr].T + qa[:, kvr:] @ lat[:, kvr:].T) * scale  # [H, pos + 1]
    o = torch.einsum("hc,hvc->hv", torch.softmax(sc, -1) @ lat[:, :kvr], wv_b.double())
    if gate is not None:
        o = o * torch.sigmoid(gate.double().view(h, v))
    return row, o


HALF_F16_ULP = 2.0 ** -13  # the softmax weights in one f16 part: each rounded by up to 2^-12 relative, the sum less

# (heads, kvr, cache rows, span, pos, MLA_ROWS_MIN, MLA_PROGRAMS, MLA_BT) -> (splits, rows per split, the split
# holding pos): a short span of 3 splits, pos in the middle of the second and the third beyond it; 4096 rows in
# 32 splits, 20 heads (one partial block of 32 heads, or a second, partial block of 16), pos in the middle of split
# 22 and 9 splits with no live row; 128 splits of 32 rows (the combine loops over its MLA_COMBINE_SPLITS twice), pos
# in the last live one; a shallow position in a large span, whose rows per split follow pos, not the span: 14 of its
# 16 splits live
MLA_CASES = {"short": ((2, 64, 256, 160, 100, 64, 264, 64), (3, 64, 1)),
             "long": ((20, 128, 6000, 4096, 2900, 128, 264, 64), (32, 128, 22)),
             "many splits": ((4, 64, 4200, 4096, 4000, 32, 10_000, 32), (128, 32, 125)),
             "shallow in a large span": ((3, 64, 4200, 4096, 2100, 32, 16, 32), (16, 160, 13))}


class _NotLaunched:
    """A kernel that must not run: launching it (kernel[grid](...)) fails the test."""

    def __getitem__(self, grid):
        raise AssertionError(f"the other split form was launched (grid {grid})")


def test_the_rows_form_runs_from_its_head_count(kernels, monkeypatch):
    monkeypatch.setattr(kernels, "MLA_ROWS_FORM_HEADS", 32)
    monkeypatch.setattr(kernels, "MLA_ROWS_BH", 32)
    monkeypatch.setattr(kernels, "MLA_BH", 16)
    assert [(kernels.mla_rows_form(h), kernels.mla_head_block(h)) for h in (16, 31, 32, 96)] == [
        (False, 16), (False, 16), (True, 32), (True, 32)]
    monkeypatch.setattr(kernels, "MLA_ROWS_FORM_HEADS", 0)
    assert not kernels.mla_rows_form(96) and kernels.mla_head_block(96) == 16


# (kernels.MLA_ROWS_FORM_HEADS, heads per program: MLA_BH for the head form, MLA_ROWS_BH for the rows form): each
# form at 32 heads per program (20 heads: one partial block) and at 16
SPLIT_FORMS = [(0, 32), (0, 16), (1, 32), (1, 16)]


@pytest.mark.parametrize("case", sorted(MLA_CASES))
@pytest.mark.parametrize("gated,p_split,q_split", [(True, False, False), (False, True, True)])
@pytest.mark.parametrize("form,bh", SPLIT_FORMS)
def test_mla_decode_matches_a_float64_reference(kernels, monkeypatch, case, gated, p_split, q_split, form, bh):
    """The token's latent row is written at pos (normed, f16), and the absorbed attention over rows 0..pos of
    the span (rows beyond pos hold large junk, and the dead splits' scratch garbage: masked, never mixed in)
    matches the same arithmetic in float64, whichever split kernel runs. The scores come from q in one f16 part
    on the tensor cores (the reference rounds q the same way) or from hi + lo parts (q_split: f32-level, against
    q unrounded), the weights in one f16 part (~1e-5 relative over a few hundred rows) or in two (p_split)."""
    (h, kvr, n_ctx, span, pos, rows_min, programs, bt), cut = MLA_CASES[case]
    monkeypatch.setattr(kernels, "MLA_ROWS_FORM_HEADS", form)
    monkeypatch.setattr(kernels, "MLA_ROWS_BH" if form else "MLA_BH", bh)
    monkeypatch.setattr(kernels, "_mla_split" if form else "_mla_split_rows", _NotLaunched())  # the other form
    monkeypatch.setattr(kernels, "MLA_ROWS_MIN", rows_min)
    monkeypatch.setattr(kernels, "MLA_PROGRAMS", programs)
    monkeypatch.setattr(kernels, "MLA_BT", bt)
    monkeypatch.setattr(kernels, "MLA_P_SPLIT", p_split)
    monkeypatch.setattr(kernels, "MLA_DECODE_Q_SPLIT", q_split)
    gen = torch.Generator().manual_seed(9 + gated + h)
    rope, nope, v = 64, 32, 32

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    q, kv, kv_norm = r(1, h, nope + rope, scale=3.0), r(1, kvr + rope), r(kvr).abs() + 0.5
    latent = r(n_ctx, kvr + rope).half()
    latent[pos + 1:] = 3000.0  # junk past pos: it must never reach the softmax
    before = latent.clone()
    wk_b, wv_b = r(h, kvr, nope, scale=0.2).half(), r(h, v, kvr, scale=0.2).half()
    gate = r(1, h * v) if gated else None
    real_empty = torch.empty

    def nan_empty(*a, **k):  # scratch as a GPU hands it out: garbage (here NaN) wherever nothing was written
        out = real_empty(*a, **k)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(kernels.torch, "empty", nan_empty)
    n_split = kernels.mla_splits(span, -(-h // kernels.mla_head_block(h)))
    rows = kernels.mla_rows_per(pos, n_split)
    assert (n_split, rows, pos // rows) == cut
    got = kernels.mla_decode(q, kv, kv_norm, latent, torch.tensor([pos]), span, wk_b, wv_b, gate, 0.1, 1e-6)
    row, o = _mla_reference(q, kv, kv_norm, latent, pos, wk_b, wv_b, gate, 0.1, q_parts=2 if q_split else 1)
    assert torch.equal(latent[pos], row.half())  # the row written, f16
    assert torch.equal(latent[:pos], before[:pos]) and torch.equal(latent[pos + 1:], before[pos + 1:])
    err = float((got.double().view(h, v) - o).norm() / o.norm())
    assert err < (2e-6 if p_split else HALF_F16_ULP), err


@pytest.mark.parametrize("q_split", [False, True])
@pytest.mark.parametrize("form,bh", SPLIT_FORMS[:2])
def test_mla_decode_scores_stay_finite_and_accurate_for_large_queries(kernels, monkeypatch, q_split, form, bh):
    """q far beyond f16's range (1e6) is scaled by a power of two per row before it becomes f16 (one part, or a hi
    + lo split): the result stays finite and as accurate as for small q (f16 unscaled would overflow to inf)."""
    monkeypatch.setattr(kernels, "MLA_DECODE_Q_SPLIT", q_split)
    monkeypatch.setattr(kernels, "MLA_ROWS_FORM_HEADS", form)
    monkeypatch.setattr(kernels, "MLA_ROWS_BH", bh)
    gen = torch.Generator().manual_seed(21)
    h, kvr, rope, nope, v, pos = 3, 64, 64, 32, 32, 90
    q = torch.randn(1, h, nope + rope, generator=gen) * 1e4
    kv, kv_norm = torch.randn(1, kvr + rope, generator=gen), torch.ones(kvr)
    latent = (torch.randn(256, kvr + rope, generator=gen) * 1e-2).half()
    wk_b = (torch.randn(h, kvr, nope, generator=gen) * 0.2).half()
    wv_b = (torch.randn(h, v, kvr, generator=gen) * 0.2).half()
    got = kernels.mla_decode(q, kv, kv_norm, latent, torch.tensor([pos]), 256, wk_b, wv_b, None, 1e-3, 1e-6)
    _, o = _mla_reference(q, kv, kv_norm, latent, pos, wk_b, wv_b, None, 1e-3, q_parts=2 if q_split else 1)
    assert torch.isfinite(got).all()
    assert float((got.double().view(h, v) - o).norm() / o.norm()) < HALF_F16_ULP


@pytest.mark.parametrize("q_split,p_split", [(False, False), (True, False), (False, True)])
def test_mla_attend_matches_the_torch_form_causally(kernels, monkeypatch, q_split, p_split):
    """The prefill's causal attention (kernels.mla_attend) of 70 tokens after 3000 cached rows, 3 heads (query
    rows of a block span tokens), against model.attend in float64: each token sees exactly the rows up to its
    own position (rows past the call's last one hold junk). q holds f16 values, as on the f16 targets (one f16
    part is exact then); q_split also takes q of full f32 precision."""
    from engines.sparkinfer.model import attend

    monkeypatch.setattr(kernels, "MLA_CAUSAL_Q_SPLIT", q_split)
    monkeypatch.setattr(kernels, "MLA_P_SPLIT", p_split)
    gen = torch.Generator().manual_seed(5 + q_split + 2 * p_split)
    h, kvr, rope, t, n_past = 3, 64, 64, 70, 3000
    latent = torch.randn(3200, kvr + rope, generator=gen).half()
    latent[n_past + t:] = 4000.0
    q_abs, q_pe = torch.randn(t, h, kvr, generator=gen) * 2, torch.randn(t, h, rope, generator=gen)
    if not q_split:
        q_abs, q_pe = q_abs.half().float(), q_pe.half().float()
    got = kernels.mla_attend(q_abs, q_pe, latent, n_past, 0.1)
    k = latent[:n_past + t].double()
    want = attend(torch.cat([q_abs, q_pe], -1).double(), k, k[:, :kvr], n_past, 0.1)
    assert got.shape == (t, h, kvr)
    err = float((got.double() - want).norm() / want.norm())
    assert err < (2e-6 if p_split else HALF_F16_ULP), err
    # the first token of a call from an empty cache sees row 0 alone: its output is that row, exactly
    first = kernels.mla_attend(q_abs[:2], q_pe[:2], latent, 0, 0.1)
    assert torch.equal(first[0], latent[0, :kvr].float().expand(h, -1))
    with pytest.raises(ValueError, match="does not hold 3190 \\+ 70 rows"):
        kernels.mla_attend(q_abs, q_pe, latent, 3190, 0.1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
@pytest.mark.parametrize("n_past", [0, 300])
def test_mla_sdpa_equals_the_absorbed_form(dtype, n_past):
    """The prefill's decompressed form (model.mla_sdpa: per-head keys kv wk_b | k_pe and values kv wv_b^T through
    torch's fused attention, the causal mask aligned to the call's last keys) computes the absorbed form's
    attention: to rounding in float64, and within f16 rounding (the keys and values rounded once) in f16."""
    from engines.sparkinfer.model import attend, mla_sdpa, mla_sdpa_weights

    gen = torch.Generator().manual_seed(17 + n_past)
    t, h, kvr, rope, nope, v = 48, 3, 64, 32, 32, 32
    lat = torch.randn(n_past + t, kvr + rope, generator=gen, dtype=torch.float64)
    wk, wv = (torch.randn(h, kvr, nope, generator=gen, dtype=torch.float64) * 0.2,
              torch.randn(h, v, kvr, generator=gen, dtype=torch.float64) * 0.2)
    qn, qp = torch.randn(t, h, nope, generator=gen, dtype=torch.float64), torch.randn(t, h, rope, generator=gen,
                                                                                      dtype=torch.float64)
    lw = {"attn_k_b": Mat(wk.to(dtype)), "attn_v_b": Mat(wv.to(dtype))}
    got = mla_sdpa(qn.to(dtype), qp.to(dtype), lat.to(dtype), *mla_sdpa_weights(lw), n_past, 0.1)
    q_abs = torch.einsum("thn,hcn->thc", qn, wk)
    want = torch.einsum("thc,hvc->thv", attend(torch.cat([q_abs, qp], -1), lat, lat[:, :kvr], n_past, 0.1), wv)
    assert got.shape == (t, h, v) and got.dtype == torch.float32
    err = float((got.double() - want).norm() / want.norm())
    assert err < (1e-6 if dtype == torch.float64 else 2e-3), err


def test_chunk_scan_matches_the_token_by_token_recurrence(kernels):
    """The prefill's chunked delta rule with the recurrence in one launch equals the token-by-token form
    (outputs and final state), and leaves the caller's initial state alone."""
    from engines.sparkinfer.model import delta_rule_chunked, delta_rule_recurrent, l2_norm

    gen = torch.Generator().manual_seed(12)
    t, h, hd, ch = 45, 2, 32, 16  # 3 chunks, the last one padded
    q = l2_norm(torch.randn(t, h, hd, generator=gen), 1e-6)
    k = l2_norm(torch.randn(t, h, hd, generator=gen), 1e-6)
    v = torch.randn(t, h, hd, generator=gen)
    g = -torch.rand(t, h, hd, generator=gen) * 0.5
    beta, s0 = torch.rand(t, h, generator=gen), torch.randn(h, hd, hd, generator=gen) * 0.1
    keep = s0.clone()
    o, s = delta_rule_chunked(q, k, v, g, beta, s0, 0.2, ch, kernels.chunk_scan)
    o_r, s_r = delta_rule_recurrent(q.double(), k.double(), v.double(), g.double(), beta.double(), s0.double(), 0.2)
    assert torch.equal(s0, keep)
    assert float((o.double() - o_r).norm() / o_r.norm()) < 1e-5
    assert float((s.double() - s_r).norm() / s_r.norm()) < 1e-5
    with pytest.raises(ValueError, match="powers of two >= 16"):
        kernels.chunk_scan(torch.zeros(1, h, 8, hd), torch.zeros(1, h, 8, hd), torch.zeros(1, h, 8, hd),
                           torch.zeros(1, h, hd), s0)


def test_grouped_mm_matches_per_group_products(kernels, monkeypatch):
    monkeypatch.setattr(kernels, "GMM_BM", 16)  # several tiles per group, one partial
    gen = torch.Generator().manual_seed(13)
    counts = [0, 37, 1, 0, 16]  # empty groups, a partial tile, an exact tile
    n_out, k = 40, 50
    x = torch.randn(sum(counts), k, generator=gen).half()
    w = (torch.randn(len(counts), n_out, k, generator=gen) * 0.2).half()
    got = kernels.grouped_mm(x, w, counts)
    parts, r = [], 0
    for g, cnt in enumerate(counts):
        parts.append(x[r:r + cnt].double() @ w[g].double().T)
        r += cnt
    want = torch.cat(parts)
    assert got.shape == (sum(counts), n_out)
    assert float((got.double() - want).norm() / want.norm()) < 1e-6
    with pytest.raises(ValueError, match="counts summing to 53"):
        kernels.grouped_mm(x, w, [0, 37, 1, 0, 15])


def test_every_kernel_compiles_for_sm90_without_a_gpu(tmp_path):
    """Triton's real compiler (to PTX and, through its bundled ptxas, sm_90 machine code) accepts every kernel
    at the GPU target's widths: the interpreter alone would not catch a kernel the compiler rejects."""
    import json
    import subprocess
    import sys

    from conftest import REPO

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    out = tmp_path / "compile.json"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "triton_compile.py"), "--preset", "k3-gpu", "--json",
                          str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["all_ok"] and len(res["kernels"]) >= 15
    assert all(k["reg"] > 0 for k in res["kernels"])  # ptxas allocated registers: machine code was made


def test_libcuda_is_found_in_the_process_s_own_mappings(kernels):
    maps = ("7f00-7f01 r-xp 00000000 fd:00 12 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
            "7f10-7f11 r-xp 00000000 fd:00 13 /usr/local/nvidia/lib64/libcuda.so.580.159.03\n"
            "7f30-7f31 rw-p 00000000 00:00 0 [heap]\n")  # the resolved file, as the kernel maps it
    assert kernels.libcuda_dir(maps) == "/usr/local/nvidia/lib64"
    assert kernels.libcuda_dir("7f00-7f01 r-xp 0 fd:00 1 /usr/lib/libc.so.6\n7f30-7f31 rw-p 0 00:00 0\n") is None
    assert kernels.libcuda_dir("7f00-7f01 r-xp 0 fd:00 1 /opt/x/libcudart.so.13\n") is None  # the runtime, not the driver


def test_mismatched_down_weights_are_refused(kernels):
    w_in = torch.zeros(4, 8, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="down weights"):
        kernels.decode_experts(torch.zeros(1, 16), torch.tensor([0]), torch.ones(1), w_in,
                               torch.zeros(4, 16, 5, dtype=torch.float16), 4.0, 25.0)


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    shards = generate("k3-mini", tmp_path_factory.mktemp("k3-mini"))
    cfg = load_k3_config(shards[0])
    return cfg, load_weights(cfg, tuple(cfg.shards), "cpu", torch.float16)[0]


@pytest.mark.parametrize("prefill_form", ["sdpa", "triton"])
def test_static_decode_with_kernels_matches_torch_form(kernels, mini, monkeypatch, prefill_form):
    """The model's own decode step (graph.StaticDecoder, the step a CUDA graph records) with the kernels
    enabled, after a prefill through each form of its MLA attention, gives the torch form's greedy tokens, and
    logits within f16-level rounding. (Wider blocks than on the GPU: the interpreter runs one program at a time,
    so fewer, wider programs keep this test short.)"""
    import engines.sparkinfer.model as model_mod

    for name, width in (("BLOCK_F", 128), ("BLOCK_L", 64)):
        monkeypatch.setattr(kernels, name, width)
    monkeypatch.setattr(kernels, "vec_blocks", lambda n, k: (128, 512, 4))
    monkeypatch.setattr(model_mod, "MLA_PREFILL_FORMS", (prefill_form,))
    cfg, w = mini
    torch.manual_seed(0)
    ids = torch.randint(0, 510, (40,), generator=torch.Generator().manual_seed(5))
    runs = {}
    for use in (False, True):
        model = K3Model(cfg, w)
        if use:
            note = model.enable_kernels()
            assert note.startswith("triton") and f"mla prefill {prefill_form}" in note, note
            assert model.use_kernels and model.mla_prefill == prefill_form
        dec = StaticDecoder(model, 256, capture=False)
        cache = dec.reset(len(ids) + 3)
        from engines.sparkinfer.engine import prefill

        first = prefill(model, cache, ids, 512, [len(ids) - 1]).argmax(-1)
        dec.check()
        toks = dec.run(first, 3)[0]
        runs[use] = (toks, dec.logits.clone())
    assert runs[True][0] == runs[False][0]
    a, b = runs[True][1], runs[False][1]
    assert float((a - b).norm() / b.norm()) < 1e-2


def test_a_kernel_that_fails_on_the_box_leaves_the_torch_form(kernels, mini, monkeypatch):
    """A compile or launch failure (a box whose Triton cannot build) and a kernel that disagrees with its torch
    form both keep every path on torch, and the note (the identity's `kernels`) says which and why."""
    cfg, w = mini

    def broken(*a, **k):
        raise RuntimeError("ptxas died")

    monkeypatch.setattr(kernels, "situ_vec", broken)
    model = K3Model(cfg, w)
    note = model.enable_kernels()
    assert not model.use_kernels and note == "torch: a Triton kernel failed here (RuntimeError: ptxas died)"
    monkeypatch.undo()
    real = kernels.res_mix
    monkeypatch.setattr(kernels, "res_mix", lambda *a, **k: real(*a, **k) * 1.1)  # 10% off: a wrong kernel
    model = K3Model(cfg, w)
    note = model.enable_kernels()
    assert not model.use_kernels and note.startswith("torch: the Triton kernels disagreed with the torch form")
    assert "res_mix" in note


def test_a_box_without_fused_attention_prefills_through_the_triton_kernel(kernels, mini, monkeypatch):
    """Where torch's fused attention takes no part of the decompressed form (it raises), the prefill's MLA
    attention is the Triton kernel, and the note says so."""
    import engines.sparkinfer.model as model_mod

    def no_kernel(*a, **k):
        raise RuntimeError("No available kernel. Aborting execution.")

    monkeypatch.setattr(model_mod, "mla_sdpa", no_kernel)
    cfg, w = mini
    model = K3Model(cfg, w)
    note = model.enable_kernels()
    assert model.use_kernels and model.mla_prefill == "triton"
    assert "mla prefill triton" in note and "sdpa" not in note


def test_kernels_are_not_enabled_for_weights_they_do_not_fit(kernels, mini, tmp_path):
    """float32 experts (the CPU targets' dtype) stay on the torch form, and the note says why."""
    cfg, _ = mini
    w32 = load_weights(cfg, tuple(cfg.shards), "cpu", torch.float32)[0]
    moe = w32.layers[cfg.n_layer_dense_lead]
    assert _kernel_mats(moe) is None
    model = K3Model(cfg, w32)
    note = model.enable_kernels()
    assert note.startswith("torch:") and not model.use_kernels
