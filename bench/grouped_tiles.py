"""The prefill's routed-expert products (`kernels.grouped_mm`) over a grid of tiles, alone: one 2048-token call's
products at a preset's widths (gate|up [X, 2F, lat] and down [X, lat, F], f16), rows grouped by expert as a
uniform top-k routing spreads them, timed between CUDA events against the current tile, with the output's distance
from it. A diagnosis to pick a tile from, not a round.

    python bench/grouped_tiles.py --preset k3-wide --out gmm.json
    TRITON_INTERPRET=1 python bench/grouped_tiles.py --device cpu --quick      # plumbing only
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from engines.sparkinfer import kernels as K  # noqa: E402
from mla_depth import with_constants  # noqa: E402
from scoreboard.weights.presets import get_spec  # noqa: E402

# (GMM_BM, GMM_BN, GMM_BK, warps, stages)
GRID = [(64, 64, 32, 4, 3), (128, 128, 32, 8, 3), (128, 128, 64, 8, 3), (128, 64, 64, 4, 3), (64, 128, 64, 4, 3),
        (128, 256, 64, 8, 3), (64, 256, 64, 8, 3), (128, 128, 64, 4, 4), (64, 64, 64, 4, 4), (128, 128, 32, 4, 4),
        (256, 128, 64, 8, 3), (128, 128, 64, 8, 4)]
QUICK = [(64, 64, 32, 4, 3), (32, 32, 32, 4, 2)]


def event_ms(fn: Callable[[], Any], cuda: bool, reps: int = 5) -> float:
    fn()
    if not cuda:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b))
    return best


def products(preset: str, tokens: int, dev: str, quick: bool) -> dict[str, tuple]:
    """{name: (x [n, K], w [X, N, K], counts)} for one call's two grouped products."""
    c = get_spec(preset).config()
    n_exp, k_used, lat, f = c.n_expert, c.n_expert_used, c.expert_latent_length, c.expert_ff
    if quick:
        n_exp, lat, f = 4, 64, 96
    gen = torch.Generator().manual_seed(3)
    sel = torch.stack([torch.randperm(n_exp, generator=gen)[:min(k_used, n_exp)] for _ in range(tokens)])
    counts = torch.bincount(sel.reshape(-1), minlength=n_exp).tolist()
    n = sum(counts)

    def mat(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.05).to(dev).half()

    return {"gate_up": (mat(n, lat), mat(n_exp, 2 * f, lat), counts), "down": (mat(n, f), mat(n_exp, lat, f), counts)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", action="append")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    res: dict[str, Any] = {"gpu": torch.cuda.get_device_name() if cuda else "none", "triton": K.triton.__version__,
                           "tokens": args.tokens, "presets": {}}
    for preset in args.preset or ["k3-wide"]:
        rows = []
        for name, (x, w, counts) in products(preset, 64 if args.quick else args.tokens, args.device, args.quick).items():
            flop = 2 * x.shape[0] * w.shape[1] * w.shape[2]
            want = K.grouped_mm(x, w, counts)
            for bm, bn, bk, warps, stages in QUICK if args.quick else GRID:
                consts = {"GMM_BM": bm, "GMM_BN": bn, "GMM_BK": bk, "WARPS.grouped_mm": warps,
                          "STAGES.grouped_mm": stages}
                try:
                    ms = with_constants(K, consts, lambda: event_ms(lambda: K.grouped_mm(x, w, counts), cuda))
                    diff = with_constants(K, consts, lambda: float(
                        (K.grouped_mm(x, w, counts) - want).norm() / want.norm()))
                    rec = {"product": name, **consts, "ms": round(ms, 3), "tflop_s": round(flop / ms / 1e9, 1),
                           "rel_vs_current": diff}
                except Exception as exc:  # noqa: BLE001 - a tile that does not compile is a result too
                    rec = {"product": name, **consts, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                rows.append(rec)
                print(json.dumps(rec), flush=True)
        res["presets"][preset] = rows
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
