"""Fresh-process engine worker: `python -m scoreboard.worker REQUEST.json RESULT.json`.

The parent (the round) writes a request, starts this module in a new process whose import path
puts the candidate's `engines/` first and the harness's own `scoreboard` second, and reads the
result file (never the worker's stdout). Timing is taken here by harness code (scoreboard.timing).

Launched as W ranks by torchrun (a target with parallel.ranks = W, scoreboard.distributed), every rank
joins the process group the harness sets up, then runs the same op. Rank 0 writes RESULT.json, rank r
RESULT.rank{r}.json (its outcome), and every rank RESULT.rank{r}.pid when it starts, so that the parent
can name the rank that failed first and make sure no rank outlives the launch.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from . import registry
from .distributed import RankGroup, launched_rank, launched_world
from .engine import EngineTarget, Geometry, LogitsRequest, Workload
from .errors import EngineError, ScoreboardError, TransientError
from .timing import time_reps


def target_from_dict(d: dict[str, Any]) -> EngineTarget:
    return EngineTarget(target_id=d["target_id"], model_path=Path(d["model_path"]),
                        shard_paths=tuple(Path(p) for p in d["shard_paths"]), device=d["device"],
                        geometry=Geometry(**d["geometry"]), reference=None, options=d.get("options", {}),
                        ranks=int(d.get("ranks", 1)))


def target_to_dict(t: EngineTarget) -> dict[str, Any]:
    return {"target_id": t.target_id, "model_path": str(t.model_path), "shard_paths": [str(p) for p in t.shard_paths],
            "device": t.device, "geometry": t.geometry.as_dict(), "options": dict(t.options), "ranks": t.ranks}


# an op is one or more parts run in order on one prepared engine ("gate": the gate's logits and its checked
# greedy decode in one process, so the weights are loaded once for both)
OPS: dict[str, tuple[str, ...]] = {"timed": ("timed",), "logits": ("logits",), "greedy": ("greedy",),
                                   "gate": ("logits", "greedy")}


def _handle(req: dict[str, Any], out_dir: Path, group: RankGroup | None) -> dict[str, Any]:
    engine = registry.load(req["engine"])
    target = target_from_dict(req["target"])
    world = group.world if group else 1
    if target.ranks != world:
        raise EngineError(f"target wants {target.ranks} rank(s), this worker runs in a world of {world}",
                          "multi-rank targets are launched by the round through torchrun")
    if world > 1 and engine.max_ranks < world:
        raise EngineError(f"engine {req['engine']!r} runs as at most {engine.max_ranks} process(es), the target "
                          f"asks for {world}", "set parallel.ranks = 1 for this engine's targets")
    prepared = engine.prepare(target, Path(req["cache_dir"]))
    result: dict[str, Any] = {"identity": prepared.identity.as_dict(), "engine_module": type(engine).__module__,
                              "engine_file": sys.modules[type(engine).__module__].__file__}
    if group is not None:
        group.agree(json.dumps(result, sort_keys=True, default=str), "the engine identity")
        result["ranks"] = group.fingerprints()
    barrier = group.barrier if group is not None else None
    try:
        parts = OPS.get(req["op"])
        if parts is None:
            raise ScoreboardError(f"unknown worker op {req['op']!r}; known: {', '.join(OPS)}")
        if "timed" in parts:
            runs = []
            for w in req["workloads"]:
                workload = Workload(w["phase"], w["depth"], w["n_tokens"], tuple(w["prompt_ids"]))
                reps = time_reps(engine, prepared, workload, reps=req["reps"], warmup=req["warmup"], barrier=barrier)
                if group is not None:
                    group.agree([r.token_ids for r in reps], f"the timed {workload.phase} reps' token ids")
                runs.append([{"ns": r.ns, "n_tokens": r.n_tokens, "token_ids": r.token_ids} for r in reps])
            result["runs"] = runs
        if "logits" in parts:
            files = []
            for i, q in enumerate(req["requests"]):
                r = engine.logits(prepared, LogitsRequest(tuple(q["token_ids"]), tuple(q["positions"]), target.geometry))
                logits = np.ascontiguousarray(r.logits, dtype=np.float32)
                if group is not None:
                    group.agree_bytes(logits.tobytes(), "the logits")
                path = out_dir / f"logits-{i}.npy"
                if group is None or group.rank == 0:
                    np.save(path, logits)
                files.append({"path": str(path), "geometry": r.geometry.as_dict()})
            result["logits"] = files
        if "greedy" in parts:
            greedy = []
            for w in req["workloads"]:
                workload = Workload(w["phase"], w["depth"], w["n_tokens"], tuple(w["prompt_ids"]))
                state = engine.begin(prepared, workload)
                toks = [int(x) for x in engine.step(prepared, state)]
                if group is not None:
                    group.agree(toks, "the greedy tokens")
                greedy.append(toks)
            result["greedy"] = greedy
    finally:
        engine.close(prepared)
    peak = peak_memory()
    result["peak_memory"] = group.gather(peak) if group is not None else [peak]
    return result


def peak_memory() -> dict[str, Any]:
    """This process's peak memory so far, in GiB: host RSS (getrusage) and, when the engine used CUDA, the
    torch allocator's peak on this process's device. What the fit check predicted per rank is compared
    with this (the harness reads it; the engine does not report it)."""
    import resource

    out: dict[str, Any] = {"rank": launched_rank(),
                           "host_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 4),
                           "device_gib": None}
    torch = sys.modules.get("torch")  # never imported here for an engine that did not
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        out["device_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 4)
    return out


def result_path(res_path: Path, rank: int) -> Path:
    """Rank 0 (and a single worker) writes RESULT; rank r > 0 writes RESULT.rank{r}.json beside it."""
    return res_path if rank == 0 else res_path.with_name(f"{res_path.stem}.rank{rank}.json")


def pid_path(res_path: Path, rank: int) -> Path:
    return res_path.with_name(f"{res_path.stem}.rank{rank}.pid")


def _write(path: Path, body: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body))
    tmp.replace(path)


def main(argv: list[str]) -> int:
    req_path, res_path = Path(argv[0]), Path(argv[1])
    req = json.loads(req_path.read_text())
    rank = launched_rank()
    if launched_world() > 1:  # so that the parent can make sure no rank outlives the launch
        pid_path(res_path, rank).write_text(str(os.getpid()))
    group: RankGroup | None = None
    body: dict[str, Any] = {"ok": False, "error": "interrupted", "hint": None, "transient": False}
    try:
        if launched_world() > 1:
            group = RankGroup.from_env(req["target"]["device"], float(req.get("timeout_s", 600)))
        body = {"ok": True, **_handle(req, res_path.parent, group)}
    except ScoreboardError as exc:
        body = {"ok": False, "error": exc.message, "hint": exc.hint, "transient": isinstance(exc, TransientError)}
    except MemoryError as exc:
        body = {"ok": False, "error": f"out of memory: {exc}", "hint": None, "transient": True}
    except Exception as exc:  # an engine bug: report with its traceback, not transient
        transient = "out of memory" in str(exc).lower() or "CUDA error" in str(exc)
        body = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(),
                "hint": None, "transient": transient}
    finally:
        if group is not None and body.get("ok"):
            group.close()
    body.update(rank=rank, pid=os.getpid(), at_ns=time.time_ns())
    if rank and body["ok"]:
        body = {k: body[k] for k in ("ok", "rank", "pid", "at_ns")}  # rank 0 carries the results
    _write(result_path(res_path, rank), body)
    return 0 if body["ok"] else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
