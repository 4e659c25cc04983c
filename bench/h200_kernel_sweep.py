"""The tiles of sparkinfer's decode products, measured: every product and routed-experts launch one decoded token
makes, re-timed at each tile and warp count of a sweep, against the tiles the engine uses now and torch's own
product (cuBLAS). A diagnosis to pick tiles from, not a round: no gate ran on it.

The profile at c1b1c3a (bench/results-h200-2026-12-01-session5) put k3-gpu's graph decode at 1.04 ms for 167
kernels, 21% of the bandwidth ceiling: the kernels' own latency binds, and a batch-1 product's latency is its
bytes in flight (rows per program x reduction step x programs). This measures, per recorded call:
- `_linear_vec` at rows per program BN x reduction step BK x warps, and F.linear on the f16 activation;
- `decode_experts`, one launch's tiles at a time: gate|up columns per program BLOCK_F x latent step BLOCK_K, then
  down rows per program BLOCK_L x F step BLOCK_KD, and both launches at their best together;
each as the device time of one launch inside a CUDA graph of `--graph-launches` launches (replayed, timed with
CUDA events: no launch or Python cost), its achieved GB/s over the weight bytes it reads, and its output's
largest relative difference from the current tiles' output (a tile changes the f32 summation order only).
The summary adds, over one token's calls, what the best tiles would save per token.

    python bench/h200_kernel_sweep.py --target k3-gpu-h200 --out sweep.json
    TRITON_INTERPRET=1 python bench/h200_kernel_sweep.py --target k3-mini-cpu --device cpu --quick   # plumbing
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path
from typing import Any, Callable

import torch

from engines.sparkinfer.engine import SparkInferEngine
from scoreboard.engine import EngineTarget, Geometry
from scoreboard.lockfile import load_lock
from scoreboard.weights.verify import ensure_generated

LINEAR_TILES = {"BN": (2, 4, 8, 16, 32), "BK": (128, 256, 512, 1024), "warps": (2, 4, 8)}
# the routed experts' two launches, swept one at a time (the other at its current tiles): gate|up + situ over
# (columns per program, reduction step over the latent), then down + the weighted sum over (rows per program,
# reduction step over F)
EXPERT_TILES = ({"BLOCK_F": (16, 32, 64), "BLOCK_K": (64, 128, 256, 512)},
                {"BLOCK_L": (2, 4, 8, 16, 32), "BLOCK_KD": (128, 256, 512, 1024)})
# the one-token products the torch form still runs on cuBLAS (above VEC_MAX_ELEMENTS, or not linear_vec's case),
# timed on linear_vec too: whether the cap should move
LARGE_TILES = {"BN": (8, 16, 32), "BK": (512, 1024), "warps": (4, 8)}
QUICK_LINEAR = {"BN": (4, 16), "BK": (512,), "warps": (4,)}
QUICK_EXPERTS = ({"BLOCK_F": (32,), "BLOCK_K": (128,)}, {"BLOCK_L": (8, 16), "BLOCK_KD": (128,)})


def record_calls(model: Any, kernels: Any) -> tuple[list[dict], list[dict], list[dict]]:
    """One decoded token after a 32-token prefill, with kernels.linear_vec, kernels.decode_experts and the torch
    form's product (model.linear: the products above VEC_MAX_ELEMENTS, on cuBLAS) wrapped: each distinct call
    kept once (its arguments cloned) with how many times the token made it."""
    import engines.sparkinfer.model as mod

    lin: dict[tuple, dict] = {}
    exp: dict[tuple, dict] = {}
    big: dict[tuple, dict] = {}
    orig_lin, orig_exp, orig_big = kernels.linear_vec, kernels.decode_experts, mod.linear

    def rec_big(x, m):
        w = m.w
        if x.reshape(-1, x.shape[-1]).shape[0] == 1 and w.dim() == 2 and w.dtype in (torch.float16, torch.bfloat16):
            key = (tuple(w.shape), w.data_ptr())
            if key not in big:
                big[key] = {"x": x.detach().reshape(1, -1).float().clone(), "w": w, "norm": None, "eps": 0.0,
                            "add": None, "count": 0}
            big[key]["count"] += 1
        return orig_big(x, m)

    def rec_lin(x, w, norm=None, eps=0.0, add=None):
        key = (tuple(w.shape), w.data_ptr(), norm is not None, add is not None)
        if key not in lin:
            lin[key] = {"x": x.detach().clone(), "w": w, "norm": None if norm is None else norm.detach().clone(),
                        "eps": eps, "add": None if add is None else add.detach().clone(), "count": 0}
        lin[key]["count"] += 1
        return orig_lin(x, w, norm, eps, add)

    def rec_exp(xin, sel, wts, w_in, w_down, beta, linear_beta):
        key = (tuple(w_in.shape), w_in.data_ptr())
        if key not in exp:
            exp[key] = {"args": (xin.detach().clone(), sel.detach().clone(), wts.detach().clone(), w_in, w_down, beta,
                                 linear_beta), "count": 0}
        exp[key]["count"] += 1
        return orig_exp(xin, sel, wts, w_in, w_down, beta, linear_beta)

    kernels.linear_vec, kernels.decode_experts, mod.linear = rec_lin, rec_exp, rec_big
    try:
        dev = model.device
        ids = torch.randint(0, model.cfg.n_vocab, (32,), generator=torch.Generator().manual_seed(3)).to(dev)
        cache = model.new_cache(64)
        first = model.forward(ids, cache, torch.tensor([31], device=dev))
        for d in (lin, exp, big):
            d.clear()  # the prefill's calls are not one token's
        model.forward(first.argmax(-1), cache, torch.zeros(1, dtype=torch.long, device=dev))
    finally:
        kernels.linear_vec, kernels.decode_experts, mod.linear = orig_lin, orig_exp, orig_big
    return list(lin.values()), list(exp.values()), list(big.values())


def device_us(fn: Callable[[], Any], cuda: bool, launches: int, replays: int) -> float:
    """Device microseconds per call of fn: a CUDA graph of `launches` calls replayed `replays` times between
    events (cuda), or the wall time of `launches` calls (cpu: the interpreter, plumbing only)."""
    if not cuda:
        t0 = time.perf_counter()
        for _ in range(launches):
            fn()
        return (time.perf_counter() - t0) * 1e6 / launches
    fn()  # compiled before capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for _ in range(launches):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * launches)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def sweep_linear(kernels: Any, call: dict, tiles: dict, cuda: bool, launches: int, replays: int) -> dict:
    x, w, norm, eps, add = call["x"], call["w"], call["norm"], call["eps"], call["add"]
    n, k = w.shape
    xv = x.reshape(-1).float().contiguous()
    nv = None if norm is None else norm.reshape(-1).float().contiguous()
    av = None if add is None else add.reshape(-1).float().contiguous()
    want = kernels.linear_vec(x, w, norm, eps, add)
    gbytes = w.numel() * w.element_size() / 1e9
    cur_bn, cur_bk, cur_warps = kernels.vec_blocks(n, k)

    def at(bn: int, bk: int, warps: int) -> Callable[[], torch.Tensor]:
        out = torch.empty(1, n, dtype=torch.float32, device=x.device)

        def run() -> torch.Tensor:
            kernels._linear_vec[(kernels.triton.cdiv(n, bn),)](
                xv, w, out, out if nv is None else nv, out if av is None else av, n, k, eps, HAS_NORM=nv is not None,
                HAS_ADD=av is not None, BN=bn, BK=bk, num_warps=warps)
            return out
        return run

    rows = []
    for bn, bk, warps in itertools.product(tiles["BN"], tiles["BK"], tiles["warps"]):
        fn = at(bn, bk, warps)
        try:
            us = device_us(fn, cuda, launches, replays)
            err = rel(fn(), want)
        except Exception as exc:  # a tile that does not compile or launch here
            rows.append({"BN": bn, "BK": bk, "warps": warps, "error": f"{type(exc).__name__}: {exc}"[:200]})
            continue
        rows.append({"BN": bn, "BK": bk, "warps": warps, "us": round(us, 3), "gbs": round(gbytes / (us * 1e-6), 1),
                     "max_rel_diff": err})
    cur = device_us(at(cur_bn, cur_bk, cur_warps), cuda, launches, replays)
    xh = xv.to(w.dtype).reshape(1, -1)
    torch_us = device_us(lambda: torch.nn.functional.linear(xh, w), cuda, launches, replays)
    ok = [r for r in rows if "us" in r]
    best = min(ok, key=lambda r: r["us"]) if ok else None
    return {"shape": [n, k], "dtype": str(w.dtype).removeprefix("torch."), "norm": nv is not None, "add": av is not None,
            "count": call["count"], "current": {"BN": cur_bn, "BK": cur_bk, "warps": cur_warps, "us": round(cur, 3),
                                                "gbs": round(gbytes / (cur * 1e-6), 1)},
            "best": best, "torch_f16_us": round(torch_us, 3), "tiles": rows}


def sweep_experts(kernels: Any, call: dict, tiles: tuple[dict, ...], cuda: bool, launches: int, replays: int) -> dict:
    xin, sel, wts, w_in, w_down, beta, lb = call["args"]
    k = int(sel.shape[0])
    gbytes = k * (w_in[0].numel() * w_in.element_size() + w_down[0].numel() * w_down.element_size()) / 1e9
    names = [n for axis in tiles for n in axis]
    saved = {n: getattr(kernels, n) for n in names}
    want = kernels.decode_experts(*call["args"])

    def run() -> torch.Tensor:
        return kernels.decode_experts(*call["args"])

    rows: list[dict[str, Any]] = []
    best: dict[str, Any] = dict(saved)
    try:
        cur = device_us(run, cuda, launches, replays)
        for axis in tiles:  # one launch's tiles at a time, the other launch at its current tiles
            axis_rows = []
            for vals in itertools.product(*axis.values()):
                for n, v in saved.items():
                    setattr(kernels, n, v)
                for n, v in zip(axis, vals):
                    setattr(kernels, n, v)
                row: dict[str, Any] = {n: getattr(kernels, n) for n in names}
                try:
                    us = device_us(run, cuda, launches, replays)
                    row.update(us=round(us, 3), gbs=round(gbytes / (us * 1e-6), 1), max_rel_diff=rel(run(), want))
                    axis_rows.append(row)
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {exc}"[:200]
                rows.append(row)
            if axis_rows:
                top = min(axis_rows, key=lambda r: r["us"])
                best.update({n: top[n] for n in axis})
        for n, v in best.items():  # both launches at their best tiles together
            setattr(kernels, n, v)
        both = device_us(run, cuda, launches, replays)
        best_row = {**best, "us": round(both, 3), "gbs": round(gbytes / (both * 1e-6), 1), "max_rel_diff": rel(run(), want)}
    finally:
        for n, v in saved.items():
            setattr(kernels, n, v)
    return {"experts": k, "gate_up": list(w_in.shape[1:]), "down": list(w_down.shape[1:]), "count": call["count"],
            "current": {**saved, "us": round(cur, 3), "gbs": round(gbytes / (cur * 1e-6), 1)},
            "best": best_row, "tiles": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="k3-gpu-h200")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="two tiles each (the plumbing, on CPU)")
    ap.add_argument("--graph-launches", type=int, default=20)
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    cuda = args.device == "cuda"
    lock = load_lock(Path("reference.lock"))
    t = lock.target(args.target)  # an unknown target: an input error naming the lock's targets
    shards = ensure_generated(lock, t.weights)
    opts = {k: v for k, v in (t.candidate_options or {}).items() if cuda or k != "cuda_graph"}
    if not cuda:
        opts["dtype"] = "float16"  # the GPU targets' dtype: the kernels' f16 paths
    geom = Geometry(n_ctx=256, n_batch=64, n_ubatch=64, n_threads=1)
    engine = SparkInferEngine()
    prep = engine.prepare(EngineTarget(args.target, shards[0], tuple(shards), args.device, geom, options=opts),
                          Path("unused"))
    model = prep.handle.model
    from engines.sparkinfer import kernels

    if not cuda:
        model.use_kernels = True  # the interpreter: no self-check on CPU, the plumbing only
    if not model.use_kernels:
        print(json.dumps({"target": args.target, "kernels": prep.identity.extra.get("kernels"),
                          "error": "the engine chose the torch form: nothing to sweep"}))
        return 1
    lin_calls, exp_calls, big_calls = record_calls(model, kernels)
    lt, et, bt = (QUICK_LINEAR, QUICK_EXPERTS, QUICK_LINEAR) if args.quick else (LINEAR_TILES, EXPERT_TILES,
                                                                                LARGE_TILES)
    if args.quick:
        lin_calls, exp_calls, big_calls = lin_calls[:2], exp_calls[:1], big_calls[:1]
    launches, replays = (2, 1) if not cuda else (args.graph_launches, args.replays)
    res: dict[str, Any] = {"target": args.target, "gpu": torch.cuda.get_device_name() if cuda else "none",
                           "torch": torch.__version__, "triton": kernels.triton.__version__,
                           "kernels": prep.identity.extra.get("kernels"), "graph_launches": launches, "replays": replays}
    for key, calls, sweep, tiles in (("linear", lin_calls, sweep_linear, lt), ("experts", exp_calls, sweep_experts, et),
                                     ("large", big_calls, sweep_linear, bt)):
        res[key] = []
        for i, c in enumerate(calls):
            r = sweep(kernels, c, tiles, cuda, launches, replays)
            res[key].append(r)
            print(f"[{time.perf_counter() - t_start:6.1f} s] {key} {i + 1}/{len(calls)} {r.get('shape', r.get('gate_up'))} "
                  f"x{r['count']}: now {r['current']['us']} us, best {r['best'] and r['best']['us']} us, "
                  f"torch {r.get('torch_f16_us', '-')} us", flush=True)
    res["large_per_token_us"] = {"torch": round(sum(r["torch_f16_us"] * r["count"] for r in res["large"]), 1),
                                 "linear_vec_best": round(sum((r["best"] or r["current"])["us"] * r["count"]
                                                              for r in res["large"]), 1)}
    now = sum(r["current"]["us"] * r["count"] for r in res["linear"] + res["experts"])
    best = sum((r["best"] or r["current"])["us"] * r["count"] for r in res["linear"] + res["experts"])
    res["per_token_us"] = {"current": round(now, 1), "best_tiles": round(best, 1), "saved": round(now - best, 1),
                           "calls": sum(r["count"] for r in res["linear"] + res["experts"])}
    res["script_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps({k: v for k, v in res.items() if k not in ("linear", "experts", "large")}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    engine.close(prep)
    return 0


if __name__ == "__main__":
    from scoreboard.errors import InputError

    try:
        raise SystemExit(main())
    except InputError as exc:
        print(f"error: {exc.message}\nnext: {exc.hint}")
        raise SystemExit(1) from None
