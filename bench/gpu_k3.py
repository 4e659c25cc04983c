"""GPU bench (not a test): llama.cpp CUDA vs sparkinfer CUDA on one box, in one run.

1. builds the pinned llama.cpp for CUDA through the llamacpp engine (source: a git mirror of the
   sdist's vendored tree, since the GPU box cannot reach PyPI — pass --llama-git/--llama-commit);
2. the gate on k3-mini: KL(llama.cpp CUDA || sparkinfer CUDA) per depth, f32 / bf16 / f16;
3. k3-mid decode tok/s at depth 0 and 32768, llama-bench next to sparkinfer (harness clock).
Writes everything to --out/gpu_results.json. Each section is independent: a failure is recorded.

    PYTHONPATH=... python3 bench/gpu_k3.py --llama-git .carry/llama.git --llama-commit SHA --out $OUT
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import numpy as np

from scoreboard import registry
from scoreboard.engine import EngineTarget, Geometry, LogitsRequest, Workload
from scoreboard.gate import GateResult, gate_positions, grade_depth
from scoreboard.lockfile import GitReference, load_lock
from scoreboard.round.clock import in_process_reps
from scoreboard.weights.generate import generate

from sections import RESULTS, section  # bench/ is the script's own folder



def _split_reps(engine, prep, phase, depth, n, ids, reps, barrier=None):
    """In-process reps of a workload split the way rounds split it (the secret part revealed to step())."""
    wl, revealed = Workload.split(phase, depth, n, ids)
    return in_process_reps(engine, prep, wl, [revealed] * (reps + 1), warmup=1, barrier=barrier)

def tps(reps) -> list[float]:
    return [r.n_tokens / (r.ns / 1e9) for r in reps]


@section("build")
def build(ref, cache):
    from engines.llamacpp.engine import prepare_build

    b = prepare_build(ref, cache, device="cuda", ref_id="llama-cpp-python-0-3-36-git-mirror")
    return {"bin_dir": str(b.bin_dir), "manifest": {k: v for k, v in b.manifest.items() if k != "binaries"}}


@section("gate_k3_mini_cuda")
def gate_k3_mini(ref, cache, work):
    lock = load_lock("reference.lock")
    t = lock.target("k3-mini-cpu")
    shards = generate("k3-mini", work / "k3-mini")
    g = t.geometry
    geom = Geometry(g["n_ctx"], g["n_batch"], g["n_ubatch"], 16)
    rng = np.random.default_rng(0)
    ids = tuple(int(x) for x in rng.integers(0, 510, 1100))
    per = {d: gate_positions(d, t.gate.rows_per_depth) for d in t.gate.depths}
    pos = sorted({p for v in per.values() for p in v})
    llama = registry.load("llamacpp")
    lt = EngineTarget("k3-mini-gpu", shards[0], tuple(shards), "cuda", geom, reference=ref)
    lp = llama.prepare(lt, cache)
    ref_logits = llama.logits(lp, LogitsRequest(ids[: max(t.gate.depths)], tuple(pos), geom)).logits
    row = {p: i for i, p in enumerate(pos)}
    out = {}
    spark = registry.load("sparkinfer")
    for dtype in ("float32", "bfloat16", "float16"):
        st = EngineTarget("k3-mini-gpu", shards[0], tuple(shards), "cuda", geom, options={"dtype": dtype})
        sp = spark.prepare(st, cache)
        cand = spark.logits(sp, LogitsRequest(ids[: max(t.gate.depths)], tuple(pos), geom)).logits
        res = GateResult([grade_depth(d, ps, ref_logits[[row[p] for p in ps]], cand[[row[p] for p in ps]], t.gate)
                          for d, ps in per.items()])
        out[dtype] = {"depths": [{k: d.as_dict()[k] for k in ("depth", "rows", "kl_mean", "kl_p99", "kl_max", "top1",
                                                             "pass")} for d in res.depths], "pass": res.passed}
        spark.close(sp)
    return out


@section("k3_mid_generate")
def gen_mid(work):
    t0 = time.perf_counter()
    shards = generate("k3-mid", work / "k3-mid")
    return {"shards": [str(s) for s in shards], "seconds": round(time.perf_counter() - t0, 1),
            "bytes": sum(s.stat().st_size for s in shards)}


@section("k3_mid_decode")
def decode_mid(ref, cache, shards, depths, n_tokens, reps):
    geom = Geometry(max(depths) + n_tokens + 512, 2048, 512, 16)
    rng = np.random.default_rng(1)
    ids = tuple(int(x) for x in rng.integers(0, 1020, max(depths) + n_tokens + 1))
    out = {}
    try:
        llama = registry.load("llamacpp")
        lp = llama.prepare(EngineTarget("k3-mid", Path(shards[0]), tuple(map(Path, shards)), "cuda", geom,
                                        reference=ref), cache)
        for d in depths:
            reps_ = llama.timed(lp, Workload("decode", d, n_tokens, ()), reps)
            out[f"llamacpp_decode@{d}"] = {"tok_s": tps(reps_), "command": reps_[0].command}
        out["llamacpp_prefill512@0"] = {"tok_s": tps(llama.timed(lp, Workload("prefill", 0, 512, ()), reps))}
    except Exception as exc:
        out["llamacpp_error"] = f"{type(exc).__name__}: {exc}"
    spark = registry.load("sparkinfer")
    for dtype, graph in (("bfloat16", False), ("bfloat16", True), ("float32", True)):
        key = f"sparkinfer_{dtype}{'_graph' if graph else '_eager'}"
        try:
            sp = spark.prepare(EngineTarget("k3-mid", Path(shards[0]), tuple(map(Path, shards)), "cuda", geom,
                                            options={"dtype": dtype, "cuda_graph": graph}), cache)
            out[key] = {"identity_extra": sp.identity.extra}
            for d in depths:
                reps_ = _split_reps(spark, sp, "decode", d, n_tokens, ids, reps)
                out[key][f"decode@{d}"] = {"tok_s": tps(reps_), "tokens_equal_across_reps":
                                           all(r.token_ids == reps_[0].token_ids for r in reps_)}
            reps_ = _split_reps(spark, sp, "prefill", 0, 512, ids, reps)
            out[key]["prefill512@0"] = {"tok_s": tps(reps_)}
            spark.close(sp)
        except Exception as exc:
            out[key] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
    return out


def _register() -> None:
    """Without a pip install on the box the entry points are absent: inject the bundled engines by spec."""
    for name, spec in (("llamacpp", "engines.llamacpp.engine:LlamaCppEngine"),
                       ("sparkinfer", "engines.sparkinfer.engine:SparkInferEngine")):
        if name not in registry.available():
            registry.inject(name, spec)


def main() -> None:
    _register()
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-git", required=True)
    ap.add_argument("--llama-commit", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--depths", default="0,32768")
    ap.add_argument("--n-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip", default="")
    a = ap.parse_args()
    out = Path(a.out)
    cache, work = Path("/tmp/sbcache"), Path("/tmp/sbwork")
    work.mkdir(parents=True, exist_ok=True)
    lock = load_lock("reference.lock")
    flags = lock.references["llama-cpp-python-0-3-36"].cmake_flags
    ref = GitReference(kind="git", repo=f"file://{Path(a.llama_git).resolve()}", ref="refs/heads/vendored",
                       commit=a.llama_commit, base_commit=a.llama_commit, cmake_flags=flags)
    from scoreboard import environment

    RESULTS["environment"] = environment.fingerprint()
    build(ref, cache)
    if "gate" not in a.skip:
        gate_k3_mini(ref, cache, work)
    mid = gen_mid(work)
    if "shards" in mid:
        decode_mid(ref, cache, mid["shards"], [int(x) for x in a.depths.split(",")], a.n_tokens, a.reps)
    (out / "gpu_results.json").write_text(json.dumps(RESULTS, indent=1, default=str))


if __name__ == "__main__":
    main()
