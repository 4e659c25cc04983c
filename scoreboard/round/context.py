"""What a round's stages read and write besides their own result: the fixed context, and the shared log.

`RoundContext` is fixed before the first stage runs (the options, the lock's target, the seed, the round's
scratch); a stage gets it as an argument and never reaches back into the `Round`. `RoundLog` is the one
mutable record the launches share: the commands run, the sandbox's binds, each candidate rank's fingerprint
and peak memory. `Round` reads both when it assembles the receipt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..engine import EngineTarget, Geometry
from ..history.receipt import PeakRec
from ..lockfile import Lock, Target

Report = Callable[..., None]


@dataclass(frozen=True)
class Targets:
    """The engine targets of one round, resolved once the weights' shards are known."""

    candidate: EngineTarget  # parallel.ranks processes (launched by the harness when > 1)
    reference: EngineTarget  # one process, llama.cpp's own split mode over the candidate's GPUs

    @property
    def geometry(self) -> Geometry:
        return self.candidate.geometry


@dataclass(frozen=True)
class RoundContext:
    target_id: str
    target: Target
    lock: Lock
    seed: int
    cache_dir: Path
    scratch: Path  # the round's private scratch root (sandbox.new_scratch_root)
    rounds_dir: Path
    isolation: str  # "bwrap" | "none" (candidate workers)
    candidate_options: dict[str, Any]  # the lock's, with the round's overrides merged over them
    report: Report
    allow_node_mismatch: bool = False
    renew_reference_anchor: bool = False
    reference_source: str | None = None
    blocks: int | None = None  # --blocks (None: the lock's)
    reps: int | None = None  # --reps (None: the lock's)
    round_id: str = ""  # a failed launch's log is kept in <cache_dir>/logs/<round_id>/

    @property
    def logs_dir(self) -> Path | None:
        return self.cache_dir / "logs" / self.round_id if self.round_id else None

    def device_env(self) -> dict[str, str]:
        """Both sides' GPUs: CUDA_VISIBLE_DEVICES = the first parallel.ranks devices (cuda targets only)."""
        if self.target.device != "cuda":
            return {}
        from ..worker.distributed import visible_devices

        return {"CUDA_VISIBLE_DEVICES": visible_devices(self.target.parallel.ranks)}

    def engine_target(self, shards: tuple[Path, ...], options: dict[str, Any] | None = None, reference: Any = None,
                      ranks: int = 1) -> EngineTarget:
        g = self.target.geometry
        return EngineTarget(self.target_id, shards[0], tuple(shards), self.target.device,
                            Geometry(g["n_ctx"], g["n_batch"], g["n_ubatch"], g.get("n_threads", 0)),
                            reference=reference, options=dict(options or {}), ranks=ranks)

    def targets(self, shards: tuple[Path, ...]) -> Targets:
        t = self.target
        ref_opts: dict[str, Any] = {"split_mode": t.parallel.reference_split_mode, "reference_id": t.reference}
        if self.reference_source:
            ref_opts["reference_source"] = self.reference_source
        visible = self.device_env().get("CUDA_VISIBLE_DEVICES")
        if visible:
            ref_opts["visible_devices"] = visible
        return Targets(self.engine_target(shards, self.candidate_options, ranks=t.parallel.ranks),
                       self.engine_target(shards, ref_opts, reference=self.lock.references[t.reference]))


@dataclass
class RoundLog:
    """What every launch adds to the receipt: commands (each once), the sandbox's binds, the candidate's
    ranks (first launch) and per-rank peak memory (the largest any launch reached)."""

    commands: list[list[str]] = field(default_factory=list)
    binds: list[Any] | None = None  # environment.isolation.binds: the first launch that reports them
    # environment.isolation's limits, dev and tmpfs, as the first launch that reports them ran
    sandbox: dict[str, Any] | None = None
    ranks: list[dict[str, Any]] | None = None
    rank_problems: list[str] | None = None
    peaks: dict[int, PeakRec] | None = None  # None: no candidate launch yet

    def record_launch(self, isolation: dict[str, Any]) -> None:
        """A launch's sandbox as it starts (so a launch that then fails is recorded too): the first one's binds,
        limits, devices and tmpfs."""
        if self.binds is None and isolation.get("binds"):
            from .sandbox import receipt_binds

            self.binds = receipt_binds(isolation)
        if self.sandbox is None and isolation.get("limits"):
            self.sandbox = {k: isolation[k] for k in ("limits", "dev", "tmpfs") if k in isolation}

    def command(self, cmd: list[str], once: bool = True) -> None:
        if not once or cmd not in self.commands:
            self.commands.append(cmd)

    def record_peaks(self, peaks: list[dict[str, Any]]) -> None:
        if self.peaks is None:
            self.peaks = {}
        for p in peaks:
            new = PeakRec.model_validate(p)
            old = self.peaks.get(new.rank)
            if old is None:
                self.peaks[new.rank] = new
                continue
            for key in ("host_rss_gib", "device_gib"):
                val = getattr(new, key)
                if val is not None and (getattr(old, key) is None or val > getattr(old, key)):
                    setattr(old, key, val)

    def peak_memory(self) -> list[PeakRec] | None:
        return None if self.peaks is None else [self.peaks[k] for k in sorted(self.peaks)]
