"""Fresh-process engine worker: `python -m scoreboard.worker REQUEST.json RESULT.json`.

The parent (the round) writes a request, starts this module in a new process whose import path
puts the candidate's `engines/` first and the harness's own `scoreboard` second, and reads the
result file (never the worker's stdout). Timing is taken here by harness code (scoreboard.timing).
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from . import registry
from .engine import EngineTarget, Geometry, LogitsRequest, Workload
from .errors import ScoreboardError, TransientError
from .timing import time_reps


def target_from_dict(d: dict[str, Any]) -> EngineTarget:
    return EngineTarget(target_id=d["target_id"], model_path=Path(d["model_path"]),
                        shard_paths=tuple(Path(p) for p in d["shard_paths"]), device=d["device"],
                        geometry=Geometry(**d["geometry"]), reference=None, options=d.get("options", {}))


def target_to_dict(t: EngineTarget) -> dict[str, Any]:
    return {"target_id": t.target_id, "model_path": str(t.model_path), "shard_paths": [str(p) for p in t.shard_paths],
            "device": t.device, "geometry": t.geometry.as_dict(), "options": dict(t.options)}


def _handle(req: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    engine = registry.load(req["engine"])
    target = target_from_dict(req["target"])
    prepared = engine.prepare(target, Path(req["cache_dir"]))
    result: dict[str, Any] = {"identity": prepared.identity.as_dict(), "engine_module": type(engine).__module__,
                              "engine_file": sys.modules[type(engine).__module__].__file__}
    try:
        if req["op"] == "timed":
            runs = []
            for w in req["workloads"]:
                workload = Workload(w["phase"], w["depth"], w["n_tokens"], tuple(w["prompt_ids"]))
                reps = time_reps(engine, prepared, workload, reps=req["reps"], warmup=req["warmup"])
                runs.append([{"ns": r.ns, "n_tokens": r.n_tokens, "token_ids": r.token_ids} for r in reps])
            result["runs"] = runs
        elif req["op"] == "logits":
            files = []
            for i, q in enumerate(req["requests"]):
                r = engine.logits(prepared, LogitsRequest(tuple(q["token_ids"]), tuple(q["positions"]), target.geometry))
                path = out_dir / f"logits-{i}.npy"
                np.save(path, np.ascontiguousarray(r.logits))
                files.append({"path": str(path), "geometry": r.geometry.as_dict()})
            result["logits"] = files
        elif req["op"] == "greedy":
            greedy = []
            for w in req["workloads"]:
                workload = Workload(w["phase"], w["depth"], w["n_tokens"], tuple(w["prompt_ids"]))
                state = engine.begin(prepared, workload)
                greedy.append([int(x) for x in engine.step(prepared, state)])
            result["greedy"] = greedy
        else:
            raise ScoreboardError(f"unknown worker op {req['op']!r}")
    finally:
        engine.close(prepared)
    return result


def main(argv: list[str]) -> int:
    req_path, res_path = Path(argv[0]), Path(argv[1])
    req = json.loads(req_path.read_text())
    try:
        body = {"ok": True, **_handle(req, res_path.parent)}
    except ScoreboardError as exc:
        body = {"ok": False, "error": exc.message, "hint": exc.hint, "transient": isinstance(exc, TransientError)}
    except MemoryError as exc:
        body = {"ok": False, "error": f"out of memory: {exc}", "hint": None, "transient": True}
    except Exception as exc:  # an engine bug: report with its traceback, not transient
        transient = "out of memory" in str(exc).lower() or "CUDA error" in str(exc)
        body = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(),
                "hint": None, "transient": transient}
    tmp = res_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body))
    tmp.replace(res_path)
    return 0 if body["ok"] else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
