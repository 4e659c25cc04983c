"""Multi-process candidates: the harness launches the ranks and owns what is measured across them.

A target with ``parallel.ranks = W > 1`` runs its candidate as W processes in one torch.distributed
process group. The harness, not the engine, does the parts a result depends on:

* launch — ``torchrun --standalone`` (torch's own elastic launcher: a free rendezvous port on this host,
  RANK / WORLD_SIZE / LOCAL_RANK per process, and every rank torn down when one fails) running the
  harness's worker module (:mod:`scoreboard.worker`) W times: :func:`launch_command`;
* the process group — NCCL on cuda with ``torch.cuda.set_device(LOCAL_RANK)`` (one GPU per rank), gloo
  on cpu, with the round's timeout on every collective: :meth:`RankGroup.from_env`;
* the clock — the parent's ``perf_counter_ns`` around the handshake with rank 0 (:mod:`scoreboard.round.clock`):
  every rank begins, a barrier, rank 0 says ready, the reveal is broadcast, every rank steps, and rank 0
  answers only after the ranks agreed on the output, so the sample ends after the slowest rank finished;
* agreement — identity, logits, greedy tokens and timed tokens must be the same on every rank;
* fingerprints — :func:`scoreboard.environment.fingerprint` of every rank, with its pid and device.

The engine only uses the initialized default group (``torch.distributed.get_rank()`` ...). torch is
imported inside the rank-side functions only: the core import path stays torch-free.
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ..errors import EngineError
from ..lockfile import ParallelPolicy

RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def launch_command(world: int, module: str, args: list[str]) -> list[str]:
    """argv that starts `world` ranks of ``python -m module args`` on this host through torchrun."""
    if world < 1:
        raise EngineError(f"cannot launch {world} ranks", "parallel.ranks must be >= 1")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc-per-node={world}",
            "--max-restarts=0", "--monitor-interval=0.2", "-m", module, *args]


def visible_devices(ranks: int, environ: dict[str, str] | None = None) -> str:
    """CUDA_VISIBLE_DEVICES for a cuda round of `ranks` GPUs: the first `ranks` of the devices this process
    may use (its own CUDA_VISIBLE_DEVICES, else 0..ranks-1). The candidate's ranks and the reference's split
    then run on exactly the same GPUs."""
    env = os.environ if environ is None else environ
    given = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if given and len(given) < ranks:
        raise EngineError(f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} leaves {len(given)} GPU(s), the target "
                          f"runs {ranks} rank(s)", "unset CUDA_VISIBLE_DEVICES or list enough GPUs")
    return ",".join(given[:ranks] if given else [str(i) for i in range(ranks)])


def launched_world() -> int:
    """WORLD_SIZE set by the launcher for this process (1 when not launched as a rank)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def launched_rank() -> int:
    """RANK set by the launcher for this process (0 when not launched as one of several ranks)."""
    return int(os.environ.get("RANK", "0")) if launched_world() > 1 else 0


@dataclass
class RankGroup:
    """This process's place in the harness-initialized default process group."""

    rank: int
    world: int
    local_rank: int
    backend: str
    device: str

    @classmethod
    def from_env(cls, device: str, timeout_s: float) -> "RankGroup":
        """Join the group torchrun set up (env:// rendezvous): NCCL + one GPU per rank on cuda, gloo on cpu."""
        import torch
        import torch.distributed as dist

        missing = [k for k in RANK_ENV if k not in os.environ]
        if missing:
            raise EngineError(f"not launched as a rank: {', '.join(missing)} unset",
                              "multi-rank candidates are started by the round (torchrun), not by hand")
        rank, world, local = (int(os.environ[k]) for k in RANK_ENV)
        backend = ParallelPolicy.backend_for(device)
        if device == "cuda":
            if torch.cuda.device_count() <= local:
                raise EngineError(f"rank {rank} needs GPU {local}, this host shows {torch.cuda.device_count()}",
                                  "run the target on its node class (one GPU per rank)")
            torch.cuda.set_device(local)
        dist.init_process_group(backend, timeout=timedelta(seconds=max(timeout_s, 1.0)))
        return cls(rank, world, local, backend, device)

    @classmethod
    def current(cls, device: str) -> "RankGroup":
        """The default group some other launcher already initialized (engine tests, bench scripts)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            raise EngineError("no torch.distributed process group is initialized", "launch the ranks first")
        rank, world = dist.get_rank(), dist.get_world_size()
        return cls(rank, world, int(os.environ.get("LOCAL_RANK", rank)), dist.get_backend(), device)

    # -- collectives the harness needs -----------------------------------------------------------
    def barrier(self) -> None:
        import torch.distributed as dist

        if self.backend == "nccl":
            dist.barrier(device_ids=[self.local_rank])
        else:
            dist.barrier()

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order, on every rank."""
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value)
        return out

    def broadcast(self, value: Any) -> Any:
        """Rank 0's `value` on every rank (what the others passed is ignored)."""
        import torch.distributed as dist

        box = [value if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def agree(self, value: Any, what: str) -> None:
        """Refuse a world whose ranks disagree on `value` (compared on every rank, so all raise together)."""
        seen = self.gather(value)
        bad = [r for r in range(self.world) if seen[r] != seen[0]]
        if bad:
            raise EngineError(f"ranks {bad} disagree with rank 0 on {what}: {_short(seen[bad[0]])} vs "
                              f"{_short(seen[0])}", "every rank must run the same code on the same inputs and "
                              "compute its replicated parts identically")

    def agree_bytes(self, data: bytes, what: str) -> None:
        self.agree(hashlib.sha256(data).hexdigest(), what)

    def fingerprints(self) -> list[dict[str, Any]]:
        """scoreboard.environment.fingerprint() of every rank, plus its rank, pid, backend and device."""
        from ..environment import fingerprint

        fp = fingerprint()
        fp["rank"] = {"rank": self.rank, "local_rank": self.local_rank, "pid": os.getpid(), "backend": self.backend,
                      **_device(self.device, self.local_rank)}
        return self.gather(fp)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _device(device: str, local_rank: int) -> dict[str, Any]:
    import torch

    if device != "cuda":
        return {"device": "cpu", "torch_threads": torch.get_num_threads()}
    props = torch.cuda.get_device_properties(local_rank)
    return {"device": f"cuda:{local_rank}", "device_name": props.name,
            "device_uuid": str(getattr(props, "uuid", "")), "device_memory_mib": props.total_memory // 2**20}


def rank_problems(fps: list[dict[str, Any]], world: int, device: str, gpu_model: str = "") -> list[str]:
    """What is wrong with a world's fingerprints: a missing or repeated rank, two ranks on one GPU, a GPU
    that is not the node class's model, or ranks on different hosts/software (one host, one stack)."""
    problems: list[str] = []
    ranks = sorted((fp.get("rank") or {}).get("rank", -1) for fp in fps)
    if ranks != list(range(world)):
        problems.append(f"ranks reported {ranks}, expected 0..{world - 1}")
    if device == "cuda":
        devs = [(fp.get("rank") or {}).get("device_uuid") or (fp.get("rank") or {}).get("device") for fp in fps]
        if len(set(devs)) != len(devs):
            problems.append(f"two ranks share a GPU: {devs}")
        for fp in fps:
            name = (fp.get("rank") or {}).get("device_name", "")
            if gpu_model and gpu_model.lower() not in str(name).lower():
                problems.append(f"rank {(fp.get('rank') or {}).get('rank')} runs on {name!r}, not a {gpu_model}")
    for key in ("cpu", "kernel", "python", "packages", "harness"):
        values = {repr(fp.get(key)) for fp in fps}
        if len(values) > 1:
            problems.append(f"ranks differ in {key}: one host and one software stack are required")
    return problems


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
