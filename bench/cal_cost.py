"""What one seed of a target's calibration costs its instrument, per arm: sparkinfer's logits at the gate rows of one
prompt as deep as the target's deepest gate depth, in the target's precision and in the noise floor's other one, and
one injected fault at the deepest of `gate.fault_depths` (the calibration grades faults on that prefix).

A calibration of N seeds runs each arm N times (scoreboard.calibration_run: each arm a worker, every seed's prompt
fed whole through Engine.logits), so these per-prompt seconds times N, plus each arm's weight load, are its box
time beside the reference's logits. Run it on the box before planning a lease around a calibration (k3-wide-long's
f32 arm was the unknown that kept it out of a lease). A diagnosis, not a result: no gate, no seal, the in-process
clock; the prompt is drawn as the calibration draws one (scoreboard.round.prompt.draw_prompt), seed 11.

    python bench/cal_cost.py --target k3-wide-long-h200 --out cost.json
    python bench/cal_cost.py --target k3-mini-cpu --device cpu --depth 200     # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from engines.sparkinfer.engine import SparkInferEngine
from scoreboard.engine import EngineTarget, Geometry, LogitsRequest
from scoreboard.errors import ScoreboardError
from scoreboard.gate import gate_positions
from scoreboard.instrument import instrument_faults, instrument_options
from scoreboard.lockfile import load_lock
from scoreboard.round.prompt import draw_prompt
from scoreboard.weights.tokenizer import Tokenizer
from scoreboard.weights.verify import ensure_generated


def arm_cost(engine: SparkInferEngine, target: EngineTarget, ids: list[int], positions: list[int],
             cuda: bool) -> dict:
    """Load one arm, then time its logits at `positions` of `ids` (one call, as a calibration worker makes)."""
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    prep = engine.prepare(target, Path("unused"))
    engine.synchronize(prep)
    load = time.perf_counter() - t0
    t0 = time.perf_counter()
    res = engine.logits(prep, LogitsRequest(tuple(ids), tuple(positions), target.geometry))
    engine.synchronize(prep)
    out = {"load_s": round(load, 2), "logits_s": round(time.perf_counter() - t0, 2), "tokens": len(ids),
           "rows": len(positions), "vocab": int(res.logits.shape[1])}
    if cuda:
        out["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    engine.close(prep)
    if cuda:
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--depth", type=int, help="the deepest gate depth (default: the target's)")
    ap.add_argument("--fault", help="the fault to time (default: the instrument's first)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    lock = load_lock(Path("reference.lock"))
    t = lock.target(args.target)  # an unknown id: InputError naming the targets
    shards = ensure_generated(lock, t.weights)
    gate = t.gate
    depths = sorted(gate.depths)
    deep = args.depth or depths[-1]  # a shallower --depth (a smoke run) takes every deeper depth's rows there
    fdepths = sorted(min(d, deep) for d in (gate.fault_depths or gate.depths))
    pos = sorted({p for d in depths for p in gate_positions(min(d, deep), gate.rows_per_depth)})
    fpos = sorted({p for d in fdepths for p in gate_positions(d, gate.rows_per_depth)})
    ids = list(draw_prompt(Tokenizer.from_gguf(shards[0]), deep + 1, seed=11).token_ids)[:deep + 1]
    cuda = args.device == "cuda"
    g = t.geometry
    geom = Geometry(n_ctx=max(int(g["n_ctx"]), deep + 16), n_batch=int(g["n_batch"]), n_ubatch=int(g["n_ubatch"]),
                    n_threads=1)
    opts = {k: v for k, v in instrument_options(t).items() if cuda or k != "cuda_graph"}
    own = str(opts.get("dtype", "float32"))
    other = "float32" if own != "float32" else "float16"
    fault = args.fault or instrument_faults()[0]
    engine = SparkInferEngine()
    res: dict = {"target": args.target, "gpu": torch.cuda.get_device_name() if cuda else "none",
                 "depths": depths, "fault_depths": fdepths, "arms": {}}
    for name, extra, p in ((f"dtype:{own}", {}, pos), (f"dtype:{other}", {"dtype": other}, pos),
                           (f"fault:{fault}", {"faults": [fault]}, fpos)):
        target = EngineTarget(args.target, shards[0], tuple(shards), args.device, geom, options={**opts, **extra})
        res["arms"][name] = arm_cost(engine, target, ids[:p[-1] + 1], p, cuda)
        print(json.dumps({"arm": name, **res["arms"][name]}), flush=True)
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except ScoreboardError as exc:  # bad input (a target id, the lock): the message and the fix, exit 1
        print(f"error: {exc.message}" + (f"\nnext: {exc.hint}" if exc.hint else ""), file=sys.stderr)
        raise SystemExit(1) from None
