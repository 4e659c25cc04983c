"""Is sparkinfer's output a function of its input on the GPU? Repeated greedy decodes and prefill logits of one
prompt, with the routed sum as it is (a fixed order) and as step 2 of the ladder had it (one index_add_ over
repeated rows: atomics on CUDA). A diagnosis, not a round.

    python bench/h200_determinism.py --target k3-gpu-h200 --trials 12 --out det.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch

import engines.sparkinfer.model as m
from engines.sparkinfer.engine import SparkInferEngine, greedy_decode
from scoreboard.engine import EngineTarget, Geometry, LogitsRequest
from scoreboard.lockfile import load_lock
from scoreboard.round.prompt import draw_prompt
from scoreboard.weights.tokenizer import Tokenizer
from scoreboard.weights.verify import ensure_generated

FIXED = m.K3Model._held_experts


def atomic_sum(self, lw, xin, sel, wts, lo, hi):
    """Step 2's routed sum: the same grouped products, then one index_add_ over the repeated token rows."""
    t, k = sel.shape
    if t == 1:
        return FIXED(self, lw, xin, sel, wts, lo, hi)
    c = self.cfg
    flat = sel.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=c.n_expert).tolist()
    idx, rows = order, order // k
    offs = torch.tensor(counts, device=xin.device).cumsum(0).to(torch.int32)
    xi = xin[rows]
    a = m.situ_joint(m.grouped_linear(xi, lw["exps_in"], offs, counts), c.situ_beta, c.situ_linear_beta)
    y = m.grouped_linear(a, lw["ffn_down_exps"], offs, counts) * wts.reshape(-1)[idx, None]
    return torch.zeros(t, xin.shape[1], device=xin.device).index_add_(0, rows, y)


def trials(engine, prep, ids, depth, n_tokens, count) -> dict:
    outs, digests = [], []
    for _ in range(count):
        outs.append(tuple(greedy_decode(prep, ids, depth, n_tokens)))
        geom = Geometry(n_ctx=depth + 16, n_batch=512, n_ubatch=512, n_threads=1)
        lg = engine.logits(prep, LogitsRequest(tuple(ids[:depth]), (depth - 1,), geom)).logits
        digests.append(hashlib.sha256(lg.tobytes()).hexdigest()[:16])
    return {"trials": count, "distinct_token_outputs": len(set(outs)), "distinct_logit_bytes": len(set(digests))}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="k3-gpu-h200")
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    lock = load_lock(Path("reference.lock"))
    t = lock.targets[args.target]
    shards = ensure_generated(lock, t.weights)
    depth, n = 1024, 64
    ids = draw_prompt(Tokenizer.from_gguf(shards[0]), depth + n, seed=7).token_ids
    geom = Geometry(n_ctx=depth + n + 16, n_batch=512, n_ubatch=512, n_threads=1)
    engine = SparkInferEngine()
    prep = engine.prepare(EngineTarget(args.target, shards[0], tuple(shards), "cuda", geom,
                                       options=dict(t.candidate_options or {})), Path("unused"))
    res = {"target": args.target, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "fixed_order": trials(engine, prep, ids, depth, n, args.trials)}
    m.K3Model._held_experts = atomic_sum
    res["index_add"] = trials(engine, prep, ids, depth, n, args.trials)
    m.K3Model._held_experts = FIXED
    print(json.dumps(res, indent=1))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
