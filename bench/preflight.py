"""A round's preflight alone, for a target: the weights verified (generated first where the lock says they are
generated), the fit, the candidate worker's imports, and the reference built at its pin, in the round's own
cache and build keys. A box then starts its first round with everything in place, and work that does not
need the GPU (a llama.cpp CUDA build takes ~4 minutes) can run beside something else.

    python bench/preflight.py k3-gpu-h200 [--renew-reference-anchor]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scoreboard.lockfile import load_lock
from scoreboard.round import candidate as cand_mod
from scoreboard.round.run import Round, RoundOptions, Sources, preflight


def report(kind: str, **kw: Any) -> None:
    msg = kw.get("message") or kw.get("name") or ""
    print(f"[{time.strftime('%H:%M:%S')}] {kind}: {msg}", flush=True)


def main(target: str, renew: bool = False) -> int:
    opts = RoundOptions(target=target, seal=False, require_calibration=False, renew_reference_anchor=renew)
    lock = load_lock(opts.lock_path)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sb-preflight-") as scratch:
        source = cand_mod.resolve("main", Path(scratch), cand_mod.HARNESS_ROOT, lock.main_branch)
        rnd = Round(opts, lock, report, Path(scratch), Sources(source))
        preflight(rnd)
    print(f"preflight of {target} done in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--renew-reference-anchor"]
    raise SystemExit(main(args[0] if args else "k3-mini-cpu", "--renew-reference-anchor" in sys.argv[1:]))
