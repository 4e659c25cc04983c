"""The tiles of sparkinfer's decode products, measured: every product and routed-experts launch one decoded token
makes, re-timed at each tile and warp count of a sweep, against the tiles the engine uses now and torch's own
product (cuBLAS). A diagnosis to pick tiles from, not a round: no gate ran on it.

The profile at c1b1c3a (bench/results-h200-2026-12-01-session5) put k3-gpu's graph decode at 1.04 ms for 167
kernels, 21% of the bandwidth ceiling: the kernels' own latency binds, and a batch-1 product's latency is its
bytes in flight (rows per program x reduction step x programs). This measures, per recorded call:
- `_linear_vec` at rows per program BN x reduction step BK x warps, and F.linear on the f16 activation;
- `decode_experts`, one launch's tiles at a time: gate|up columns per program BLOCK_F x latent step BLOCK_K, then
  down rows per program BLOCK_L x F step BLOCK_KD, and both launches at their best together;
- the token's other kernels (`mla_decode` at the scored depth's span, `kda_step`, `res_mix`, `route`, `situ_vec`)
  at their current constants, `mla_decode` over its split (least rows per split x rows per step x the split's
  warps), `kda_step`
  over its warps and `res_mix` over its columns per program: what the products and experts leave of the token;
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

# each range reaches past the tiles the engine took from the sweep of 2026-12-02, which sat at its edges
LINEAR_TILES = {"BN": (2, 4, 8, 16, 32), "BK": (128, 256, 512, 1024, 2048), "warps": (2, 4, 8)}
# the routed experts' two launches, swept one at a time (the other at its current tiles): gate|up + situ over
# (columns per program, reduction step over the latent), then down + the weighted sum over (rows per program,
# reduction step over F)
EXPERT_TILES = ({"BLOCK_F": (4, 8, 16, 32), "BLOCK_K": (256, 512, 1024, 2048)},
                {"BLOCK_L": (1, 2, 4, 8), "BLOCK_KD": (512, 1024, 2048)})
# the one-token products the torch form still runs on cuBLAS (above VEC_MAX_ELEMENTS, or not linear_vec's case),
# timed on linear_vec too: whether the cap should move
LARGE_TILES = {"BN": (8, 16, 32), "BK": (512, 1024), "warps": (4, 8)}
# the other one-token kernels, each over the module constants its launches read (a WARPS entry as "WARPS.name")
OTHER_TILES: dict[str, dict[str, tuple[int, ...]]] = {
    "mla_decode": {"MLA_ROWS_MIN": (32, 64, 128, 256), "MLA_BT": (16, 32, 64), "WARPS.mla_split": (4, 8)},
    "kda_step": {"WARPS.kda_step": (4, 8, 16)}, "res_mix": {"RES_MIX_COLS": (0, 128, 256, 512)}, "route": {},
    "situ_vec": {}}
QUICK_OTHER: dict[str, dict[str, tuple[int, ...]]] = {
    "mla_decode": {"MLA_ROWS_MIN": (128,), "MLA_BT": (64,), "WARPS.mla_split": (4,)},
    "kda_step": {"WARPS.kda_step": (8,)}, "res_mix": {"RES_MIX_COLS": (0, 256)}, "route": {}, "situ_vec": {}}
# tiles a kernel cannot take: a step of more rows than a split has would read the next split's rows too
OTHER_VALID = {"mla_decode": lambda t: t["MLA_BT"] <= t["MLA_ROWS_MIN"]}
DEPTH = 1100  # mla_decode's row, and a span of 2048: where the round's decode at depth 1024 attends
QUICK_LINEAR = {"BN": (4, 16), "BK": (512,), "warps": (4,)}
QUICK_EXPERTS = ({"BLOCK_F": (32,), "BLOCK_K": (128,)}, {"BLOCK_L": (8, 16), "BLOCK_KD": (128,)})


def one_token(model: Any, forget: Callable[[], Any]) -> None:
    """A 32-token prefill, then `forget` (what was recorded so far is the prefill's, not one token's), then one
    decoded token."""
    dev = model.device
    ids = torch.randint(0, model.cfg.n_vocab, (32,), generator=torch.Generator().manual_seed(3)).to(dev)
    cache = model.new_cache(64)
    first = model.forward(ids, cache, torch.tensor([31], device=dev))
    forget()
    model.forward(first.argmax(-1), cache, torch.zeros(1, dtype=torch.long, device=dev))


def _shapes(args: tuple) -> tuple:
    """What sets a launch's work: each tensor argument's shape and dtype, each other argument's type."""
    return tuple((tuple(a.shape), str(a.dtype)) if isinstance(a, torch.Tensor) else type(a).__name__ for a in args)


def _as_is(args: tuple) -> tuple:
    return args


def _one_row_product(args: tuple) -> tuple | None:
    """model.linear(x, m) on one row of a plain f16/bf16 matrix, as linear_vec's arguments (x, w, norm, eps, add)."""
    x, m = args
    w = m.w
    if x.reshape(-1, x.shape[-1]).shape[0] != 1 or w.dim() != 2 or w.dtype not in (torch.float16, torch.bfloat16):
        return None
    return x.detach().reshape(1, -1).float(), w, None, 0.0, None


def record(model: Any, hooks: dict[str, tuple[Any, str, Callable[[tuple], tuple | None]]]) -> dict[str, list[dict]]:
    """One decoded token after a 32-token prefill with each hook's owner.attribute wrapped. A hook's view turns a
    call's arguments into the arguments to keep (None: not recorded). Each distinct call is kept once (its
    arguments cloned) with how many times the token made it. Calls are distinct by what sets a launch's work
    (shapes, dtypes, which optional inputs are there), not by which layer's weights they read: the sweep of
    2026-12-02 timed every layer's launch of one shape within a few percent of each other."""
    found: dict[str, dict[tuple, dict]] = {label: {} for label in hooks}
    orig = {label: getattr(owner, attr) for label, (owner, attr, _) in hooks.items()}

    def wrap(label: str, view: Callable[[tuple], tuple | None]) -> Callable[..., Any]:
        def rec(*args: Any) -> Any:
            kept = view(args)
            if kept is not None:
                calls = found[label]
                key = _shapes(kept)
                if key not in calls:
                    calls[key] = {"name": label, "count": 0, "args": tuple(
                        a.detach().clone() if isinstance(a, torch.Tensor) else a for a in kept)}
                calls[key]["count"] += 1
            return orig[label](*args)
        return rec

    def forget() -> None:  # the prefill's calls are not one token's
        for calls in found.values():
            calls.clear()

    for label, (owner, attr, view) in hooks.items():
        setattr(owner, attr, wrap(label, view))
    try:
        one_token(model, forget)
    finally:
        for label, (owner, attr, _) in hooks.items():
            setattr(owner, attr, orig[label])
    return {label: list(calls.values()) for label, calls in found.items()}


def at_depth(call: dict, depth: int) -> dict:
    """An mla_decode call attending as the round's decode at `depth` does: a random f16 latent cache of `span` rows
    (the next power of two above depth), the row at `depth`."""
    a = list(call["args"])  # q, kv, kv_norm, latent, pos, span, ...
    span = 1 << depth.bit_length()  # rows 0..depth fit
    lat = a[3]
    a[3] = (torch.randn(span, lat.shape[1], generator=torch.Generator().manual_seed(7)) * 0.5).to(lat)
    a[4] = torch.tensor([depth], dtype=torch.long, device=lat.device)
    a[5] = span
    return {**call, "args": tuple(a), "span": span}


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
    x, w, norm, eps, add = call["args"]
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


def _set(kernels: Any, name: str, value: Any) -> None:
    if name.startswith("WARPS."):
        kernels.WARPS[name.removeprefix("WARPS.")] = value
    else:
        setattr(kernels, name, value)


def _get(kernels: Any, name: str) -> Any:
    return kernels.WARPS[name.removeprefix("WARPS.")] if name.startswith("WARPS.") else getattr(kernels, name)


def _flat(out: Any) -> torch.Tensor:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return torch.cat([o.float().reshape(-1) for o in outs])


def sweep_other(kernels: Any, call: dict, tiles: dict, cuda: bool, launches: int, replays: int) -> dict:
    """One recorded call of another kernel wrapper, timed at its current constants and at every combination of
    `tiles` (kernel constants). Its in-place state (KDA's conv and delta states, MLA's cache row) evolves across
    the timed launches, which changes no launch's work; each output difference is taken from fresh copies."""
    fn = getattr(kernels, call["name"])
    work = [a.clone() if isinstance(a, torch.Tensor) else a for a in call["args"]]

    def fresh() -> torch.Tensor:
        return _flat(fn(*[a.clone() if isinstance(a, torch.Tensor) else a for a in call["args"]]))

    def run() -> Any:
        return fn(*work)

    saved = {n: _get(kernels, n) for n in tiles}
    want = fresh()
    rows: list[dict[str, Any]] = []
    try:
        cur = device_us(run, cuda, launches, replays)
        valid = OTHER_VALID.get(call["name"], lambda t: True)
        for vals in itertools.product(*tiles.values()):
            row: dict[str, Any] = dict(zip(tiles, vals))
            if not valid(row):
                continue
            for n, v in zip(tiles, vals):
                _set(kernels, n, v)
            try:
                row.update(us=round(device_us(run, cuda, launches, replays), 3), max_rel_diff=rel(fresh(), want))
            except Exception as exc:  # a tile that does not compile or launch here
                row["error"] = f"{type(exc).__name__}: {exc}"[:200]
            rows.append(row)
    finally:
        for n, v in saved.items():
            _set(kernels, n, v)
    ok = [r for r in rows if "us" in r]
    best = min(ok, key=lambda r: r["us"]) if ok else None
    shapes = [list(a.shape) for a in call["args"] if isinstance(a, torch.Tensor)][:2]
    return {"name": call["name"], "shape": shapes, "span": call.get("span"), "count": call["count"],
            "current": {**saved, "us": round(cur, 3)}, "best": best, "tiles": rows}


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
    import engines.sparkinfer.model as mod

    other_tiles = QUICK_OTHER if args.quick else OTHER_TILES
    found = record(model, {"linear": (kernels, "linear_vec", _as_is), "experts": (kernels, "decode_experts", _as_is),
                           "large": (mod, "linear", _one_row_product),
                           **{n: (kernels, n, _as_is) for n in other_tiles}})
    lin_calls, exp_calls, big_calls = found["linear"], found["experts"], found["large"]
    other_calls = [c if args.quick or n != "mla_decode" else at_depth(c, DEPTH) for n in other_tiles for c in found[n]]
    tile_sets: tuple[Any, Any, Any] = ((QUICK_LINEAR, QUICK_EXPERTS, QUICK_LINEAR) if args.quick
                                       else (LINEAR_TILES, EXPERT_TILES, LARGE_TILES))
    lt, et, bt = tile_sets
    if args.quick:
        lin_calls, exp_calls, big_calls = lin_calls[:2], exp_calls[:1], big_calls[:1]
        other_calls = [found[n][0] for n in other_tiles if found[n]]
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
    res["other"] = []
    for i, c in enumerate(other_calls):
        r = sweep_other(kernels, c, other_tiles[c["name"]], cuda, launches, replays)
        res["other"].append(r)
        print(f"[{time.perf_counter() - t_start:6.1f} s] other {i + 1}/{len(other_calls)} {r['name']} {r['shape']} "
              f"x{r['count']}: now {r['current']['us']} us, best {r['best'] and r['best']['us']} us", flush=True)
    res["other_per_token_us"] = {
        name: {"current": round(sum(r["current"]["us"] * r["count"] for r in res["other"] if r["name"] == name), 1),
               "best": round(sum((r["best"] or r["current"])["us"] * r["count"] for r in res["other"]
                                 if r["name"] == name), 1),
               "calls": sum(r["count"] for r in res["other"] if r["name"] == name)}
        for name in dict.fromkeys(r["name"] for r in res["other"])}
    res["large_per_token_us"] = {"torch": round(sum(r["torch_f16_us"] * r["count"] for r in res["large"]), 1),
                                 "linear_vec_best": round(sum((r["best"] or r["current"])["us"] * r["count"]
                                                              for r in res["large"]), 1)}
    now = sum(r["current"]["us"] * r["count"] for r in res["linear"] + res["experts"])
    best = sum((r["best"] or r["current"])["us"] * r["count"] for r in res["linear"] + res["experts"])
    res["per_token_us"] = {"current": round(now, 1), "best_tiles": round(best, 1), "saved": round(now - best, 1),
                           "calls": sum(r["count"] for r in res["linear"] + res["experts"])}
    res["script_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps({k: v for k, v in res.items() if k not in ("linear", "experts", "large", "other")}, indent=1))
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
