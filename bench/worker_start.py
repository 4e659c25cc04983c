"""What one speed block's sparkinfer worker pays besides its timed reps, phase by phase, with Triton's kernel cache
cold and then warm.

A sealed k3-wide-long-h100 round (20261207T025030Z-k3-wide-long-h100-2a871f72) spent 38.5 s in each candidate
block, of which 4.9 s were timed samples: every block is a fresh worker process, and the sandbox gives each one an
empty tmpfs for HOME, so Triton's cache (~/.triton/cache) starts empty in every block. This script splits that
cost without the sandbox: a fresh Python process per run (as a worker is) imports torch and the engine, prepares
the target (the weight load), then for each decode depth of the target, in increasing order as a block runs them,
one begin() (restoring the previous depth's prefix) and one timed rep, then the target's prefill; each phase's wall
time, and the files Triton's cache holds after it. The first run starts from an empty TRITON_CACHE_DIR, the second
reuses what the first left: the difference is what compiling the kernels costs a block.

Diagnosis numbers, not round results (no gate, no sandbox, the process's own clock).

Run it from the root of the checkout whose engine it times:

    python bench/worker_start.py --target k3-wide-long-h100 --out start.json
    python bench/worker_start.py --target k3-mini-cpu --device cpu
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

def cache_files(root: str) -> int:
    return sum(len(files) for _dirs, _sub, files in os.walk(root))


def child(target_id: str, device: str) -> dict:
    """One worker's life, timed by phase (run in a fresh process by `main`)."""
    t0 = time.perf_counter()
    phases: list[dict] = []
    cache = os.environ["TRITON_CACHE_DIR"]

    def mark(name: str, since: float) -> float:
        now = time.perf_counter()
        phases.append({"phase": name, "s": round(now - since, 3), "triton_cache_files": cache_files(cache)})
        return now

    import torch  # noqa: F401  (its import is a phase of its own)

    from engines.sparkinfer.engine import SparkInferEngine
    from scoreboard.engine import EngineTarget, Geometry, Workload
    from scoreboard.lockfile import load_lock
    from scoreboard.round.prompt import draw_prompt
    from scoreboard.weights.tokenizer import Tokenizer
    from scoreboard.weights.verify import ensure_generated

    t = mark("import", t0)
    lock = load_lock(Path("reference.lock"))
    target = lock.targets[target_id]
    shards = ensure_generated(lock, target.weights)
    depths = sorted({m.depth for m in target.metrics if m.phase == "decode"})
    prefills = sorted({m.n_tokens for m in target.metrics if m.phase == "prefill"})
    tokens = max(m.n_tokens for m in target.metrics if m.phase == "decode")
    geom = Geometry(**target.geometry)
    ids = draw_prompt(Tokenizer.from_gguf(shards[0]), max(depths[-1] + tokens, *prefills), seed=7).token_ids
    opts = {k: v for k, v in dict(target.candidate_options or {}).items() if device == "cuda" or k != "cuda_graph"}
    t = mark("weights verified, prompt drawn", t)
    engine = SparkInferEngine()
    prep = engine.prepare(EngineTarget(target_id, shards[0], tuple(shards), device, geom, options=opts), Path("unused"))
    engine.synchronize(prep)
    t = mark("prepare (weight load)", t)
    work = [(f"decode@{d}", Workload.split("decode", d, tokens, ids[:d + tokens])) for d in depths]
    work += [(f"prefill@{n}", Workload.split("prefill", 0, n, ids[:n])) for n in prefills]
    for name, (wl, revealed) in work:
        for rep in ("first", "second"):  # the first begin prefills (or restores a shallower prefix), later ones restore
            state = engine.begin(prep, wl)
            engine.synchronize(prep)
            t = mark(f"{name} begin" if rep == "first" else f"{name} second begin", t)
            engine.step(prep, state, revealed)
            engine.synchronize(prep)
            t = mark(f"{name} {rep} rep", t)
    engine.close(prep)
    return {"phases": phases, "total_s": round(time.perf_counter() - t0, 3)}


def run_child(target_id: str, device: str, cache: str) -> dict:
    # the engine and lock of the checkout this runs in (the box's clone at the commit main stands at)
    env = {**os.environ, "TRITON_CACHE_DIR": cache, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, __file__, "--child", "--target", target_id, "--device", device],
                         capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"the worker-like process failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="k3-wide-long-h100")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.target, args.device)), flush=True)
        return 0
    from scoreboard.lockfile import load_lock

    target = load_lock(Path("reference.lock")).targets.get(args.target)
    if target is None or target.candidate_engine != "sparkinfer":
        why = "is not in ./reference.lock" if target is None else f"is scored with {target.candidate_engine!r}"
        print(f"--target {args.target}: the target {why}; this script times sparkinfer's workers: name a target of "
              "reference.lock whose candidate_engine is sparkinfer, from the root of the checkout", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="sb-triton-") as cache:
        res = {"target": args.target, "device": args.device, "runs": {}}
        for name in ("cold", "warm"):  # the same cache dir: the second run finds what the first compiled
            res["runs"][name] = run_child(args.target, args.device, cache)
            print(json.dumps({name: res["runs"][name]["total_s"]}), flush=True)
    res["compile_share_s"] = round(res["runs"]["cold"]["total_s"] - res["runs"]["warm"]["total_s"], 3)
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
