"""Count the torch ops sparkinfer dispatches per decoded token and per prefill, by part of the model.

Every aten op an eager forward dispatches that is not a view or a no-op is at least one kernel launch on CUDA (a CUDA graph replays the
same kernels without the CPU's launch cost, but each still runs as its own kernel with its own prologue,
memory round trip and tail). The count per layer kind (KDA / MLA attention, dense / MoE FFN, residual
mixing) does not depend on widths, so counts measured on k3-mini (CPU, seconds) compose to the GPU presets'
layer mix. Routed experts in prefill are a loop over the experts hit, so their count is per expert hit.
These are op counts, not timings: no gate and no round ran on them.

    python bench/count_ops.py                # k3-mini, decode at depth 64 and prefill 512
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engines.sparkinfer import model as M
from engines.sparkinfer.engine import SparkInferEngine
from scoreboard.engine import EngineTarget, Geometry, Workload
from scoreboard.lockfile import load_lock
from scoreboard.round.prompt import draw_prompt
from scoreboard.weights.presets import get_spec
from scoreboard.weights.tokenizer import Tokenizer
from scoreboard.weights.verify import ensure_generated

PARTS = ("_kda", "_mla", "_dense", "_moe", "_experts", "_res_mix")


class Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = ["other"]
        self.by_part: collections.Counter = collections.Counter()
        self.by_op: collections.Counter = collections.Counter()
        self.by_part_op: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # views and no-op conversions launch nothing: count only ops that compute or copy. Under
        # inference_mode `Tensor.to` reaches the mode undecomposed, and its schema (it may return self) marks it
        # a view: a `to` that returned a new tensor converted, which is a kernel
        # an in-place op (mul_, copy_, index_copy_: named with a trailing underscore) returns its input and is a kernel
        converted = func.overloadpacket is torch.ops.aten.to and not (args and out is args[0])
        inplace = str(func.overloadpacket.__name__).endswith("_")
        if converted or (not func.is_view and (inplace or not (args and out is args[0]))):
            self.by_part[self.stack[-1]] += 1
            self.by_op[str(func.overloadpacket.__name__)] += 1
            self.by_part_op[f"{self.stack[-1]}:{func.overloadpacket.__name__}"] += 1
        return out


def instrument(counter: Counter) -> None:
    for name in PARTS:
        orig = getattr(M.K3Model, name)

        def wrapped(self, *a, _orig=orig, _name=name, **kw):
            counter.stack.append(_name)
            try:
                return _orig(self, *a, **kw)
            finally:
                counter.stack.pop()
        setattr(M.K3Model, name, wrapped)


def layer_mix(spec_name: str) -> dict[str, int]:
    cfg = get_spec(spec_name).config()
    mla = sum(1 for i in range(cfg.n_layer) if cfg.head_count_kv[i] > 0)
    return {"kda": cfg.n_layer - mla, "mla": mla, "dense": cfg.n_layer_dense_lead,
            "moe": cfg.n_layer - cfg.n_layer_dense_lead, "layers": cfg.n_layer, "experts": cfg.n_expert}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="k3-mini-cpu")
    ap.add_argument("--depth", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--dtype", help="override the target's candidate dtype (float16: the GPU targets' op structure)")
    ap.add_argument("--kernels", action="store_true",
                    help="route decode experts through the Triton kernels (CUDA's path; here in the interpreter)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    lock = load_lock(Path("reference.lock"))
    t = lock.targets[args.target]
    shards = ensure_generated(lock, t.weights)
    geom = Geometry(n_ctx=max(2048, args.depth + 64, args.prefill + 64), n_batch=512, n_ubatch=512, n_threads=1)
    engine = SparkInferEngine()
    opts = {k: v for k, v in dict(t.candidate_options).items() if k != "cuda_graph"}
    if args.dtype:
        opts["dtype"] = args.dtype
    prep = engine.prepare(EngineTarget(args.target, shards[0], tuple(shards), "cpu", geom,
                                       options=opts), Path("unused"))
    ids = draw_prompt(Tokenizer.from_gguf(shards[0]), max(args.depth + 1, args.prefill), seed=7).token_ids
    counter = Counter()
    instrument(counter)
    if args.kernels:  # each Triton launch is one kernel; the interpreter's own torch calls are not counted
        os.environ.setdefault("TRITON_INTERPRET", "1")
        from engines.sparkinfer import kernels as K

        def counted(launch, n):
            def run(*a, **kw):
                with torch.utils._python_dispatch._disable_current_modes():
                    out = launch(*a, **kw)
                counter.by_part[counter.stack[-1]] += n
                counter.by_part_op[f"{counter.stack[-1]}:triton"] += n
                return out
            return run
        K.decode_experts = counted(K.decode_experts, 2)
        K.linear_vec = counted(K.linear_vec, 1)
        K.route = counted(K.route, 1)
        K.situ_vec = counted(K.situ_vec, 1)
        K.res_mix = counted(K.res_mix, 1)
        K.kda_step = counted(K.kda_step, 1)
        K.mla_decode = counted(K.mla_decode, 4)
        K.mla_attend = counted(K.mla_attend, 1)
        K.chunk_scan = counted(K.chunk_scan, 1)
        K.grouped_mm = counted(K.grouped_mm, 1)
        m = prep.handle.model
        print(m.enable_kernels(), {k: f"{e:.2g}" for k, e in m.kernel_errors.items()}, file=sys.stderr)
    res = {}
    for phase, wl in (("decode", Workload.split("decode", args.depth, 1, ids[:args.depth + 1])),
                      ("prefill", Workload.split("prefill", 0, args.prefill, ids[:args.prefill]))):
        state = engine.begin(prep, wl[0])
        counter.by_part.clear()
        counter.by_op.clear()
        counter.by_part_op.clear()
        with counter:
            engine.step(prep, state, wl[1])
        res[phase] = {"total": sum(counter.by_part.values()), "by_part": dict(counter.by_part),
                      "top_ops": counter.by_op.most_common(12),
                      "by_part_op": dict(sorted(counter.by_part_op.items()))}
    spec = lock.weights[t.weights].spec
    res["layers"] = {s: layer_mix(s) for s in (spec, "k3-gpu", "k3-wide")}
    engine.close(prep)
    print(json.dumps(res, indent=1))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
