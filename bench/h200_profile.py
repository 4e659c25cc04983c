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
Prints a table and writes JSON. These are diagnosis numbers, not round results: no gate ran on them.

    python bench/h200_profile.py --target k3-gpu-h200 --out prof.json
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
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    lock = load_lock(Path("reference.lock"))
    t = lock.targets[args.target]
    shards = ensure_generated(lock, t.weights)
    cfg = load_k3_config(shards[0])
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
