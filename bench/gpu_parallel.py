"""GPU check (not a test) of the multi-process and split-mode code paths on whatever GPUs the box has.

1. builds the pinned llama.cpp for CUDA (source: a git mirror of the sdist's vendored tree, since the GPU
   box cannot reach PyPI — pass --llama-git/--llama-commit);
2. llama.cpp's split modes (-sm none/layer/row) through the reference engine: the dumper's and
   llama-bench's echoed mode, KL between the modes' logits, decode tok/s per mode;
3. the NCCL path of the harness: torchrun with one rank per visible GPU, RankGroup.from_env("cuda"),
   the expert-parallel sparkinfer (prepare_rank), its logits against the single-process engine, every
   rank's fingerprint, and rank-0 timing around NCCL barriers;
4. a whole round (scoreboard.round.run_round) of k3-mini on this box's GPUs, sealed into a scratch
   rounds/ directory: the receipt comes back in --out.

    python3 bench/gpu_parallel.py --llama-git .carry/llama.git --llama-commit SHA --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import tomlkit

from scoreboard import registry
from scoreboard.engine import EngineTarget, Geometry, LogitsRequest, Workload
from scoreboard.gate import gate_positions, kl_rows
from scoreboard.lockfile import GitReference, load_lock
from scoreboard.weights.verify import ensure_generated

from sections import RESULTS, SAVE_TO, section  # bench/ is the script's own folder


def tps(reps) -> list[float]:
    return [round(r.n_tokens / (r.ns / 1e9), 2) for r in reps]


def reference(a) -> GitReference:
    flags = list(load_lock("reference.lock").references["llama-cpp-python-0-3-36"].cmake_flags)
    return GitReference(kind="git", repo=f"file://{Path(a.llama_git).resolve()}", ref="refs/heads/main",
                        commit=a.llama_commit, base_commit=a.llama_commit, cmake_flags=flags)


@section("build")
def build(ref, cache):
    from engines.llamacpp.engine import prepare_build

    b = prepare_build(ref, cache, device="cuda", ref_id="llama-cpp-python-0-3-36-git-mirror")
    return {"bin_dir": str(b.bin_dir), "durations_s": b.manifest.get("durations_s"), "rebuilt": b.rebuilt}


@section("split_modes")
def split_modes(ref, cache, shards):
    geom = Geometry(2048, 512, 512, 16)
    rng = np.random.default_rng(0)
    ids = tuple(int(x) for x in rng.integers(0, 510, 1100))
    pos = tuple(sorted({p for d in (64, 512, 1024) for p in gate_positions(d, 32)}))
    llama = registry.load("llamacpp")
    out, logits = {}, {}
    for sm in ("none", "layer", "row"):
        try:
            t = EngineTarget("k3-mini-h200", shards[0], tuple(shards), "cuda", geom, reference=ref,
                             options={"split_mode": sm})
            p = llama.prepare(t, cache)
            res = llama.logits(p, LogitsRequest(ids[:1024], pos, geom))
            logits[sm] = res.logits
            reps = llama.timed(p, Workload("decode", 1024, 32, ()), 3)
            out[sm] = {"dumper_command_tail": res.command[-2:],
                       "bench_split_mode": p.handle.last_record.get("split_mode"),
                       "bench_command_tail": reps[0].command[-8:], "decode@1024_tok_s": tps(reps)}
        except Exception as exc:
            out[sm] = {"error": f"{type(exc).__name__}: {str(exc)[:600]}"}
    for sm in [m for m in ("layer", "row") if m in logits and "none" in logits]:
        kl = kl_rows(logits["none"], logits[sm])
        out[f"kl_none_vs_{sm}"] = {"mean": float(np.mean(kl)), "max": float(np.max(kl)),
                                   "bitwise_equal": bool(np.array_equal(logits["none"], logits[sm]))}
    return out


RANK_JOB = r'''
import json, sys, time
from pathlib import Path
import numpy as np, torch
from scoreboard.worker.distributed import RankGroup
from scoreboard.engine import EngineTarget, Geometry, LogitsRequest, Workload
from scoreboard.round.clock import in_process_reps
from engines.sparkinfer.engine import SparkInferEngine
from engines.sparkinfer.parallel import prepare_rank
args = json.loads(sys.argv[1])
g = RankGroup.from_env("cuda", 300)
t0 = time.perf_counter()
geom = Geometry(2048, 512, 512, 4)
shards = tuple(Path(p) for p in args["shards"])
target = EngineTarget("k3-mini-h200", shards[0], shards, "cuda", geom, options={"dtype": "float16"}, ranks=g.world)
prep = prepare_rank(target)
load_s = time.perf_counter() - t0
eng = SparkInferEngine()
ids = tuple(args["ids"])
res = eng.logits(prep, LogitsRequest(ids[:1024], tuple(args["pos"]), geom))
g.agree_bytes(np.ascontiguousarray(res.logits).tobytes(), "the logits")
fps = g.fingerprints()
_wl, _rev = Workload.split("decode", 1024, 32, ids)
reps = in_process_reps(eng, prep, _wl, [_rev] * 4, warmup=1, barrier=g.barrier)
g.agree([r.token_ids for r in reps], "timed tokens")
peak = torch.cuda.max_memory_allocated() / 2**30
if g.rank == 0:
    np.save(args["out"] + "/ranked_logits.npy", res.logits)
    Path(args["out"] + "/ranked.json").write_text(json.dumps({
        "world": g.world, "backend": g.backend, "load_s": load_s, "identity_parallel": prep.identity.extra["parallel"],
        "notes": {k: v for k, v in prep.notes.items() if k != "ownership"},
        "fingerprints": [fp["rank"] for fp in fps], "decode@1024_tok_s": [32 / (r.ns / 1e9) for r in reps],
        "peak_gib_rank0": peak}, default=str))
g.close()
'''


@section("nccl_ranked")
def nccl_ranked(cache, shards, work):
    import torch

    from scoreboard.worker.distributed import launch_command

    world = torch.cuda.device_count()
    rng = np.random.default_rng(0)
    ids = [int(x) for x in rng.integers(0, 510, 1100)]
    pos = sorted({p for d in (64, 512, 1024) for p in gate_positions(d, 32)})
    job = work / "rank_job.py"
    job.write_text(RANK_JOB)
    cmd = launch_command(world, "rank_job", [json.dumps({"shards": [str(s) for s in shards], "ids": ids, "pos": pos,
                                                          "out": str(work)})])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(work), os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    out = {"world": world, "rc": proc.returncode, "wall_s": round(time.perf_counter() - t0, 1),
           "tail": (proc.stdout + proc.stderr)[-1500:]}
    if proc.returncode == 0:
        out.update(json.loads((work / "ranked.json").read_text()))
        spark = registry.load("sparkinfer")
        geom = Geometry(2048, 512, 512, 4)
        sp = spark.prepare(EngineTarget("k3-mini-h200", shards[0], tuple(shards), "cuda", geom,
                                        options={"dtype": "float16"}), cache)
        single = spark.logits(sp, LogitsRequest(tuple(ids[:1024]), tuple(pos), geom)).logits
        ranked = np.load(work / "ranked_logits.npy")
        kl = kl_rows(single, ranked)
        out["vs_single_process"] = {"max_abs_diff": float(np.max(np.abs(single - ranked))), "kl_max": float(kl.max()),
                                    "bitwise_equal": bool(np.array_equal(single, ranked))}
    return out


@section("round")
def gpu_round(ref, cache, a):
    import torch

    from scoreboard.round.run import RoundOptions, run_round

    n = torch.cuda.device_count()
    doc = tomlkit.parse(Path("reference.lock").read_text())
    doc["nodes"]["h200-local"] = {"description": "this box", "gpu_model": "H200", "gpu_count": n,
                                  "gpu_memory_gib": 139.5, "cpu_arch": "x86_64", "min_cpu_cores": 8}
    doc["references"]["llamacpp-vendored-git"] = {"kind": "git", "repo": ref.repo, "ref": ref.ref,
                                                   "commit": ref.commit, "base_commit": ref.base_commit,
                                                   "cmake_flags": list(ref.cmake_flags)}
    t = json.loads(json.dumps(doc["targets"]["k3-mini-cpu"].unwrap()))
    t.update(description="k3-mini on this box's GPUs", node="h200-local", reference="llamacpp-vendored-git",
             device="cuda", geometry={"n_ctx": 2048, "n_batch": 512, "n_ubatch": 512, "n_threads": 4},
             speed={"warmup_reps": 1, "reps": 3, "blocks": 4, "timeout_s": 300},
             parallel={"ranks": n, "reference_split_mode": "layer"})
    doc["targets"]["k3-mini-h200"] = t
    work = Path(a.work)
    lock = work / "reference.lock"
    lock.write_text(tomlkit.dumps(doc))
    rounds = work / "rounds"
    out = run_round(RoundOptions(target="k3-mini-h200", lock_path=lock, rounds_dir=rounds, cache_dir=cache, seed=3,
                                 candidate_options={"dtype": "float16"},
                                 require_calibration=False))  # an ad-hoc scratch target: never calibrated
    r = out.receipt
    if out.path is not None:
        shutil.copy(out.path, OUT / "gpu_round_receipt.json")
    speed = {}
    for m in (r.get("speed") or {}).get("metrics", []):
        for arm, v in m["arms"].items():
            tok = [n / (s / 1e9) for b in v["blocks"] for s, n in zip(b["samples_ns"], b["n_tokens"])]
            speed[f"{m['phase']}@{m['depth']}:{arm}"] = round(float(np.median(tok)), 1)
    return {"status": r["status"], "exit": out.exit_code, "aborted": r.get("aborted"),
            "verdict": (r.get("verdict") or {}).get("label"), "gate_pass": (r.get("gate") or {}).get("pass"),
            "gate": [{k: d[k] for k in ("depth", "kl_mean", "kl_p99", "top1")} for d in (r.get("gate") or {}).get("depths", [])],
            "median_tok_s": speed, "parallel": r["environment"].get("parallel"), "stage_seconds": r.get("stage_seconds"),
            "ranks": [fp.get("rank") for fp in r["environment"].get("ranks", [])], "commands": r.get("commands")}


def main() -> None:
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-git", required=True)
    ap.add_argument("--llama-commit", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/sb-gpu")
    ap.add_argument("--skip", default="")
    a = ap.parse_args()
    OUT = Path(a.out)
    SAVE_TO.append(OUT / "gpu_parallel.json")
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "cache"
    ref = reference(a)
    skip = set(a.skip.split(","))
    build(ref, cache)
    shards = ensure_generated(load_lock("reference.lock"), "k3-mini", cache)
    if "split" not in skip:
        split_modes(ref, cache, shards)
    if "nccl" not in skip:
        nccl_ranked(cache, shards, work)
    if "round" not in skip:
        gpu_round(ref, cache, a)
    print(json.dumps(RESULTS.get("seconds")), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
