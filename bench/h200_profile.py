"""Where sparkinfer's time goes on one GPU: kernel launches and kernel time per decoded token, and per prefill.

For a lock target's weights (generated into $SCOREBOARD_CACHE if absent, verified against the lock) it
prepares sparkinfer with the target's candidate options, then:
- times a decode of N tokens at the scored depth with CUDA graphs on and off (begin untimed, step timed
  between device synchronizations, the harness's in-process clock);
- profiles one eager decode step and one prefill with torch.profiler: kernels launched, total kernel
  time, wall time, and the top kernels by time;
- attributes kernel time and launches to the model's parts (each K3Model method and norm wrapped in a
  profiler range): residual mix, KDA, MLA, dense and MoE FFN, routed experts, norms;
- times what every round worker pays before its first timed rep: the weight load (prepare) and the first
  decode begin (prefill of the context plus the CUDA graph capture);
- probes the kernels a next step could use: torch._grouped_mm per dtype, F.rms_norm's launch count;
- records which path the engine chose (its identity's ``kernels`` note) and, when the Triton kernels are on,
  times the graph decode and the prefill once more with the torch form (``decode_graph_torch_form_tok_s``);
- computes the decode-rate bound from the bytes one token must read (scoreboard.ceiling) at a bandwidth.

With ``--depths`` it profiles where users run instead (:func:`depth_profile`): for each form (the engine as it
prepares, Triton kernels on, and the torch form), decode at each depth in increasing order on one nested prompt
(the graph decode, each depth's first begin() restoring the previous depth's prefix snapshot), then a prefill of
``--prefill`` tokens from empty; per workload the first begin()'s wall time and the tokens it restored, the median
rep (in-process clock, each rep's begin() restoring), and a torch.profiler table of one step: CUDA time and calls
per kernel name, per decoded token (CPU op time on a CPU smoke run).
Prints and writes JSON. These are diagnosis numbers, not round results: no gate ran on them.

    python bench/h200_profile.py --target k3-gpu-h200 --out prof.json
    python bench/h200_profile.py --target k3-gpu-h200 --depths 1024,16384,65536,131072 --prefill 32768 --out d.json
    python bench/h200_profile.py --target k3-mini-cpu --device cpu --depths 64,200 --prefill 256 --tokens 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from engines.sparkinfer.engine import SparkInferEngine
from scoreboard.ceiling import decode_bytes
from scoreboard.engine import EngineTarget, Geometry, Workload
from scoreboard.lockfile import load_lock
from scoreboard.models.k3 import load_k3_config
from scoreboard.round.prompt import draw_prompt
from scoreboard.round.clock import in_process_reps
from scoreboard.weights.tokenizer import Tokenizer
from scoreboard.weights.verify import ensure_generated


PARTS = ("_res_mix", "_kda", "_mla", "_dense", "_moe", "_experts", "_decode_experts")
NORMS = ("rms_norm", "l2_norm", "situ", "linear")


def label_parts() -> None:
    """Wrap the model's methods and elementwise helpers in profiler ranges (this process only)."""
    from torch.profiler import record_function

    import engines.sparkinfer.model as m

    def wrap(fn, name):
        def inner(*a, **k):
            with record_function("part:" + name):
                return fn(*a, **k)
        return inner

    for name in PARTS:
        setattr(m.K3Model, name, wrap(getattr(m.K3Model, name), name))
    for name in NORMS:
        setattr(m, name, wrap(getattr(m, name), name))


def part_table(prof) -> dict:
    """Per labelled part: calls, the device time and the kernel launches inside it (nested parts overlap:
    _moe holds its linear, situ and _experts calls)."""
    def launches(ev) -> int:
        return len(ev.kernels) + sum(launches(c) for c in ev.cpu_children)

    out: dict = {}
    for e in prof.key_averages():
        if e.key.startswith("part:"):
            out[e.key[5:]] = {"calls": e.count, "device_us": round(e.device_time_total, 1),
                              "cpu_us": round(e.cpu_time_total, 1), "kernels": 0}
    for ev in prof.events():
        if ev.name.startswith("part:"):
            out[ev.name[5:]]["kernels"] += launches(ev)
    return out


def probes() -> dict:
    """Which fused/grouped kernels this torch build offers on this GPU, and what they cost in launches."""
    res: dict = {}
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        # the expert layout: weights [G, N, K] read through a transposed view; one group left empty
        a = torch.randn(64, 256, device="cuda", dtype=dt)
        w = torch.randn(4, 128, 256, device="cuda", dtype=dt)
        offs = torch.tensor([16, 16, 48, 64], device="cuda", dtype=torch.int32)
        try:
            y = torch._grouped_mm(a, w.transpose(1, 2), offs=offs)
            lo = [0, 16, 16, 48]
            ref = torch.cat([a[lo[i]:int(offs[i])].float() @ w[i].float().T for i in range(4)])
            res[f"grouped_mm_{dt}"] = {"ok": True, "max_err": float((y.float() - ref).abs().max())}
        except Exception as exc:  # noqa: BLE001 - a probe records what fails
            res[f"grouped_mm_{dt}"] = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    x = torch.randn(1, 2048, device="cuda")
    w = torch.randn(2048, device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.nn.functional.rms_norm(x, (2048,), w, 1e-6)
        torch.cuda.synchronize()
    res["rms_norm_kernels"] = sum(e.count for e in prof.key_averages()
                                  if e.device_type == torch.autograd.DeviceType.CUDA)
    return res


def kernel_table(prof, top: int) -> dict:
    evs = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total_us = sum(e.self_device_time_total for e in evs)
    launches = sum(e.count for e in evs)
    rows = sorted(evs, key=lambda e: -e.self_device_time_total)[:top]
    return {"kernels": launches, "kernel_us": round(total_us, 1),
            "top": [{"name": e.key[:90], "count": e.count, "us": round(e.self_device_time_total, 1)} for e in rows]}


def timed(engine, prep, wl, revealed, reps: int) -> float:
    state = engine.begin(prep, wl)
    engine.synchronize(prep)
    engine.step(prep, state, revealed)
    out = in_process_reps(engine, prep, wl, [revealed] * (reps + 1), warmup=1)
    return statistics.median(r.ns for r in out) * 1e-9


def profiled(engine, prep, wl, revealed, top: int) -> dict:
    state = engine.begin(prep, wl)
    engine.synchronize(prep)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        engine.step(prep, state, revealed)
        engine.synchronize(prep)
        wall = time.perf_counter() - t0
    out = kernel_table(prof, top)
    out["wall_ms"] = round(wall * 1e3, 3)
    out["parts"] = part_table(prof)
    return out


def op_table(prof, cuda: bool, per: int, top: int) -> dict:
    """Time and calls per kernel name (CUDA; CPU ops on a CPU run) of a profiled step, divided by `per` (its
    decoded tokens): {"us_per_token", "launches_per_token", "top": [{"name", "calls", "us"}...]} per token."""
    want = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    evs = [e for e in prof.key_averages() if e.device_type == want and (cuda or not e.cpu_children)]
    time_of = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    rows = sorted(evs, key=lambda e: -time_of(e))
    return {"us_per_token": round(sum(time_of(e) for e in evs) / per, 2),
            "launches_per_token": round(sum(e.count for e in evs) / per, 1),
            "top": [{"name": e.key[:90], "calls": round(e.count / per, 2), "us": round(time_of(e) / per, 2)}
                    for e in rows[:top]]}


def workload_profile(engine, prep, wl, revealed, reps: int, top: int, cuda: bool) -> dict:
    """One workload at its depth: the first begin() (restore + prefill + capture), `reps` timed reps after a
    warm-up, and one profiled begin() + step()."""
    store = lambda: prep.handle.context.store  # noqa: E731
    t0 = time.perf_counter()
    state = engine.begin(prep, wl)
    engine.synchronize(prep)
    out: dict = {"first_begin_s": round(time.perf_counter() - t0, 3), "first_begin_restored": store().restored}
    engine.step(prep, state, revealed)
    runs = in_process_reps(engine, prep, wl, [revealed] * (reps + 1), warmup=1)
    sec = statistics.median(r.ns for r in runs) * 1e-9
    per = wl.n_tokens if wl.phase == "decode" else 1
    out.update({"rep_restored": store().restored, "tok_s": round(wl.n_tokens / sec, 1),
                "ms_per_token": round(sec * 1e3 / wl.n_tokens, 4), "rep_ms": round(sec * 1e3, 3)})
    state = engine.begin(prep, wl)
    engine.synchronize(prep)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        engine.step(prep, state, revealed)
        engine.synchronize(prep)
        out["profiled_step_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
    out["kernels"] = op_table(prof, cuda, per, top)
    return out


def depth_profile(args, t, shards, cuda: bool) -> dict:
    """Per form (the prepared engine's kernels, and the torch form when they are on): decode at each depth of
    args.depths in increasing order on one nested prompt, then a prefill of args.prefill tokens from empty."""
    depths = sorted(int(d) for d in args.depths.split(","))
    geom = Geometry(n_ctx=max(depths[-1], args.prefill) + args.tokens + 64, n_batch=512, n_ubatch=512, n_threads=1)
    ids = draw_prompt(Tokenizer.from_gguf(shards[0]), max(depths[-1] + args.tokens, args.prefill), seed=7).token_ids
    engine = SparkInferEngine()
    opts = {k: v for k, v in dict(t.candidate_options or {}).items() if cuda or k != "cuda_graph"}
    out: dict = {"depths": depths, "prefill_tokens": args.prefill, "decode_tokens": args.tokens,
                 "n_ctx": geom.n_ctx, "forms": {}}
    for form in args.forms.split(","):
        prep = engine.prepare(EngineTarget(args.target, shards[0], tuple(shards), args.device, geom, options=opts),
                              Path("unused"))
        model = prep.handle.model
        if form == "torch":
            if not model.use_kernels and out["forms"]:
                break  # the kernels were off: the first form was the torch form already
            model.use_kernels = False  # before the first begin(): the graphs capture the torch form
        rec: dict = {"identity_kernels": prep.identity.extra.get("kernels"), "use_kernels": model.use_kernels,
                     "mla_prefill": model.mla_prefill if model.use_kernels else "torch", "decode": {}}
        for d in depths:
            wl = Workload.split("decode", d, args.tokens, ids[:d + args.tokens])
            rec["decode"][str(d)] = workload_profile(engine, prep, *wl, args.reps, args.top, cuda)
            print(json.dumps({"form": form, "depth": d, **{k: v for k, v in rec["decode"][str(d)].items()
                                                           if k != "kernels"}}), flush=True)
        pre = Workload.split("prefill", 0, args.prefill, ids[:args.prefill])
        rec["prefill"] = workload_profile(engine, prep, *pre, max(1, args.reps // 2), args.top, cuda)
        print(json.dumps({"form": form, "prefill": args.prefill, **{k: v for k, v in rec["prefill"].items()
                                                                   if k != "kernels"}}), flush=True)
        rec["snapshots"] = {"kept": len(prep.handle.context.store.snapshots),
                            "bytes": prep.handle.context.store.nbytes}
        out["forms"][form] = rec
        engine.close(prep)
        if cuda:
            torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="k3-gpu-h200")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--bandwidth-gbs", type=float, default=4300.0, help="measured H200 copy bandwidth")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (no graphs, no probes)")
    ap.add_argument("--no-parts", action="store_true", help="profile without the per-part ranges")
    ap.add_argument("--depths", help="comma-separated decode depths: the depth profile (depth_profile) instead")
    ap.add_argument("--forms", default="kernels,torch", help="the depth profile's forms: kernels, torch or both")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    lock = load_lock(Path("reference.lock"))
    t = lock.targets[args.target]
    shards = ensure_generated(lock, t.weights)
    cfg = load_k3_config(shards[0])
    if args.depths:
        res = {"target": args.target, "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "none",
               "torch": torch.__version__, **depth_profile(args, t, shards, args.device == "cuda")}
        res["script_s"] = round(time.perf_counter() - t_start, 1)
        text = json.dumps(res, indent=1)
        print(text)
        if args.out:
            args.out.write_text(text)
        return 0
    depth = next(m.depth for m in t.metrics if m.phase == "decode" and m.role == "scored")
    geom = Geometry(n_ctx=max(4096, depth + args.tokens + 16, args.prefill + 16), n_batch=512, n_ubatch=512,
                    n_threads=1)
    ids = draw_prompt(Tokenizer.from_gguf(shards[0]), max(depth + args.tokens, args.prefill), seed=7).token_ids
    dec = Workload.split("decode", depth, args.tokens, ids[:depth + args.tokens])
    pre = Workload.split("prefill", 0, args.prefill, ids[:args.prefill])
    total, parts = decode_bytes(shards, cfg)
    cuda = args.device == "cuda"
    res: dict = {"target": args.target, "gpu": torch.cuda.get_device_name() if cuda else "none", "torch": torch.__version__,
                 "depth": depth, "decode_tokens": args.tokens, "prefill_tokens": args.prefill,
                 "bytes_per_token": total, "bytes": parts,
                 "ceiling_tok_s": round(args.bandwidth_gbs * 1e9 / total, 1), "bandwidth_gbs": args.bandwidth_gbs}
    res["probes"] = probes() if cuda else {}
    engine = SparkInferEngine()
    for graph in (True, False) if cuda else (False,):
        opts = dict(t.candidate_options or {})
        opts["cuda_graph"] = graph
        if not cuda:
            opts.pop("cuda_graph")
        target = EngineTarget(args.target, shards[0], tuple(shards), args.device, geom, options=opts)
        t0 = time.perf_counter()
        prep = engine.prepare(target, Path("unused"))
        engine.synchronize(prep)
        key = "graph" if graph else "eager"
        res[f"prepare_{key}_s"] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
        engine.begin(prep, dec[0])
        engine.synchronize(prep)
        res[f"first_decode_begin_{key}_s"] = round(time.perf_counter() - t0, 3)
        if not graph and not args.no_parts:
            label_parts()
        res[f"kernels_{key}"] = prep.identity.extra.get("kernels")
        res[f"kernel_errors_{key}"] = dict(prep.handle.model.kernel_errors)
        s = timed(engine, prep, *dec, args.reps)
        res[f"decode_{key}_tok_s"] = round(args.tokens / s, 1)
        res[f"decode_{key}_ms_per_token"] = round(s * 1e3 / args.tokens, 4)
        model = prep.handle.model
        if graph and model.use_kernels:  # the same decode with the torch form: what the kernels buy
            model.use_kernels, prep.handle.decoder = False, None  # a fresh decoder captures the torch form
            engine.begin(prep, dec[0])
            s = timed(engine, prep, *dec, args.reps)
            res["decode_graph_torch_form_tok_s"] = round(args.tokens / s, 1)
            s = timed(engine, prep, *pre, args.reps)
            res["prefill_torch_form_tok_s"] = round(args.prefill / s, 1)
            model.use_kernels, prep.handle.decoder = True, None
        if not graph:
            one = Workload.split("decode", depth, 1, ids[:depth + 1])
            res["decode_step_profile"] = profiled(engine, prep, *one, args.top)
            s = timed(engine, prep, *pre, args.reps)
            res["prefill_tok_s"] = round(args.prefill / s, 1)
            res["prefill_profile"] = profiled(engine, prep, *pre, args.top)
        engine.close(prep)
        if cuda:
            torch.cuda.empty_cache()
    res["script_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(res, indent=1))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
