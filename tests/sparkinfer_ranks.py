"""Expert-parallel sparkinfer runs for the tests, on the harness's multi-rank path.

:func:`run_ranks` starts `world` ranks of this module with the harness's launcher
(``scoreboard.worker.distributed.launch_command``: torchrun --standalone); each rank joins the process group
the way the harness's worker does (``RankGroup.from_env``), loads its share (``parallel.prepare_rank``) and
runs the job's parts with the harness's agreement checks and clock (``scoreboard.round.clock.in_process_reps``
around the group's barrier). Rank 0 pickles its dict for the caller. Unlike a round's worker it also returns
what only the tests look at: the model's collective count and the load check's ownership table.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scoreboard.engine import EngineTarget, Workload
from scoreboard.errors import EngineError

TESTS = Path(__file__).resolve().parent


@dataclass(frozen=True)
class ParallelJob:
    """What one parallel session computes (every part optional); geometry.n_threads = threads per rank."""

    target: EngineTarget
    logits: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # (token_ids, positions)
    greedy: tuple[tuple[int, ...], int, int] | None = None  # (prompt_ids, depth, n_tokens)
    timed: tuple[Workload, tuple[int, ...], int, int] | None = None  # (workload, revealed ids, reps, warmup)
    fingerprints: bool = True


def run_ranks(job: ParallelJob, world: int, timeout_s: float = 600.0) -> dict[str, Any]:
    """Run `job` on `world` ranks through torchrun; rank 0's result, or EngineError with the ranks' output."""
    from scoreboard.worker.distributed import launch_command

    with tempfile.TemporaryDirectory(prefix="sparkinfer-ranks-") as d:
        job_path, out_path = Path(d) / "job.pkl", Path(d) / "out.pkl"
        job_path.write_bytes(pickle.dumps(job))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(TESTS.parent)]))
        cmd = launch_command(world, "sparkinfer_ranks", [str(job_path), str(out_path)])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 or not out_path.is_file():
            raise EngineError(f"{world} ranks exited {proc.returncode}: {(proc.stdout + proc.stderr)[-3000:]}")
        return pickle.loads(out_path.read_bytes())


def run_job(job: ParallelJob) -> dict[str, Any]:
    """On every rank (inside the group RankGroup.from_env joined): prepare, then the job's parts in order."""
    import numpy as np

    from engines.sparkinfer.engine import SparkInferEngine, greedy_decode
    from engines.sparkinfer.parallel import prepare_rank
    from scoreboard.engine import LogitsRequest
    from scoreboard.round.clock import in_process_reps
    from scoreboard.worker.distributed import RankGroup

    engine = SparkInferEngine()
    group = RankGroup.current(job.target.device)
    prep = prepare_rank(job.target)
    model = prep.handle.model
    out: dict[str, Any] = {"identity": prep.identity.as_dict(), "notes": prep.notes}
    if job.fingerprints:
        out["fingerprints"] = group.fingerprints()
    out["ranks"] = group.gather({"band": prep.notes["band"], "bytes": prep.notes["bytes"]})
    if job.logits is not None:
        ids, pos = job.logits
        before = model.n_collectives
        res = engine.logits(prep, LogitsRequest(tuple(ids), tuple(pos), job.target.geometry))
        out["logits"] = res.logits
        out["logits_collectives"] = model.n_collectives - before
        group.agree_bytes(np.ascontiguousarray(res.logits).tobytes(), "the logits")
    if job.greedy is not None:
        prompt, depth, n = job.greedy
        before = model.n_collectives
        toks = greedy_decode(prep, prompt, depth, n)
        group.agree(toks, "the greedy tokens")
        out["greedy"] = toks
        out["greedy_collectives"] = model.n_collectives - before
    if job.timed is not None:
        wl, revealed, reps, warmup = job.timed
        timed = in_process_reps(engine, prep, wl, [revealed] * (warmup + reps), warmup, barrier=group.barrier)
        group.agree([r.token_ids for r in timed], "the timed reps' token ids")
        out["reps"] = timed
    return out


def _main(job_path: str, out_path: str) -> None:
    from scoreboard.worker.distributed import RankGroup

    job: ParallelJob = pickle.loads(Path(job_path).read_bytes())
    group = RankGroup.from_env(job.target.device, 600.0)
    try:
        out = run_job(job)
        if group.rank == 0:
            Path(out_path).write_bytes(pickle.dumps(out))
        group.barrier()  # nobody tears the group down while a peer still needs it
    finally:
        group.close()


if __name__ == "__main__":
    _main(*sys.argv[1:3])
