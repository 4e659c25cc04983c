"""MLA's attention kernels at depth, alone: `kernels.mla_decode` (one token over a span of latent rows) and
`kernels.mla_attend` (a prefill call's causal attention) on random inputs at a preset's widths, timed against the
torch form they replace (and, for decode, the mla_decode of another copy of kernels.py, e.g. main's) and over a
few of their constants. A diagnosis of two kernels, not a model and not a round: no gate ran on it.

Per decode span (the CUDA graph's power of two) and position: device microseconds per call (a CUDA graph of
`--launches` calls, replayed between CUDA events), the latent bytes it must read ((pos + 1) x (kvr + rope) x 2)
over that time, and the relative difference from a float64 reference. Per prefill call of `--chunk` tokens after
n_past cached rows (the first, middle and last call of a `--prefill`-token prefill): the same, the FLOPs of the
causal half, and an estimate of the whole prefill's attention per MLA layer (the calls' times interpolated over
n_past: each call's work grows linearly with it). Also torch's scaled_dot_product_attention over the decompressed
per-head k (nope + rope) and v, in f16 with a lower-right causal mask: the backend it ran and its time.

    python bench/mla_depth.py --preset k3-gpu --baseline /path/to/old/kernels.py --out mla.json
    TRITON_INTERPRET=1 python bench/mla_depth.py --device cpu --quick      # plumbing only (interpreter timings)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engines.sparkinfer import kernels as K  # noqa: E402
from engines.sparkinfer.model import Mat, attend, mla_sdpa, mla_sdpa_weights  # noqa: E402
from scoreboard.weights.presets import get_spec  # noqa: E402

SPANS = (2048, 16384, 65536, 131072, 262144)
QUICK_SPANS = (256, 1024)
BASELINE_SPAN_MAX = 65536  # the old combine loads every split's partials at once: past this it spills without end
# (heads per program, MLA_BT, split warps, split stages, MLA_PROGRAMS[, form]) timed at the largest span; form 0 (the
# default) is _mla_split, whose heads per program are MLA_BH; 1 is the rows form, _mla_split_rows, at MLA_ROWS_BH
# (kernels.MLA_ROWS_FORM_HEADS = 1 turns it on for any head count)
DECODE_GRID = [(16, 32, 4, 3, 264), (16, 32, 4, 2, 264), (16, 32, 4, 4, 264), (16, 64, 4, 3, 264), (16, 64, 4, 2, 264),
               (16, 64, 8, 3, 264), (16, 64, 8, 2, 264), (16, 128, 8, 2, 264), (32, 32, 4, 3, 264), (32, 64, 8, 2, 264),
               (64, 32, 8, 2, 264), (64, 64, 8, 2, 264), (16, 32, 4, 3, 132), (16, 64, 4, 3, 528),
               (32, 64, 8, 2, 264, 1), (16, 64, 8, 2, 264, 1), (64, 64, 8, 2, 264, 1), (32, 64, 16, 2, 264, 1),
               (32, 64, 8, 3, 264, 1), (32, 64, 8, 2, 132, 1)]
# (MLA_BM, MLA_CAUSAL_BT, warps, stages, MLA_CAUSAL_Q_SPLIT) timed at the middle call
PREFILL_GRID = [(32, 64, 8, 3, False), (32, 64, 4, 3, False), (32, 128, 8, 2, False), (16, 64, 4, 3, False),
                (16, 64, 8, 3, False), (64, 64, 8, 2, False), (32, 64, 8, 2, False), (32, 64, 8, 4, False),
                (64, 32, 4, 2, False), (16, 128, 4, 2, False)]


def device_us(fn: Callable[[], Any], cuda: bool, launches: int, replays: int = 3) -> float:
    """Device microseconds per call of fn: a CUDA graph of `launches` calls replayed between events (cuda), else
    the wall time of one call (the interpreter: plumbing only)."""
    if not cuda:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(launches):
            fn()
    g.replay()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / launches)
    return best


def with_constants(mod: ModuleType, values: dict[str, Any], fn: Callable[[], Any]) -> Any:
    """fn() with module constants set (an entry of a dict constant as "WARPS.name"), restored afterwards."""
    saved: dict[str, Any] = {}
    for name, value in values.items():
        table, _, key = name.partition(".")
        if key:
            saved[name] = getattr(mod, table)[key]
            getattr(mod, table)[key] = value
        else:
            saved[name] = getattr(mod, name)
            setattr(mod, name, value)
    try:
        return fn()
    finally:
        for name, value in saved.items():
            table, _, key = name.partition(".")
            if key:
                getattr(mod, table)[key] = value
            else:
                setattr(mod, name, value)


def load_module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("baseline_kernels", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--baseline {path}: not a Python file")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


class Decode:
    """One MLA layer's decode inputs at a preset's widths: q, kv, the absorption matrices, a latent cache."""

    def __init__(self, w: dict[str, int], n_ctx: int, dev: str):
        gen = torch.Generator().manual_seed(1)
        h, kvr, rope, nope, v = w["h"], w["kvr"], w["rope"], w["nope"], w["v"]

        def r(*shape: int, s: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) * s).to(dev)

        self.h, self.kvr, self.rope, self.nope, self.v = h, kvr, rope, nope, v
        self.q, self.kv, self.norm = r(1, h, nope + rope), r(1, kvr + rope), r(kvr).abs() + 0.5
        self.latent = r(n_ctx, kvr + rope, s=0.5).half()
        self.wk_b, self.wv_b = r(h, kvr, nope, s=0.1).half(), r(h, v, kvr, s=0.1).half()
        self.gate = r(1, h * v)
        self.scale = 1.0 / math.sqrt(nope + rope)

    def call(self, mod: ModuleType, pos: torch.Tensor, span: int) -> Callable[[], torch.Tensor]:
        return lambda: mod.mla_decode(self.q, self.kv, self.norm, self.latent, pos, span, self.wk_b, self.wv_b,
                                      self.gate, self.scale, 1e-6)

    def torch_form(self, pos: torch.Tensor, span: int) -> Callable[[], torch.Tensor]:
        """The static step's torch form (model._mla): q absorbed in f16, f32 attention over the span, masked."""
        def run() -> torch.Tensor:
            q = self.q
            qn = q[0, :, :self.nope].half()[:, None]  # [H, 1, nope]
            q_abs = torch.bmm(qn, self.wk_b.transpose(1, 2)).float().transpose(0, 1)  # [1, H, kvr]
            k_all = self.latent[:span].float()
            o_lat = attend(torch.cat([q_abs, q[:, :, self.nope:]], -1), k_all, k_all[:, :self.kvr], pos, self.scale)
            o = torch.bmm(o_lat.half().transpose(0, 1), self.wv_b.transpose(1, 2)).float().transpose(0, 1)
            return o.reshape(1, -1) * torch.sigmoid(self.gate)
        return run


def decode_rows(d: Decode, spans: tuple[int, ...], cuda: bool, launches: int, base: ModuleType | None) -> list[dict]:
    """mla_decode per span at two positions (the middle, past a split's start, and near the end), against the
    torch form, the baseline module, and a float64 check at each span's last position."""
    out = []
    row_bytes = (d.kvr + d.rope) * 2
    for span in spans:
        for pos in (span // 2 + 37, span - 100):
            p = torch.tensor([pos], device=d.latent.device)
            rec: dict[str, Any] = {"span": span, "pos": pos, "latent_mb": round((pos + 1) * row_bytes / 1e6, 2)}
            rec["us"] = round(device_us(d.call(K, p, span), cuda, launches), 2)
            rec["gb_s"] = round((pos + 1) * row_bytes / rec["us"] / 1e3, 1)
            rec["torch_form_us"] = round(device_us(d.torch_form(p, span), cuda, max(1, launches // 4)), 2)
            if base is not None and span <= BASELINE_SPAN_MAX:
                rec["baseline_us"] = round(device_us(d.call(base, p, span), cuda, launches), 2)
            got = d.call(K, p, span)()
            rec["rel_vs_torch_form"] = rel(got, d.torch_form(p, span)())
            out.append(rec)
            print(json.dumps(rec), flush=True)
    return out


def decode_grid(d: Decode, span: int, cuda: bool, launches: int,
                grid: list[tuple[int, ...]] | None = None) -> list[dict]:
    pos = torch.tensor([span - 100], device=d.latent.device)
    want = d.call(K, pos, span)()
    out = []
    for bh, bt, warps, stages, programs, *form in grid or DECODE_GRID:
        rows = bool(form and form[0])
        name = "mla_split_rows" if rows else "mla_split"
        consts = {"MLA_ROWS_FORM_HEADS": int(rows), "MLA_ROWS_BH" if rows else "MLA_BH": bh, "MLA_BT": bt,
                  f"WARPS.{name}": warps, f"STAGES.{name}": stages, "MLA_PROGRAMS": programs}
        try:
            us = with_constants(K, consts, lambda: device_us(d.call(K, pos, span), cuda, launches))
            diff = with_constants(K, consts, lambda: rel(d.call(K, pos, span)(), want))
            rec = {**consts, "span": span, "us": round(us, 2), "rel_vs_default": diff}
        except Exception as exc:  # noqa: BLE001 - a variant that does not compile is a result too
            rec = {**consts, "span": span, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        out.append(rec)
        print(json.dumps(rec), flush=True)
    return out


class Prefill:
    """One MLA layer's prefill call of `chunk` tokens after n_past cached rows: q_nope, q_pe (f16 values, as the
    f16 targets' products give), q_abs as model._mla makes it (an f16 product with wk_b), a latent cache; each
    form returns the layer's attention output [T, H, v] (through wv_b), as model.K3Model._mla_prefill does."""

    def __init__(self, w: dict[str, int], chunk: int, n_ctx: int, dev: str):
        gen = torch.Generator().manual_seed(2)
        self.w, self.chunk = w, chunk
        h, kvr, rope, nope = w["h"], w["kvr"], w["rope"], w["nope"]
        self.q_nope = torch.randn(chunk, h, nope, generator=gen).to(dev).half()
        self.q_pe = torch.randn(chunk, h, rope, generator=gen).to(dev).half().float()
        self.latent = (torch.randn(n_ctx, kvr + rope, generator=gen) * 0.5).to(dev).half()
        self.wk_b = (torch.randn(h, kvr, nope, generator=gen) * 0.05).to(dev).half()
        self.wv_b = (torch.randn(h, w["v"], kvr, generator=gen) * 0.05).to(dev).half()
        self.q_abs = torch.bmm(self.q_nope.transpose(0, 1), self.wk_b.transpose(1, 2)).float().transpose(0, 1)
        self.lw = {"attn_k_b": Mat(self.wk_b), "attn_v_b": Mat(self.wv_b)}
        self.scale = 1.0 / math.sqrt(nope + rope)

    def _out(self, o_lat: torch.Tensor) -> torch.Tensor:
        return torch.bmm(o_lat.half().transpose(0, 1), self.wv_b.transpose(1, 2)).float().transpose(0, 1)

    def kernel(self, n_past: int) -> Callable[[], torch.Tensor]:
        return lambda: self._out(K.mla_attend(self.q_abs, self.q_pe, self.latent, n_past, self.scale))

    def attend_only(self, n_past: int) -> Callable[[], torch.Tensor]:
        return lambda: K.mla_attend(self.q_abs, self.q_pe, self.latent, n_past, self.scale)

    def torch_form(self, n_past: int) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            k_all = self.latent[:n_past + self.chunk].float()
            return self._out(attend(torch.cat([self.q_abs, self.q_pe], -1), k_all, k_all[:, :self.w["kvr"]], n_past,
                                    self.scale))
        return run

    def sdpa(self, n_past: int) -> Callable[[], torch.Tensor]:
        """model.mla_sdpa: the decompressed form through torch's fused attention (decompression included)."""
        wk, wv = mla_sdpa_weights(self.lw)
        lat = self.latent[:n_past + self.chunk]
        return lambda: mla_sdpa(self.q_nope, self.q_pe, lat, wk, wv, n_past, self.scale)

    def reference(self, n_past: int) -> torch.Tensor:
        """The absorbed attention in float64 from the same f16 inputs (q_nope through wk_b unrounded)."""
        lat = self.latent[:n_past + self.chunk].double()
        q_abs = torch.einsum("thn,hcn->thc", self.q_nope.double(), self.wk_b.double())
        o_lat = attend(torch.cat([q_abs, self.q_pe.double()], -1), lat, lat[:, :self.w["kvr"]], n_past, self.scale)
        return torch.einsum("thc,hvc->thv", o_lat, self.wv_b.double())


def kernel_names(fn: Callable[[], Any], cuda: bool, top: int = 4) -> list[str]:
    """The CUDA kernels one call of fn spends most time in (which fused attention backend ran)."""
    if not cuda:
        return []
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    evs = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [f"{e.key[:80]} {e.self_device_time_total:.0f}us" for e in sorted(evs, key=lambda e: -e.self_device_time_total)[:top]]


def prefill_rows(pf: Prefill, total: int, cuda: bool, grid: bool) -> dict:
    w, t = pf.w, pf.chunk
    calls = sorted({0, (total // t // 2) * t - t, total - t})
    rows = []
    flops_pair = 2 * (w["kvr"] + w["rope"] + w["kvr"])  # scores over kvr + rope, the weighted sum over kvr
    for n_past in calls:
        keys = n_past * t + t * (t + 1) / 2  # (query, key) pairs on or below the diagonal
        rec: dict[str, Any] = {"n_past": n_past, "tflop": round(keys * w["h"] * flops_pair / 1e12, 3)}
        rec["us"] = round(device_us(pf.attend_only(n_past), cuda, 2), 1)
        rec["tflop_s"] = round(rec["tflop"] / rec["us"] * 1e6, 1)
        rec["sdpa_us"] = round(device_us(pf.sdpa(n_past), cuda, 2), 1)
        if n_past == calls[-1] or not cuda:
            rec["torch_form_us"] = round(device_us(pf.torch_form(n_past), cuda, 1), 1)
            want = pf.reference(n_past)
            rec["rel_vs_float64"] = {name: rel(fn(n_past)(), want) for name, fn in
                                     (("triton", pf.kernel), ("sdpa", pf.sdpa), ("torch_form", pf.torch_form))}
            rec["sdpa_kernels"] = kernel_names(pf.sdpa(n_past), cuda)
        rows.append(rec)
        print(json.dumps(rec), flush=True)
    out: dict[str, Any] = {"chunk": t, "calls": rows, "prefill_tokens": total}
    for key in ("us", "sdpa_us"):  # each call's time is linear in n_past: interpolated over the prefill's calls
        (x0, y0), (x1, y1) = (rows[0]["n_past"], rows[0][key]), (rows[-1]["n_past"], rows[-1][key])
        slope = (y1 - y0) / max(x1 - x0, 1)
        out[f"{key.removesuffix('us')}attention_ms_per_layer"] = round(
            sum(y0 + slope * (n - x0) for n in range(0, total, t)) / 1e3, 2)
    if grid:
        mid = calls[len(calls) // 2]
        want = pf.attend_only(mid)()
        out["grid"] = []
        for bm, bt, warps, stages, q_split in PREFILL_GRID:
            consts = {"MLA_BM": bm, "MLA_CAUSAL_BT": bt, "WARPS.mla_causal": warps, "STAGES.mla_causal": stages,
                      "MLA_CAUSAL_Q_SPLIT": q_split}
            try:
                us = with_constants(K, consts, lambda: device_us(pf.attend_only(mid), cuda, 2))
                rec = {**consts, "n_past": mid, "us": round(us, 1),
                       "rel_vs_default": with_constants(K, consts, lambda: rel(pf.attend_only(mid)(), want))}
            except Exception as exc:  # noqa: BLE001
                rec = {**consts, "n_past": mid, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            out["grid"].append(rec)
            print(json.dumps(rec), flush=True)
    return out


def widths(preset: str) -> dict[str, int]:
    c = get_spec(preset).config()
    return {"h": c.n_head, "kvr": c.kv_lora_rank, "rope": c.rope_dim, "nope": c.qk_nope_dim, "v": c.value_length_mla}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", action="append", help="widths of this generated preset (repeatable; k3-gpu)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--baseline", type=Path, help="another kernels.py whose mla_decode to time beside this one")
    ap.add_argument("--launches", type=int, default=20)
    ap.add_argument("--prefill", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--no-grid", action="store_true", help="skip the sweeps over the kernels' constants")
    ap.add_argument("--quick", action="store_true", help="small spans and a short prefill (the interpreter)")
    ap.add_argument("--spans", help="decode spans, comma-separated (default: %s)" % ",".join(map(str, SPANS)))
    ap.add_argument("--decode-grid", help="the decode grid as 'BH,BT,WARPS,STAGES,PROGRAMS[,FORM];...' (default: DECODE_GRID; FORM 1: rows)")
    ap.add_argument("--no-prefill", action="store_true", help="decode only")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    spans = QUICK_SPANS if args.quick else SPANS
    grid = None
    try:
        if args.spans:
            spans = tuple(int(x) for x in args.spans.split(","))
        if args.decode_grid:
            grid = [tuple(int(x) for x in row.split(",")) for row in args.decode_grid.split(";")]
            if any(len(row) not in (5, 6) for row in grid):
                raise ValueError("each row needs five numbers, and a sixth for the rows form (1)")
    except ValueError as exc:
        ap.error(f"--spans / --decode-grid: {exc} (e.g. --spans 131072 --decode-grid '16,64,4,2,264;32,64,8,2,264,1')")
    total, chunk = (256, 128) if args.quick else (args.prefill, args.chunk)
    base = load_module(args.baseline) if args.baseline else None
    res: dict[str, Any] = {"gpu": torch.cuda.get_device_name() if cuda else "none", "torch": torch.__version__,
                           "triton": K.triton.__version__, "presets": {}}
    t_start = time.perf_counter()
    for preset in args.preset or ["k3-gpu"]:
        w = widths(preset)
        if args.quick:
            w["h"] = min(w["h"], 3)
        with torch.inference_mode():
            d = Decode(w, max(spans), args.device)
            rec: dict[str, Any] = {"widths": w, "decode": decode_rows(d, spans, cuda, args.launches, base)}
            if not args.no_grid:
                rec["decode_grid"] = decode_grid(d, max(spans), cuda, args.launches, grid)
            del d
            if not args.no_prefill:
                pf = Prefill(w, chunk, total, args.device)
                rec["prefill"] = prefill_rows(pf, total, cuda, not args.no_grid)
                del pf
        res["presets"][preset] = rec
        if cuda:
            torch.cuda.empty_cache()
    res["script_s"] = round(time.perf_counter() - t_start, 1)
    text = json.dumps(res, indent=1)
    if args.out:
        args.out.write_text(text)
    print(json.dumps({k: res[k] for k in ("gpu", "torch", "triton", "script_s")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
