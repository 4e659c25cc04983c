"""Fresh-process engine worker: `python -m scoreboard.worker REQUEST.json RESULT.json`.

The parent (the round) writes a request (scoreboard.worker.protocol: typed, versioned), starts this module in a new process whose import path
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
from ..engine import LogitsRequest, as_step_output
from ..errors import EngineError, ScoreboardError, TransientError
from .handshake import WorkerChannel
from .protocol import (CheckedOp, GateOp, LogitsFile, LogitsOp, PeakMemory, TimedOp, WireGeometry, WorkerRequest,
                       WorkerResult, decode_request, encode, failure, pid_path, result_path)


def _engine(req: WorkerRequest):
    """The request's engine: the entry point the parent's registry resolved (what a lock names), or the harness's
    own null engine, which only the harness's request can ask for (no entry point resolves to it)."""
    if req.harness_engine == "null":
        from .nullengine import NullEngine

        return NullEngine()
    assert req.entry_point is not None  # the request's own validation: one of the two is set
    sys.path[:0] = list(req.import_paths)  # a plugin arm's export, ahead of PYTHONPATH and any installed copy
    return registry.load_entry_point(req.engine, req.entry_point)


def _session(engine, prepared, op: TimedOp, scratch: Path, group: RankGroup | None) -> None:
    """The timed reps, rep by rep as the parent reveals them (rank 0 holds the channel)."""
    lead = group is None or group.rank == 0
    chan = WorkerChannel(scratch) if lead else None
    try:
        if chan is not None:
            chan.send("hello", pid=os.getpid())
        for i, (w, n) in enumerate(zip(op.workloads, op.reps)):
            workload = w.workload()
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
                out = as_step_output(engine.step(prepared, state, tuple(int(x) for x in tokens)))
                engine.synchronize(prepared)
                if group is not None:
                    group.agree(out.token_ids, f"the timed {workload.phase} rep's token ids")
                if chan is not None:
                    chan.send("output", workload=i, rep=j, token_ids=out.token_ids, logprobs=out.logprobs,
                              worker_ns=time.perf_counter_ns() - t0)
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


def _handle(req: WorkerRequest, out_dir: Path, group: RankGroup | None) -> WorkerResult:
    engine = _engine(req)
    target = req.target.target()
    world = group.world if group else 1
    if target.ranks != world:
        raise EngineError(f"target wants {target.ranks} rank(s), this worker runs in a world of {world}",
                          "multi-rank targets are launched by the round through torchrun")
    if world > 1 and engine.max_ranks < world:
        raise EngineError(f"engine {req.engine!r} runs as at most {engine.max_ranks} process(es), the target "
                          f"asks for {world}", "set parallel.ranks = 1 for this engine's targets")
    prepared = engine.prepare(target, Path(req.cache_dir))
    head: dict[str, Any] = {"identity": prepared.identity.as_dict(), "engine_module": type(engine).__module__,
                            "engine_file": sys.modules[type(engine).__module__].__file__}
    ranks = None
    if group is not None:
        group.agree(json.dumps(head, sort_keys=True, default=str), "the engine identity")
        ranks = group.fingerprints()
    op, logits, checked = req.op, None, None
    try:
        if isinstance(op, TimedOp):
            _session(engine, prepared, op, out_dir, group)
        if isinstance(op, (LogitsOp, GateOp)):
            logits = _logits(engine, prepared, op.requests, target.geometry, out_dir, group)
        if isinstance(op, (CheckedOp, GateOp)):
            checked = _checked(engine, prepared, op.checked, out_dir, group)
    finally:
        engine.close(prepared)
    peak = peak_memory()
    peaks = group.gather(peak.as_dict()) if group is not None else [peak.as_dict()]
    extra: dict[str, Any] = {}
    if checked is not None:
        extra = {"checked": checked.ids, "checked_logprobs": checked.logprobs, "checked_logits": checked.logits}
    return WorkerResult(ok=True, ranks=ranks, logits=logits, peak_memory=[PeakMemory(**p) for p in peaks],
                        **extra, **head)


def _logits(engine, prepared, requests, geometry, out_dir: Path, group: RankGroup | None) -> list[LogitsFile]:
    """One .npy per request in the launch's scratch (rank 0 writes it, after every rank agreed on the bytes)."""
    files = []
    for i, q in enumerate(requests):
        r = engine.logits(prepared, LogitsRequest(tuple(q.token_ids), tuple(q.positions), geometry))
        logits = np.ascontiguousarray(r.logits, dtype=np.float32)
        if group is not None:
            group.agree_bytes(logits.tobytes(), "the logits")
        path = out_dir / f"logits-{i}.npy"
        if group is None or group.rank == 0:
            np.save(path, logits)
        files.append(LogitsFile(path=str(path), geometry=WireGeometry.of(r.geometry)))
    return files


class _Checked:
    """The checked runs' results, per run and variant: output ids, their log-probs, the step's logits file."""

    def __init__(self) -> None:
        self.ids: list[list[list[int]]] = []
        self.logprobs: list[list[list[float] | None]] = []
        self.logits: list[list[LogitsFile | None]] = []


def _checked(engine, prepared, runs, out_dir: Path, group: RankGroup | None) -> _Checked:
    """The gate's checked outputs: the same begin/step as the timed session, untimed, one per variant; then the
    step's own logits rows (step_logits), written beside the request for the parent to grade."""
    res = _Checked()
    for r, c in enumerate(runs):
        workload = c.workload.workload()
        ids, lps, files = [], [], []
        for v, revealed in enumerate(c.reveals):
            state = engine.begin(prepared, workload)
            out = as_step_output(engine.step(prepared, state, tuple(int(x) for x in revealed)))
            if group is not None:
                group.agree(out.token_ids, f"the checked {workload.phase} output")
            ids.append(out.token_ids)
            lps.append(out.logprobs)
            files.append(_step_logits(engine, prepared, out_dir / f"checked-{r}-{v}.npy", group))
        res.ids.append(ids)
        res.logprobs.append(lps)
        res.logits.append(files)
    return res


def _step_logits(engine, prepared, path: Path, group: RankGroup | None) -> LogitsFile | None:
    """The last step's logits rows as an .npy file (None: the engine keeps none, an older contract)."""
    try:
        rows = engine.step_logits(prepared)
    except NotImplementedError:
        return None
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    if group is not None:
        group.agree_bytes(rows.tobytes(), "the checked step's logits")
    if group is None or group.rank == 0:
        np.save(path, rows)
    return LogitsFile(path=str(path), geometry=WireGeometry.of(prepared_geometry(prepared)))


def prepared_geometry(prepared) -> Any:
    """The geometry an engine prepared with, for a logits file's record (the target's, where it keeps none)."""
    from ..engine import Geometry

    geo = getattr(getattr(prepared, "handle", None), "geometry", None)
    return geo if isinstance(geo, Geometry) else Geometry(0, 0, 0)


def peak_memory() -> PeakMemory:
    """This process's peak memory so far, in GiB: host RSS (getrusage) and, when the engine used CUDA, the
    torch allocator's peak on this process's device. What the fit check predicted per rank is compared
    with this (the harness reads it; the engine does not report it)."""
    import resource

    device = None
    torch = sys.modules.get("torch")  # never imported here for an engine that did not
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        device = round(torch.cuda.max_memory_allocated() / 2**30, 4)
    return PeakMemory(rank=launched_rank(), device_gib=device,
                      host_rss_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 4))


def _write(path: Path, result: WorkerResult) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(encode(result))
    tmp.replace(path)


def main(argv: list[str]) -> int:
    req_path, res_path = Path(argv[0]), Path(argv[1])
    rank = launched_rank()
    if launched_world() > 1:  # so that the parent can make sure no rank outlives the launch
        pid_path(res_path, rank).write_text(str(os.getpid()))
    group: RankGroup | None = None
    result = failure("interrupted")
    try:
        req = decode_request(req_path.read_text())
        if launched_world() > 1:
            group = RankGroup.from_env(req.target.device, req.timeout_s)
        result = _handle(req, res_path.parent, group)
    except ScoreboardError as exc:
        result = failure(exc.message, exc.hint, isinstance(exc, TransientError))
    except MemoryError as exc:
        result = failure(f"out of memory: {exc}", transient=True)
    except Exception as exc:  # an engine bug: report with its traceback, not transient
        transient = "out of memory" in str(exc).lower() or "CUDA error" in str(exc)
        result = failure(f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(), transient=transient)
    finally:
        if group is not None and result.ok:
            group.close()
    result = result.model_copy(update={"rank": rank, "pid": os.getpid(), "at_ns": time.time_ns()})
    if rank and result.ok:
        result = result.rank_only()  # rank 0 carries the results
    _write(result_path(res_path, rank), result)
    return 0 if result.ok else 3
