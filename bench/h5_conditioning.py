"""Conditioning of generated kimi-k3 models under rounding (not a test): is a correct engine's answer stable?

Per model and prompt seed (prompts drawn like the round's, from the shipped corpus), every gate window of
``--depths`` (32 rows each, ending at the depth):

* noise floor: KL(sparkinfer float32, TF32 off || sparkinfer float16) (and bfloat16 with ``--bf16``);
* reference: KL(llama.cpp || sparkinfer float16) when ``--llama-git`` gives the reference source (CUDA);
* faults: KL(reference || sparkinfer float16 with each fault of engines/sparkinfer/faults.py), the
  reference being llama.cpp when built, else sparkinfer float32;
* routing: the top-k gap of the router scores (k-th minus (k+1)-th of sigmoid + bias) per MoE layer, over
  every position, and how many experts the prompt used.

Seeds run in order until ``--budget-s`` is spent (what was measured is written after every seed).

    python bench/h5_conditioning.py --reduced k3-gpu --seeds 4 --depths 64,512,1024 --out /tmp/h5
    python3 bench/h5_conditioning.py --preset k3-gpu --preset k3-wide --llama-git .devkit/llama.cpp \\
        --llama-commit SHA --seeds 20 --out $OUT
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scoreboard import registry  # noqa: E402
from scoreboard.cache import cache_dir  # noqa: E402
from scoreboard.engine import EngineTarget, Geometry, LogitsRequest  # noqa: E402
from scoreboard.gate import gate_positions, kl_rows, top1_agreement  # noqa: E402
from scoreboard.models.k3 import shard_paths  # noqa: E402
from scoreboard.round.prompt import draw_prompt  # noqa: E402
from scoreboard.weights.generate import generate, shard_names  # noqa: E402
from scoreboard.weights.presets import get_spec  # noqa: E402
from scoreboard.weights.tokenizer import Tokenizer  # noqa: E402

from engines.sparkinfer import model as spark_model  # noqa: E402
from engines.sparkinfer.faults import GATE_FAULTS  # noqa: E402


def reduced(name: str):
    """A small copy of a GPU preset with the same design (routing code, score init), for CPU iteration."""
    spec = get_spec(name)
    if name == "k3-gpu":
        e = 512
        return dataclasses.replace(spec, name=f"{name}-reduced", n_embd=e, n_head=4, q_lora_rank=256, kv_lora_rank=128,
                                   qk_nope_dim=64, rope_dim=64, v_head_dim=64, dense_ff=1024, expert_ff=256,
                                   expert_latent_length=256, n_shards=1, res_score_std=0.5 / e ** 0.5, weight_type="f32")
    e = 1024
    return dataclasses.replace(spec, name=f"{name}-reduced", n_embd=e, n_head=8, dense_ff=2048, n_expert=64,
                               n_expert_used=16, expert_ff=256, expert_latent_length=512, n_shards=1, weight_type="f32",
                               res_score_std=0.5 / e ** 0.5)


class RouterProbe:
    """Records, per MoE forward, the top-k gap of the router scores and the experts chosen."""

    def __init__(self):
        self.gaps: list[np.ndarray] = []
        self.used: set[tuple[int, int]] = set()
        self.per_token: list[int] = []
        self._orig = spark_model.K3Model._moe
        self.on = False

    def __enter__(self):
        probe = self

        def moe(model, lw, x):
            if probe.on:
                c = model.cfg
                logits = spark_model.linear(x, lw["ffn_gate_inp"])
                score = torch.sigmoid(logits) + lw["exp_probs_b"]
                top = torch.topk(score, c.n_expert_used + 1, -1)
                probe.gaps.append((top.values[:, -2] - top.values[:, -1]).float().cpu().numpy())
                layer = id(lw)
                for e in top.indices[:, :-1].unique().tolist():
                    probe.used.add((layer, e))
            return probe._orig(model, lw, x)

        spark_model.K3Model._moe = moe
        return self

    def __exit__(self, *exc):
        spark_model.K3Model._moe = self._orig


def pins(paths) -> list[dict]:
    """size + sha256 of each shard, as reference.lock pins them."""
    out = []
    for p in paths:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            for b in iter(lambda: f.read(1 << 24), b""):
                h.update(b)
        out.append({"path": p.name, "size": p.stat().st_size, "sha256": h.hexdigest()})
    return out


def _shards(spec, models: Path) -> tuple[tuple[Path, ...], dict]:
    """The spec's shards under models/<name>/ (generated, timed and pinned here when missing)."""
    out = models / spec.name
    names = shard_names(spec)
    info = {}
    if not all((out / n).is_file() for n in names):
        t0 = time.perf_counter()
        generate(spec, out)
        info["generate_s"] = round(time.perf_counter() - t0, 1)
        info["files"] = pins(shard_paths(out / names[0]))
    return shard_paths(out / names[0]), info


def _grade(ref: np.ndarray, cand: np.ndarray, windows: dict[int, list[int]], index: dict[int, int]) -> dict:
    out = {}
    for d, pos in windows.items():
        rows = [index[p] for p in pos]
        kl = kl_rows(ref[rows], cand[rows])
        out[str(d)] = {"kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)), "kl_max": float(kl.max()),
                       "top1": float(top1_agreement(ref[rows], cand[rows]).mean())}
    return out


def run_model(spec, a, models: Path, llama_ref, results: dict, deadline: float, save) -> None:
    res = results.setdefault(spec.name, {"seeds": {}})
    cfg = spec.config()
    res["n_params"] = cfg.n_params()
    paths, info = _shards(spec, models)
    res.update(info)
    depths = [int(d) for d in a.depths.split(",")]
    windows = {d: list(gate_positions(d, 32)) for d in depths}
    pos = sorted({p for w in windows.values() for p in w})
    index = {p: i for i, p in enumerate(pos)}
    n = max(depths)
    dev = a.device
    geom = Geometry(n + 64, 512, 512, 0)
    spark = registry.load("sparkinfer")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")

    def target(opts, reference=None):
        return EngineTarget(spec.name, paths[0], paths, dev, geom, reference=reference, options=opts)

    base = {"cuda_graph": False} if dev == "cuda" else {}
    llama = lp = None
    if llama_ref is not None:
        llama = registry.load("llamacpp")
        t0 = time.perf_counter()
        lp = llama.prepare(target({}, llama_ref), Path(a.cache))
        res["llama_prepare_s"] = round(time.perf_counter() - t0, 1)
    preps = {}
    tok = Tokenizer.from_gguf(paths[0])
    for seed in range(a.seeds):
        if time.perf_counter() > deadline:
            res["stopped"] = f"budget spent after {seed} seeds"
            break
        t0 = time.perf_counter()
        ids = draw_prompt(tok, n, seed).token_ids[:n]
        req = LogitsRequest(ids, tuple(pos), geom)
        row: dict = {}
        logits = {}
        with RouterProbe() as probe:
            for dt in ["float32", "float16"] + (["bfloat16"] if a.bf16 else []):
                key = dt
                if key not in preps:
                    preps[key] = spark.prepare(target({**base, "dtype": dt}), Path(a.cache))
                probe.on = dt == "float32"
                logits[dt] = spark.logits(preps[key], req).logits
                probe.on = False
            gaps = np.concatenate(probe.gaps)
            row["routing"] = {"gap_min": float(gaps.min()), "gap_p001": float(np.quantile(gaps, 0.001)),
                              "gap_median": float(np.median(gaps)), "experts_used": len(probe.used),
                              "experts_total": cfg.n_expert * len(cfg.moe_layers)}
        row["f32_vs_f16"] = _grade(logits["float32"], logits["float16"], windows, index)
        if a.bf16:
            row["f32_vs_bf16"] = _grade(logits["float32"], logits["bfloat16"], windows, index)
        if llama is not None:
            ref = llama.logits(lp, req).logits
            row["llama_vs_f16"] = _grade(ref, logits["float16"], windows, index)
            row["llama_vs_f32"] = _grade(ref, logits["float32"], windows, index)
        else:
            ref = logits["float32"]
        if seed < a.fault_seeds:
            row["faults"] = {}
            for f in GATE_FAULTS:
                if f not in preps:
                    preps[f] = spark.prepare(target({**base, "dtype": "float16", "faults": [f]}), Path(a.cache))
                row["faults"][f] = _grade(ref, spark.logits(preps[f], req).logits, windows, index)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        res["seeds"][str(seed)] = row
        print(f"{spec.name} seed {seed}: {row['seconds']} s  f32/f16 "
              + " ".join(f"{d}:{v['kl_mean']:.2e}/{v['top1']:.3f}" for d, v in row["f32_vs_f16"].items())
              + (" llama/f16 " + " ".join(f"{d}:{v['kl_mean']:.2e}/{v['top1']:.3f}" for d, v in
                                          row["llama_vs_f16"].items()) if "llama_vs_f16" in row else "")
              + f"  gap min {row['routing']['gap_min']:.3g} used {row['routing']['experts_used']}"
              + ("  faults min " + " ".join(f"{f[:8]}:{min(v['kl_mean'] for v in r.values()):.3g}"
                                            for f, r in row["faults"].items()) if "faults" in row else ""),
              flush=True)
        save()
    for p in preps.values():
        spark.close(p)
    res["summary"] = summarize(res)
    save()


def summarize(res: dict) -> dict:
    out: dict = {}
    seeds = res["seeds"]
    if not seeds:
        return out
    for key in ("f32_vs_f16", "f32_vs_bf16", "llama_vs_f16", "llama_vs_f32"):
        rows = [s[key] for s in seeds.values() if key in s]
        if rows:
            out[key] = {d: {"worst_kl_mean": max(r[d]["kl_mean"] for r in rows),
                            "worst_kl_p99": max(r[d]["kl_p99"] for r in rows),
                            "min_top1": min(r[d]["top1"] for r in rows),
                            "pooled_top1": float(np.mean([r[d]["top1"] for r in rows])), "seeds": len(rows)}
                        for d in rows[0]}
    faults = [s["faults"] for s in seeds.values() if "faults" in s]
    if faults:
        out["faults"] = {f: {d: {"min_kl_mean": min(r[f][d]["kl_mean"] for r in faults),
                                 "max_top1": max(r[f][d]["top1"] for r in faults)} for d in faults[0][f]}
                         for f in faults[0]}
    out["routing_gap_min"] = min(s["routing"]["gap_min"] for s in seeds.values())
    out["experts_used_min"] = min(s["routing"]["experts_used"] for s in seeds.values())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", action="append", default=[])
    ap.add_argument("--reduced", action="append", default=[], help="reduced-size copy of a preset (CPU)")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--fault-seeds", type=int, default=1 << 30, help="run the faults on the first N seeds")
    ap.add_argument("--depths", default="64,1024,4096")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--llama-git", type=Path)
    ap.add_argument("--llama-commit")
    ap.add_argument("--llama-lock", action="store_true", help="reference: the lock's pinned sdist (where pip works)")
    ap.add_argument("--cache", type=cache_dir, default=cache_dir())
    ap.add_argument("--models", type=Path, default=Path("/tmp/h5-models"))
    ap.add_argument("--budget-s", type=float, default=1e9,
                    help="all models together: stop starting seeds after this (shared equally, in order)")
    ap.add_argument("--build-only", action="store_true", help="build the reference and stop")
    ap.add_argument("--generate-only", action="store_true", help="generate (timed, pinned) and stop")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    for name, spec in (("llamacpp", "engines.llamacpp.engine:LlamaCppEngine"),
                       ("sparkinfer", "engines.sparkinfer.engine:SparkInferEngine")):
        if name not in registry.available():
            registry.inject(name, spec)
    a.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"argv": sys.argv[1:], "device": a.device}
    if a.device == "cuda":
        results["gpu"] = torch.cuda.get_device_name(0)

    def save():
        (a.out / "h5_conditioning.json").write_text(json.dumps(results, indent=1, sort_keys=True))

    specs = [get_spec(p) for p in a.preset] + [reduced(r) for r in a.reduced]
    if a.generate_only:
        for spec in specs:
            t0 = time.perf_counter()
            paths = generate(spec, a.models / spec.name)
            results[spec.name] = {"generate_s": round(time.perf_counter() - t0, 1)}
            results[spec.name]["files"] = pins(paths)
            print(f"{spec.name}: generated in {results[spec.name]['generate_s']} s", flush=True)
            (a.out / "h5_generate.json").write_text(json.dumps(results, indent=1, sort_keys=True))
        return 0
    end = time.perf_counter() + a.budget_s
    llama_ref = None
    if a.llama_git:
        from engines.llamacpp.engine import prepare_build
        from scoreboard.lockfile import GitReference, load_lock

        flags = list(load_lock(REPO / "reference.lock").references["llama-cpp-python-0-3-36"].cmake_flags)
        llama_ref = GitReference(kind="git", repo=f"file://{a.llama_git.resolve()}", ref="refs/heads/main",
                                 commit=a.llama_commit, base_commit=a.llama_commit, cmake_flags=flags)
        t0 = time.perf_counter()
        b = prepare_build(llama_ref, Path(a.cache), device=a.device, ref_id="llama-cpp-python-0-3-36-git-mirror")
        results["llama_build"] = {"s": round(time.perf_counter() - t0, 1), "rebuilt": b.rebuilt}
        save()
        if a.build_only:
            return 0
    elif a.llama_lock:
        from scoreboard.lockfile import load_lock

        llama_ref = load_lock(REPO / "reference.lock").references["llama-cpp-python-0-3-36"]
    for i, spec in enumerate(specs):
        try:
            now = time.perf_counter()
            run_model(spec, a, a.models, llama_ref, results, now + (end - now) / (len(specs) - i), save)
        except Exception as exc:  # one model's failure must not lose the other's numbers
            import traceback
            results.setdefault(spec.name, {})["error"] = traceback.format_exc()[-3000:]
            print(f"{spec.name}: {type(exc).__name__}: {exc}", flush=True)
            save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
