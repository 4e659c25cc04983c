"""Fresh-process engine worker: `python -m scoreboard.worker REQUEST.json RESULT.json`.

The parent (the round) writes a request, starts this module in a new process whose import path
puts the candidate's `engines/` first and the harness's own `scoreboard` second, and reads the
result file (never the worker's stdout). No time is taken here: for op "timed" the worker follows the
clock handshake (scoreboard.worker.handshake) over the FIFOs beside its request, and the parent's clock makes
the samples (scoreboard.round.clock). Anything in this process can be replaced by the candidate's code.

Launched as W ranks by torchrun (a target with parallel.ranks = W, scoreboard.worker.distributed), every rank
joins the process group the harness sets up, then runs the same op. Rank 0 writes RESULT.json, rank r
RESULT.rank{r}.json (its outcome), and every rank RESULT.rank{r}.pid when it starts, so that the parent
can name the rank that failed first and make sure no rank outlives the launch. In a timed session only
rank 0 talks to the parent; it broadcasts each reveal to the other ranks, every rank steps, and rank 0
answers once the group agreed on the output.
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

from .. import registry
from .distributed import RankGroup, launched_rank, launched_world
from ..engine import EngineTarget, Geometry, LogitsRequest, Workload
from ..errors import EngineError, ScoreboardError, TransientError
from .handshake import WorkerChannel


def target_from_dict(d: dict[str, Any]) -> EngineTarget:
    return EngineTarget(target_id=d["target_id"], model_path=Path(d["model_path"]),
                        shard_paths=tuple(Path(p) for p in d["shard_paths"]), device=d["device"],
                        geometry=Geometry(**d["geometry"]), reference=None, options=d.get("options", {}),
                        ranks=int(d.get("ranks", 1)))


def target_to_dict(t: EngineTarget) -> dict[str, Any]:
    return {"target_id": t.target_id, "model_path": str(t.model_path), "shard_paths": [str(p) for p in t.shard_paths],
            "device": t.device, "geometry": t.geometry.as_dict(), "options": dict(t.options), "ranks": t.ranks}


# an op is one or more parts run in order on one prepared engine ("gate": the gate's logits and its checked
# outputs — greedy decode for every decode variant, the next token for every prefill variant, in one process, so the
# weights are loaded once for both)
OPS: dict[str, tuple[str, ...]] = {"timed": ("timed",), "logits": ("logits",), "checked": ("checked",),
                                   "gate": ("logits", "checked")}


def workload_from_dict(w: dict[str, Any]) -> Workload:
    return Workload(w["phase"], int(w["depth"]), int(w["n_tokens"]), tuple(int(x) for x in w["prompt_ids"]))


def _engine(req: dict[str, Any]):
    """The request's engine: an entry point (what a lock names), or the harness's own null engine, which only
    the harness's request can ask for (no entry point resolves to it)."""
    if req.get("harness_engine") == "null":
        from .nullengine import NullEngine

        return NullEngine()
    return registry.load(req["engine"])


def _session(engine, prepared, req: dict[str, Any], scratch: Path, group: RankGroup | None) -> None:
    """The timed reps, rep by rep as the parent reveals them (rank 0 holds the channel)."""
    lead = group is None or group.rank == 0
    chan = WorkerChannel(scratch) if lead else None
    try:
        if chan is not None:
            chan.send("hello", pid=os.getpid())
        for i, (w, n) in enumerate(zip(req["workloads"], req["reps"])):
            workload = workload_from_dict(w)
            for j in range(int(n)):
                state = engine.begin(prepared, workload)
                engine.synchronize(prepared)
                if group is not None:
                    group.barrier()
                tokens: Any = None
                if chan is not None:
                    chan.send("ready", workload=i, rep=j)
                    tokens = chan.recv("reveal", workload=i, rep=j)["tokens"]
                if group is not None:
                    tokens = group.broadcast(tokens)
                t0 = time.perf_counter_ns()
                ids = [int(x) for x in engine.step(prepared, state, tuple(int(x) for x in tokens))]
                engine.synchronize(prepared)
                if group is not None:
                    group.agree(ids, f"the timed {workload.phase} rep's token ids")
                if chan is not None:
                    chan.send("output", workload=i, rep=j, token_ids=ids, worker_ns=time.perf_counter_ns() - t0)
        if chan is not None:
            chan.recv("bye")
    except ScoreboardError as exc:
        if chan is not None:  # the parent is waiting for a message: tell it why none comes
            try:
                chan.send("error", error=exc.message, hint=exc.hint)
            except OSError:
                pass
        raise
    finally:
        if chan is not None:
            chan.close()


def _handle(req: dict[str, Any], out_dir: Path, group: RankGroup | None) -> dict[str, Any]:
    engine = _engine(req)
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
    try:
        parts = OPS.get(req["op"])
        if parts is None:
            raise ScoreboardError(f"unknown worker op {req['op']!r}; known: {', '.join(OPS)}")
        if "timed" in parts:
            _session(engine, prepared, req, out_dir, group)
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
        if "checked" in parts:  # the gate's checked outputs: the same begin/step, untimed, one per variant
            checked = []
            for c in req["checked"]:
                workload = workload_from_dict(c["workload"])
                outs = []
                for revealed in c["reveals"]:
                    state = engine.begin(prepared, workload)
                    toks = [int(x) for x in engine.step(prepared, state, tuple(int(x) for x in revealed))]
                    if group is not None:
                        group.agree(toks, f"the checked {workload.phase} output")
                    outs.append(toks)
                checked.append(outs)
            result["checked"] = checked
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

