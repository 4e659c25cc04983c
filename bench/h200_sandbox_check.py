"""CUDA under the round's sandbox, on the box: sparkinfer's f16 Triton kernels and CUDA graph in a sandboxed worker
(an unprivileged host uid, rlimits, the box's cgroup if delegated), and the handshake's cost per timed rep with the
harness's null engine through the same launch, with the sandbox and without it (isolation "none").

Not a round: no gate, no seal. What it shows is whether a worker launched exactly as a round launches one computes
on the GPU, what the launch's isolation record says (host uid, /proc/sys, limits applied or not and why), and the
round trip a rep pays for the handshake. Runs on a CPU box too (`--device cpu`), where CUDA is not exercised.

usage: python3 bench/h200_sandbox_check.py --out DIR [--device cuda] [--reps 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

from scoreboard.engine import EngineTarget, Geometry, Workload  # noqa: E402
from scoreboard.round import sandbox  # noqa: E402
from scoreboard.round.clock import SessionPlan, run_session  # noqa: E402
from scoreboard.round.launch import run_worker  # noqa: E402
from scoreboard.weights.generate import generate  # noqa: E402
from scoreboard.worker.protocol import CheckedRun, GateOp, LogitsRows, TimedOp  # noqa: E402


def handshake(isolation: str, root: Path, target: EngineTarget, cache: Path, reps: int, work: Path) -> dict:
    """The null engine's round trips through one launch (an empty engines/: no candidate code on its path)."""
    empty = work / f"empty-{isolation}"
    (empty / "engines").mkdir(parents=True, exist_ok=True)
    w = Workload("decode", 64, 4, tuple(range(59)), reveal=5)
    reveals = [(v, tuple(1 + (v * 7 + j) % 200 for j in range(5))) for v in range(reps)]
    plan = SessionPlan([w], [reveals], warmup=0)
    t0 = time.perf_counter()
    run = run_worker("scoreboard-null", empty, target, cache, TimedOp.of([w], [reps]), 120, workdir=work,
                     session=lambda ch: run_session(ch, plan), isolation=isolation, harness_engine="null")
    ns = sorted(x.ns for x in run.session[0])
    return {"isolation": isolation, "reps": len(ns), "median_us": round(statistics.median(ns) / 1e3, 1),
            "p10_us": round(ns[len(ns) // 10] / 1e3, 1), "max_us": round(ns[-1] / 1e3, 1),
            "launch_s": round(time.perf_counter() - t0, 2), "record": run.isolation}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"bwrap": sandbox.check("bwrap")}
    work = Path(tempfile.mkdtemp(prefix="sb-check-"))
    try:
        shards = generate("k3-mini", work / "w")
        cache = work / "cache"
        opts = {"dtype": "float16", "cuda_graph": True} if a.device == "cuda" else {}
        target = EngineTarget("k3-mini-check", shards[0], tuple(shards), a.device,
                              Geometry(n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=4), options=opts)
        prompt = tuple(1 + (i * 31) % 500 for i in range(600))
        wl, revealed = Workload.split("decode", 512, 16, prompt, reveal=5)
        op = GateOp(requests=(LogitsRows.of(prompt[:520], [100, 511]),), checked=(CheckedRun.of(wl, [revealed]),))
        t0 = time.perf_counter()
        res = run_worker("sparkinfer", HERE, target, cache, op, 600, workdir=work, isolation="bwrap")
        r = res.result
        report["sparkinfer"] = {"launch_s": round(time.perf_counter() - t0, 2), "ok": r.ok,
                                "kernels": (r.identity or {}).get("extra", {}).get("kernels"),
                                "cuda_graph": (r.identity or {}).get("extra", {}).get("cuda_graph"),
                                "checked_ids": r.checked, "checked_logprobs": r.checked_logprobs,
                                "peak_memory": [p.as_dict() for p in r.peak_memory], "isolation": res.isolation}
        report["handshake"] = [handshake(iso, HERE, target, cache, a.reps, work) for iso in ("bwrap", "none")]
    finally:
        sandbox.remove_tree(work)
    (a.out / "sandbox-check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    s = report.get("sparkinfer", {})
    iso = s.get("isolation") or {}
    print(f"sparkinfer in the sandbox: ok {s.get('ok')}, {s.get('launch_s')} s, kernels: {str(s.get('kernels'))[:120]}")
    print(f"  host uid {iso.get('host_uid')}, privileges {iso.get('privileges')}, /proc/sys {iso.get('proc_sys')}, "
          f"limits {json.dumps(iso.get('limits'))[:300]}")
    for h in report.get("handshake", []):
        print(f"handshake ({h['isolation']}): median {h['median_us']} us, p10 {h['p10_us']}, max {h['max_us']}, "
              f"launch {h['launch_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
