"""Spawn N ranks of a function under torch.distributed (gloo on CPU, NCCL on CUDA), return rank 0's result,
and tear every rank down when one fails or the time runs out.

The runtime is torch.distributed itself; this module only starts the processes the way ``torchrun``
would (``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` in each rank's environment)
and watches them. The rendezvous store is a ``TCPStore`` the parent holds on 127.0.0.1, bound to port 0
so the OS picks a free port and no other process can take it between the pick and the bind.

Failure handling: a rank that raises reports its exception (class, message, hint, traceback) to the
parent and exits 1; a rank that dies without a word (killed, segfault) is seen by its exit code. Either
way, and on the deadline, every rank still alive is terminated (SIGTERM, then SIGKILL after a grace
period) before :func:`launch` raises, so no rank is left blocked in a collective.
"""

from __future__ import annotations

import importlib
import os
import queue
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from scoreboard.errors import EngineError, ScoreboardError
from scoreboard.lockfile import ParallelPolicy

MASTER_ADDR = "127.0.0.1"
KILL_GRACE_S = 5.0  # seconds between SIGTERM and SIGKILL at teardown
POLL_S = 0.1
SETTLE_S = 1.0  # after a first rank failure, how long to gather the others' before naming the root cause
# a rank's error that only says a peer went away: the consequence of another rank's failure, not its cause
PEER_LOST = ("connection reset by peer", "connection closed by peer", "broken pipe", "remote process exited",
             "socket closed", "recv error", "read error")


def default_backend(device: str) -> str:
    """gloo on CPU, NCCL on CUDA (the harness's rule: ParallelPolicy.backend_for)."""
    if device in ("cpu", "cuda"):
        return ParallelPolicy.backend_for(device)
    raise EngineError(f"no distributed backend for device {device!r}", "use device 'cpu' (gloo) or 'cuda' (nccl)")


def _rank_main(rank: int, world: int, port: int, backend: str, device: str, threads: int, timeout_s: float,
               fn: Callable[..., Any], args: tuple, results: Any) -> None:
    """One rank: join the process group, run fn(rank, world, *args), report ("ok"|"err", rank, payload)."""
    os.environ.update({"MASTER_ADDR": MASTER_ADDR, "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)})
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        if device == "cuda":
            torch.cuda.set_device(rank)  # one rank per GPU of the host
        store = dist.TCPStore(MASTER_ADDR, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        out = fn(rank, world, *args)
        dist.barrier()  # nobody tears the group down while a peer still needs it
        dist.destroy_process_group()
        results.put(("ok", rank, out if rank == 0 else None))
    except BaseException as exc:  # noqa: BLE001 - report everything (KeyboardInterrupt too), then exit non-zero
        err = {"module": type(exc).__module__, "cls": type(exc).__name__, "message": str(exc),
               "hint": getattr(exc, "hint", None), "traceback": traceback.format_exc()}
        results.put(("err", rank, err))
        sys.exit(1)


def _reraise(rank: int, world: int, err: dict[str, Any]) -> ScoreboardError:
    """The rank's error in the parent: its own ScoreboardError class when it has one, else EngineError."""
    tail = "\n".join(err["traceback"].strip().splitlines()[-12:])
    cls: type = EngineError
    try:
        found = getattr(importlib.import_module(err["module"]), err["cls"])
        if isinstance(found, type) and issubclass(found, ScoreboardError):
            cls = found
    except (ImportError, AttributeError):
        pass
    message = f"rank {rank} of {world} failed: {err['cls']}: {err['message']}"
    try:
        out = cls(message, err["hint"] or "see the rank's traceback in the error's `traceback`")
    except TypeError:  # an error class with another constructor (LockError)
        out = EngineError(message, err["hint"])
    out.traceback = tail  # type: ignore[attr-defined]
    return out


def _root_cause(failures: dict[int, ScoreboardError]) -> ScoreboardError:
    """The failure to report: a rank that died silently, else the first error that is not a peer loss;
    the others are named after it."""
    order = list(failures)
    died = [r for r in order if getattr(failures[r], "died", False)]
    own = [r for r in order if not any(s in failures[r].message.lower() for s in PEER_LOST)]
    first = (died or own or order)[0]
    err = failures[first]
    others = [f"rank {r}: {failures[r].message.split(': ', 1)[-1][:160]}" for r in order if r != first]
    if others:
        err.message = f"{err.message} (then {'; '.join(others)})"
        err.args = (err.message,)
    return err


def _teardown(procs: list[Any]) -> None:
    """SIGTERM every live rank, SIGKILL whatever survives the grace period, reap them all."""
    procs = [p for p in procs if p.pid is not None]  # started ones only
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + KILL_GRACE_S
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5.0)


def launch(fn: Callable[..., Any], world: int, args: tuple = (), *, device: str = "cpu", backend: str | None = None,
           timeout_s: float = 600.0, threads_per_rank: int = 1, pids: list[int] | None = None) -> Any:
    """Run ``fn(rank, world, *args)`` on `world` spawned ranks in one process group; return rank 0's value.

    `fn` and `args` must be picklable (a module-level function). Raises the failing rank's error (its
    ScoreboardError class, else EngineError, message prefixed with the rank) after killing every rank;
    EngineError when the ranks have not all finished within `timeout_s` seconds. `pids`, if given, is
    filled with the ranks' process ids (for the caller's records and teardown checks).
    """
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if world < 1:
        raise EngineError(f"world size {world}: need at least one rank", "launch 1 or more ranks")
    backend = backend or default_backend(device)
    if device == "cuda":
        import torch

        have = torch.cuda.device_count()
        if have < world:
            raise EngineError(f"{world} ranks need {world} CUDA devices; torch sees {have}",
                              "run on the target's node class, or launch fewer ranks")
    # the parent holds the rendezvous store: port 0 = a free port chosen by the OS, held until the end
    store = dist.TCPStore(MASTER_ADDR, 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, name=f"sparkinfer-rank{r}",
                         args=(r, world, store.port, backend, device, threads_per_rank, timeout_s, fn, args, results))
             for r in range(world)]
    deadline = time.monotonic() + timeout_s
    done: set[int] = set()
    failures: dict[int, ScoreboardError] = {}  # rank -> its error, in the order seen
    settle = 0.0  # after a first failure, collect the others for SETTLE_S, then report the root cause
    out: Any = None
    try:
        for p in procs:
            p.start()
        if pids is not None:
            pids.extend(p.pid for p in procs)
        while len(done) < world:
            try:
                kind, rank, payload = results.get(timeout=POLL_S)
            except queue.Empty:
                kind = None
            if kind == "err":  # (replaces a "died" seen first: its report was still in the pipe)
                failures[rank] = _reraise(rank, world, payload)
            elif kind == "ok":
                done.add(rank)
                if rank == 0:
                    out = payload
                continue
            else:
                for r, p in enumerate(procs):  # a rank that died without reporting (killed, crashed)
                    if r not in done and r not in failures and p.exitcode not in (None, 0):
                        what = f"signal {-p.exitcode}" if p.exitcode < 0 else f"exit code {p.exitcode}"
                        failures[r] = EngineError(f"rank {r} of {world} died ({what}) without reporting",
                                                  "out of memory or a crash in a native library; see the rank's stderr")
                        failures[r].died = True  # type: ignore[attr-defined]
            now = time.monotonic()
            if failures:
                settle = settle or now + SETTLE_S
                if now >= settle:
                    raise _root_cause(failures)
            elif now > deadline:
                missing = sorted(set(range(world)) - done)
                raise EngineError(f"ranks {missing} of {world} did not finish within {timeout_s:g} s",
                                  "a rank is stuck (a collective one rank never reached?) or the work is too "
                                  "big for the timeout")
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        return out
    finally:
        _teardown(procs)
        results.close()
        results.cancel_join_thread()
        del store
