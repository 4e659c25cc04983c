"""Parent side of the fresh-process workers: spawn, bound by wall clock, read the result file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engine import EngineTarget
from ..errors import EngineError, TransientError
from ..worker import target_to_dict
from .candidate import HARNESS_ROOT

# Never visible to a candidate process: signing keys and tokens (CASE-STUDY: env -u POLARIS_API_KEY).
SECRET_ENV = ("SCOREBOARD_SIGNING_KEY", "GH_TOKEN", "GITHUB_TOKEN", "HF_TOKEN")


@dataclass
class WorkerResult:
    body: dict[str, Any]
    wall_ns: int
    command: list[str]


def worker_env(import_root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(import_root), str(HARNESS_ROOT)])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_worker(engine: str, import_root: Path, target: EngineTarget, cache_dir: Path, op: str,
               payload: dict[str, Any], timeout_s: float, workdir: Path | None = None) -> WorkerResult:
    """Run one engine operation in a fresh process; raise EngineError/TransientError on failure."""
    tmp = Path(tempfile.mkdtemp(prefix="sb-worker-", dir=workdir))
    req = {"engine": engine, "target": target_to_dict(target), "cache_dir": str(cache_dir), "op": op, **payload}
    (tmp / "request.json").write_text(json.dumps(req))
    cmd = [sys.executable, "-m", "scoreboard.worker", str(tmp / "request.json"), str(tmp / "result.json")]
    t0 = time.perf_counter_ns()
    try:
        proc = subprocess.run(cmd, env=worker_env(import_root), cwd=tmp, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise EngineError(f"{engine} worker ({op}) exceeded the {timeout_s:.0f} s timeout",
                          "raise speed.timeout_s in the target policy only if the workload is really that slow")
    wall = time.perf_counter_ns() - t0
    log = tmp / "worker.log"
    log.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    res = tmp / "result.json"
    if not res.exists():
        tail = (proc.stderr or proc.stdout)[-2000:]
        raise EngineError(f"{engine} worker ({op}) crashed with exit {proc.returncode} and no result; log {log}\n{tail}")
    body = json.loads(res.read_text())
    if not body.get("ok"):
        cls = TransientError if body.get("transient") else EngineError
        detail = body.get("traceback") or ""
        raise cls(f"{engine} ({op}) failed: {body.get('error')}\n{detail[-1500:]}".rstrip(), body.get("hint"))
    return WorkerResult(body, wall, cmd)
