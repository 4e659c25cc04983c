"""GPU smoke test of sparkinfer's CUDA-graph decode: eager vs graph on the generated k3-mini.

For each dtype (float32, bfloat16) it prepares the engine twice on CUDA (options.cuda_graph false / true),
times decode workloads with the harness's own clock (scoreboard.round.clock.in_process_reps: begin untimed, step
timed between device synchronizations), prints tok/s and whether the greedy tokens agree. float32 must
give identical tokens (exit 1 otherwise); bfloat16's agreement is printed, not required.

    python bench/sparkinfer_graph_smoke.py                 # depth 512, 64 tokens, 3 timed reps
    python bench/sparkinfer_graph_smoke.py --depth 2048 --tokens 128 --reps 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from engines.sparkinfer.engine import SparkInferEngine, token_ids
from scoreboard.engine import EngineTarget, Geometry, Workload
from scoreboard.round.prompt import draw_prompt
from scoreboard.round.clock import in_process_reps
from scoreboard.weights.generate import generate
from scoreboard.weights.tokenizer import Tokenizer


def run(shards: list[Path], dtype: str, graph: bool, split: tuple, geom: Geometry, reps: int) -> dict:
    wl, revealed = split
    engine = SparkInferEngine()
    target = EngineTarget("k3-mini-cuda-smoke", shards[0], tuple(shards), "cuda", geom,
                          options={"dtype": dtype, "cuda_graph": graph})
    prep = engine.prepare(target, Path("unused"))
    assert prep.identity.extra["cuda_graph"] is graph
    t0 = time.perf_counter()
    state = engine.begin(prep, wl)  # the first begin captures the graph (untimed)
    engine.synchronize(prep)
    first_begin = time.perf_counter() - t0
    first = token_ids(engine.step(prep, state, revealed))
    out = in_process_reps(engine, prep, wl, [revealed] * (reps + 1), warmup=1)
    toks = {tuple(r.token_ids) for r in out} | {tuple(first)}
    med = statistics.median(r.ns for r in out)
    engine.close(prep)
    return {"tokens": list(first), "stable": len(toks) == 1, "tok_s": wl.n_tokens / (med * 1e-9),
            "first_begin_s": first_begin, "rep_ms": [round(r.ns / 1e6, 2) for r in out]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="k3-mini")
    ap.add_argument("--depth", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", action="append", help="float32 and bfloat16 by default")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: this smoke test runs on the GPU box", file=sys.stderr)
        return 1
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
    geom = Geometry(n_ctx=max(2048, args.depth + args.tokens), n_batch=512, n_ubatch=512, n_threads=1)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        shards = generate(args.preset, Path(tmp))
        ids = draw_prompt(Tokenizer.from_gguf(shards[0]), args.depth + args.tokens, seed=7).token_ids
        wl = Workload.split("decode", args.depth, args.tokens, ids)
        for dtype in args.dtype or ["float32", "bfloat16"]:
            res = {g: run(shards, dtype, g, wl, geom, args.reps) for g in (False, True)}
            same = res[False]["tokens"] == res[True]["tokens"]
            n_same = sum(a == b for a, b in zip(res[False]["tokens"], res[True]["tokens"]))
            for g, r in res.items():
                print(f"{args.preset} {dtype:8s} {'graph' if g else 'eager':5s} depth {args.depth} "
                      f"n {args.tokens}: {r['tok_s']:9.1f} tok/s  reps {r['rep_ms']} ms  "
                      f"first begin {r['first_begin_s']:.3f} s  stable {r['stable']}")
            print(f"{args.preset} {dtype:8s} speedup {res[True]['tok_s'] / res[False]['tok_s']:.1f}x  "
                  f"tokens identical: {same} ({n_same}/{args.tokens})")
            if dtype == "float32":
                ok = ok and same and res[True]["stable"] and res[False]["stable"]
    print("OK" if ok else "FAIL: float32 graph tokens differ from eager (or are not stable across reps)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
