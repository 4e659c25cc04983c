"""llama-bench driver: the reference's own clock. Builds the exact command, runs it, parses `-o json` strictly.

Depth semantics (-p/-n is not -d): decode at depth D revealing K tokens is ``-p 0 -n 0 -pg K,N -d D-K`` (D-K tokens
really in the KV cache, filled untimed and restored from llama-bench's saved state for every rep after the first,
then the K revealed tokens ingested and N tokens generated, timed together: the same region the harness times a
candidate over, from the reveal to the last output); prefill is ``-p N -n 0 -d D``. Rates are never read from the tool
(`avg_ts` is a mean of per-rep rates): each raw `samples_ns` entry becomes one Rep with its token count.
llama-bench feeds random token ids, so a Rep carries no generated ids. Its own single warm-up run (default) is
not part of `samples_ns`; the harness's warm-up reps are separate calls.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scoreboard.engine import Geometry, Rep, Workload
from scoreboard.errors import EngineError, TransientError

_OOM = re.compile(r"out of memory|cudaMalloc failed|failed to allocate|std::bad_alloc", re.IGNORECASE)
_LOAD = re.compile(r"failed to load model|error loading model|unable to load model", re.IGNORECASE)


@dataclass(frozen=True)
class RunSettings:
    """How the reference runs, identical for llama-bench and the logits dumper; recorded with every result."""

    threads: int
    flash_attn: int  # 1 on, 0 off, -1 auto
    n_gpu_layers: int  # 99 on CUDA (all layers), 0 on CPU
    split_mode: str = "layer"  # llama.cpp's split over the visible GPUs (-sm): none | layer | row
    visible_devices: str = ""  # CUDA_VISIBLE_DEVICES for the tool runs ("" = inherit): the candidate's GPUs

    def env(self) -> dict[str, str] | None:
        """The tools' environment: this process's, with CUDA_VISIBLE_DEVICES pinned when set."""
        if not self.visible_devices:
            return None
        return {**os.environ, "CUDA_VISIBLE_DEVICES": self.visible_devices}

    def bench_flags(self) -> list[str]:
        return ["-t", str(self.threads), "-fa", str(self.flash_attn), "-ngl", str(self.n_gpu_layers),
                "-sm", self.split_mode]


@dataclass
class BenchResult:
    command: list[str]
    record: dict[str, Any]
    reps: list[Rep] = field(default_factory=list)


def bench_command(llama_bench: Path, model: Path, workload: Workload, geometry: Geometry, settings: RunSettings,
                  reps: int) -> list[str]:
    """The exact argv for one workload; -d carries the depth, -p/-n the timed part only."""
    if reps < 1:
        raise EngineError(f"llama-bench needs reps >= 1, got {reps}")
    if workload.phase == "decode":
        n_prompt, n_gen, n_depth = bench_shape(workload)
        shape = ["-p", "0", "-n", "0", "-pg", f"{n_prompt},{n_gen}", "-d", str(n_depth)]
    else:
        shape = ["-p", str(workload.n_tokens), "-n", "0", "-d", str(workload.depth)]
    return [str(llama_bench), "-m", str(model), *shape, "-r", str(reps), "-b", str(geometry.n_batch), "-ub",
            str(geometry.n_ubatch), *settings.bench_flags(), "-o", "json"]


def bench_shape(workload: Workload) -> tuple[int, int, int]:
    """(n_prompt, n_gen, n_depth) the one llama-bench test record of a workload must report."""
    if workload.phase == "decode":  # K revealed tokens (none at depth 0: nothing is in the cache to reveal)
        k = min(workload.reveal, workload.depth)
        return k, workload.n_tokens, workload.depth - k
    return workload.n_tokens, 0, workload.depth


def parse_bench_json(stdout: str, workload: Workload, geometry: Geometry, settings: RunSettings, reps: int,
                     build_commit: str, where: str = "llama-bench") -> dict[str, Any]:
    """The one test record of a run, checked against what was asked for (a mismatch is an error, never a guess)."""
    try:
        data = json.loads(stdout)
    except ValueError as exc:
        raise EngineError(f"{where}: output is not JSON ({exc}): {stdout[:200]!r}") from None
    if not isinstance(data, list) or len(data) != 1 or not isinstance(data[0], dict):
        raise EngineError(f"{where}: expected exactly one test record, got {type(data).__name__} "
                          f"of {len(data) if isinstance(data, list) else '?'}")
    rec = data[0]
    n_prompt, n_gen, n_depth = bench_shape(workload)
    want = {"n_prompt": n_prompt, "n_gen": n_gen, "n_depth": n_depth, "n_batch": geometry.n_batch,
            "n_ubatch": geometry.n_ubatch, "n_threads": settings.threads, "flash_attn": settings.flash_attn,
            "n_gpu_layers": settings.n_gpu_layers, "split_mode": settings.split_mode, "build_commit": build_commit}
    bad = [f"{k}={rec.get(k)!r} (asked {v!r})" for k, v in want.items() if rec.get(k) != v]
    if bad:
        raise EngineError(f"{where}: the run does not match the request: {', '.join(bad)}",
                          "the binary or its flags are not the pinned ones; run prepare again")
    samples = rec.get("samples_ns")
    if (not isinstance(samples, list) or len(samples) != reps
            or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in samples)):
        raise EngineError(f"{where}: samples_ns must hold {reps} positive integers, got {samples!r}")
    return rec


def classify_failure(step: str, rc: int, log: Path, model: Path, text: str) -> EngineError:
    tail = "\n".join(text.strip().splitlines()[-15:])
    if _OOM.search(text):
        return TransientError(f"{step} ran out of memory (exit {rc}); log: {log}\n{tail}",
                              "free device/host memory and retry; check `scoreboard fit` for the target")
    if _LOAD.search(text):
        return EngineError(f"{step} could not load model {model} (exit {rc}); log: {log}\n{tail}",
                           "check the weights (`scoreboard verify`), the model architecture and the llama.cpp pin")
    return EngineError(f"{step} failed (exit {rc}); log: {log}\n{tail}", f"read {log}")


def run_bench(llama_bench: Path, model: Path, workload: Workload, geometry: Geometry, settings: RunSettings,
              reps: int, build_commit: str, log: Path, timeout_s: float | None = None) -> BenchResult:
    """Run llama-bench once and return one Rep per raw sample (clock = "reference-tool")."""
    cmd = bench_command(llama_bench, model, workload, geometry, settings, reps)
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        # cwd = the hashed bin dir: the binaries' RUNPATH ends in an empty entry, which the loader reads as the
        # working directory, so a library in any other cwd would load unhashed
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout_s, env=settings.env(),
                              cwd=llama_bench.parent, check=False)
    except subprocess.TimeoutExpired as exc:
        log.write_text(f"$ {shlex.join(cmd)}\n[timed out after {timeout_s} s]\n{exc.stderr or ''}", encoding="utf-8")  # type: ignore[str-bytes-safe]
        raise EngineError(f"llama-bench timed out after {timeout_s} s; log: {log}",
                          "raise speed.timeout_s or check the box") from None
    log.write_text(f"$ {shlex.join(cmd)}\n[exit {proc.returncode}]\n--- stdout\n{proc.stdout}\n"
                   f"--- stderr\n{proc.stderr}", encoding="utf-8")
    if proc.returncode != 0:
        raise classify_failure("llama-bench", proc.returncode, log, model, proc.stderr + proc.stdout)
    rec = parse_bench_json(proc.stdout, workload, geometry, settings, reps, build_commit, f"llama-bench (log: {log})")
    out = [Rep(ns=int(s), n_tokens=workload.n_tokens, token_ids=[], clock="reference-tool", command=list(cmd))
           for s in rec["samples_ns"]]
    return BenchResult(command=cmd, record=rec, reps=out)
