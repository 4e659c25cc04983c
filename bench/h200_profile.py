"""Where sparkinfer's time goes on one GPU: kernel launches and kernel time per decoded token, and per prefill.

For a lock target's weights (generated into $SCOREBOARD_CACHE if absent, verified against the lock) it
prepares sparkinfer with the target's candidate options, then:
- times a decode of N tokens at the scored depth with CUDA graphs on and off (begin untimed, step timed
  between device synchronizations, the harness's in-process clock);
- profiles one eager decode step and one prefill with torch.profiler: kernels launched, total kernel
  time, wall time, and the top kernels by time;
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
    args = ap.parse_args(argv)
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
    res: dict = {"target": args.target, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "depth": depth, "decode_tokens": args.tokens, "prefill_tokens": args.prefill,
                 "bytes_per_token": total, "bytes": parts,
                 "ceiling_tok_s": round(args.bandwidth_gbs * 1e9 / total, 1), "bandwidth_gbs": args.bandwidth_gbs}
    engine = SparkInferEngine()
    for graph in (True, False):
        opts = dict(t.candidate_options or {})
        opts["cuda_graph"] = graph
        target = EngineTarget(args.target, shards[0], tuple(shards), "cuda", geom, options=opts)
        prep = engine.prepare(target, Path("unused"))
        key = "graph" if graph else "eager"
        s = timed(engine, prep, *dec, args.reps)
        res[f"decode_{key}_tok_s"] = round(args.tokens / s, 1)
        res[f"decode_{key}_ms_per_token"] = round(s * 1e3 / args.tokens, 4)
        if not graph:
            one = Workload.split("decode", depth, 1, ids[:depth + 1])
            res["decode_step_profile"] = profiled(engine, prep, *one, args.top)
            s = timed(engine, prep, *pre, args.reps)
            res["prefill_tok_s"] = round(args.prefill / s, 1)
            res["prefill_profile"] = profiled(engine, prep, *pre, args.top)
        engine.close(prep)
        torch.cuda.empty_cache()
    print(json.dumps(res, indent=1))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
