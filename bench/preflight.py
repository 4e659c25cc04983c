"""A round's preflight alone, for a target: the reference built at its pin first (its engine's `prebuild`, which
needs no weights), then the round's own preflight: the weights verified (generated first where the lock says they
are generated), the fit, the candidate worker's imports, and the reference's build re-verified, in the round's own
cache and build keys. A box then starts its first round with everything in place, and work that does not need the
GPU (a llama.cpp CUDA build takes ~5 minutes) can run beside something else.

The build comes first because the weights may still be in the making beside it (bench/h200_ladder.sh generates
them in a process of its own): a preflight that verified the weights first waited for them, or generated them a
second time itself, and built only then (one H100 box, 2026-12-07: 171 s of weights, then 307 s of build).

    python bench/preflight.py k3-gpu-h200 [--renew-reference-anchor]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scoreboard import registry
from scoreboard.errors import ScoreboardError
from scoreboard.lockfile import load_lock
from scoreboard.round import candidate as cand_mod
from scoreboard.round.run import Round, RoundOptions, Sources, preflight
from scoreboard.weights.verify import weights_dir


def report(kind: str, **kw: Any) -> None:
    msg = kw.get("message") or kw.get("name") or ""
    print(f"[{time.strftime('%H:%M:%S')}] {kind}: {msg}", flush=True)


def build_first(rnd: Round) -> bool:
    """The target's reference built before its weights exist, where its engine can (`prebuild`): the target's
    shard paths as the lock names them, present or not. False where the engine has no such step."""
    ctx = rnd.ctx
    engine = registry.load(ctx.target.reference_engine)
    prebuild = getattr(engine, "prebuild", None)
    if prebuild is None:
        return False
    root = weights_dir(ctx.target.weights, ctx.cache_dir)
    shards = tuple(root / f.path for f in ctx.lock.weights[ctx.target.weights].files)
    report("step", message=f"building reference {ctx.target.reference_engine} before the weights")
    prebuild(ctx.targets(shards).reference, ctx.cache_dir, lambda msg, frac=None: report("step", message=msg))
    return True


def main(target: str, renew: bool = False) -> int:
    opts = RoundOptions(target=target, seal=False, require_calibration=False, renew_reference_anchor=renew)
    lock = load_lock(opts.lock_path)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sb-preflight-") as scratch:
        source = cand_mod.resolve("main", Path(scratch), cand_mod.HARNESS_ROOT, lock.main_branch)
        rnd = Round(opts, lock, report, Path(scratch), Sources(source))
        if build_first(rnd):
            print(f"reference built in {time.perf_counter() - t0:.1f} s", flush=True)
        preflight(rnd)
    print(f"preflight of {target} done in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--renew-reference-anchor"]
    try:
        raise SystemExit(main(args[0] if args else "k3-mini-cpu", "--renew-reference-anchor" in sys.argv[1:]))
    except ScoreboardError as exc:  # bad input or a failed step: its message and the fix, exit 1, as the CLI does
        print(f"error: {exc.message}" + (f"\n  fix: {exc.hint}" if exc.hint else ""), file=sys.stderr)
        raise SystemExit(exc.exit_code) from None
