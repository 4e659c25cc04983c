"""Compare sparkinfer's logits with the pinned llama.cpp's, the way the round's gate does.

Both engines go through the registry (``llamacpp`` builds the target's pinned reference, cached), the
prompt is drawn like the round's (seeded, from the shipped corpus), every position 0..n-1 is compared in
float64 over the full vocabulary, and the target's gate windows are graded against its bars.

    python bench/compare_sparkinfer_llamacpp.py --preset k3-mini --preset k3-mini-smooth
    python bench/compare_sparkinfer_llamacpp.py --preset k3-mini --faults all
    python bench/compare_sparkinfer_llamacpp.py --preset k3-mini --json out.json

Prints per gate depth: KL(ref||cand) mean / p99 / max (nats) and top-1 agreement, the margin to each
bar, and the same statistics over position ranges.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from scoreboard import registry
from scoreboard.engine import EngineTarget, Geometry, LogitsRequest
from scoreboard.gate import gate_positions, grade_depth, kl_rows, top1_agreement
from scoreboard.lockfile import load_lock
from scoreboard.models.k3 import shard_paths
from scoreboard.round.prompt import draw_prompt
from scoreboard.weights.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
RANGES = ((0, 64), (64, 256), (256, 512), (512, 1024), (1024, 1 << 30))


def model_shards(preset: str, models_dir: Path) -> tuple[Path, ...]:
    """The preset's shards under models_dir/<preset>/, generated (deterministically) when missing."""
    from scoreboard.weights.generate import generate, shard_names
    from scoreboard.weights.presets import get_spec

    out = models_dir / preset
    names = shard_names(get_spec(preset))
    if not all((out / n).is_file() for n in names):
        generate(preset, out)
    return shard_paths(out / names[0])


def stats(kl: np.ndarray, top1: np.ndarray) -> dict[str, float]:
    return {"rows": int(kl.size), "kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)),
            "kl_max": float(kl.max()), "top1": float(top1.mean())}


def compare(shards: tuple[Path, ...], target_id: str, lock, n_tokens: int, seed: int, cache_dir: Path,
            faults: list[str], ref_options: dict) -> dict:
    t = lock.targets[target_id]
    geom = Geometry(**t.geometry)
    pol = t.gate
    n = max(n_tokens, max(pol.depths), max(m.depth for m in t.metrics))
    ids = draw_prompt(Tokenizer.from_gguf(shards[0]), n, seed).token_ids
    positions = tuple(range(n))

    def target(options: dict, reference=None) -> EngineTarget:
        return EngineTarget(target_id, shards[0], shards, t.device, geom, reference=reference, options=options)

    ref_engine = registry.load(t.reference_engine)
    ref_t = target({"reference_id": t.reference, **ref_options}, lock.references[t.reference])
    ref_prep = ref_engine.prepare(ref_t, cache_dir)
    t0 = time.perf_counter()
    ref = ref_engine.logits(ref_prep, LogitsRequest(ids, positions, geom)).logits
    t_ref = time.perf_counter() - t0
    cand_engine = registry.load(t.candidate_engine)
    out: dict = {"target": target_id, "model": str(shards[0]), "n_positions": n, "seed": seed,
                 "geometry": geom.as_dict(), "bars": pol.model_dump(), "reference_s": t_ref, "runs": {}}
    for fault in [None, *faults]:
        prep = cand_engine.prepare(target({"faults": [fault] if fault else []}), cache_dir)
        t0 = time.perf_counter()
        cand = cand_engine.logits(prep, LogitsRequest(ids, positions, geom)).logits
        dt = time.perf_counter() - t0
        kl, t1 = kl_rows(ref, cand), top1_agreement(ref, cand)
        run: dict = {"candidate_s": dt, "depths": [], "ranges": []}
        for d in pol.depths:
            pos = gate_positions(d, pol.rows_per_depth)
            g = grade_depth(d, pos, ref[pos], cand[pos], pol)
            run["depths"].append({**g.as_dict(), "margin": {"kl_mean": pol.kl_max / max(g.kl_mean, 1e-300),
                                                            "kl_p99": pol.kl_p99_max / max(g.kl_p99, 1e-300),
                                                            "top1": g.top1 - pol.top1_min}})
        for lo, hi in RANGES:
            if lo < n:
                run["ranges"].append({"lo": lo, "hi": min(hi, n), **stats(kl[lo:hi], t1[lo:hi])})
        run["all"] = stats(kl, t1)
        out["runs"][fault or "correct"] = run
    return out


def report(res: dict) -> None:
    bars = res["bars"]
    print(f"\n== {res['model']}  target {res['target']}  {res['n_positions']} positions  seed {res['seed']}  "
          f"geometry {res['geometry']}")
    print(f"   bars: mean KL <= {bars['kl_max']}, p99 KL <= {bars['kl_p99_max']}, top-1 >= {bars['top1_min']} "
          f"({bars['rows_per_depth']} rows per depth)")
    for name, run in res["runs"].items():
        print(f"-- {name}  (candidate {run['candidate_s']:.2f} s, reference {res['reference_s']:.2f} s)")
        for d in run["depths"]:
            m = d["margin"]
            print(f"   depth {d['depth']:>6}: KL mean {d['kl_mean']:.3e} p99 {d['kl_p99']:.3e} max {d['kl_max']:.3e} "
                  f"top-1 {d['top1']:.4f}  {'PASS' if d['pass'] else 'FAIL'}  margin: mean x{m['kl_mean']:.3g} "
                  f"p99 x{m['kl_p99']:.3g} top-1 {m['top1']:+.4f}")
        for r in run["ranges"]:
            print(f"   [{r['lo']:>5},{r['hi']:>5}): KL mean {r['kl_mean']:.3e} p99 {r['kl_p99']:.3e} "
                  f"max {r['kl_max']:.3e} top-1 {r['top1']:.4f}")


def main(argv: list[str] | None = None) -> int:
    from scoreboard.cache import cache_dir
    from engines.sparkinfer.faults import GATE_FAULTS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", action="append", help="generated model preset (repeatable); default k3-mini")
    ap.add_argument("--model", type=Path, help="first shard of an existing kimi-k3 GGUF instead of a preset")
    ap.add_argument("--target", default="k3-mini-cpu", help="lock target giving geometry, bars and reference")
    ap.add_argument("--lock", type=Path, default=REPO / "reference.lock")
    ap.add_argument("--models-dir", type=Path, default=Path("/tmp/scoreboard-models"))
    ap.add_argument("--cache-dir", type=Path, default=None, help="reference build cache (default: scoreboard's)")
    ap.add_argument("-n", "--n-tokens", type=int, default=1024, help="positions compared (>= the gate depths)")
    ap.add_argument("--seed", type=int, default=0, help="prompt seed")
    ap.add_argument("--faults", nargs="*", default=[], help="fault names to run too, or 'all'")
    ap.add_argument("--flash-attn", type=int, default=None, help="reference flash_attn option (engine default if unset)")
    ap.add_argument("--json", type=Path, help="also write the results as JSON here")
    a = ap.parse_args(argv)
    faults = list(GATE_FAULTS) if a.faults == ["all"] else a.faults
    lock = load_lock(a.lock)
    models = [shard_paths(a.model)] if a.model else [model_shards(p, a.models_dir) for p in (a.preset or ["k3-mini"])]
    ref_options = {} if a.flash_attn is None else {"flash_attn": a.flash_attn}
    results = []
    for shards in models:
        res = compare(shards, a.target, lock, a.n_tokens, a.seed, cache_dir(a.cache_dir), faults,
                      ref_options)
        report(res)
        results.append(res)
    if a.json:
        a.json.write_text(json.dumps(results, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
