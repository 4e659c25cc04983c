"""The llamacpp engine: the trusted reference. Pinned source -> clean cached build -> llama-bench + logits dumper.

Options read from ``EngineTarget.options`` (all optional; typed in options.py, where an unknown or mistyped one is a
path-qualified InputError):
  ``reference_id`` (str, for error paths), ``cache_dir`` (describe only; prepare gets its own),
  ``flash_attn`` (1 | 0 | -1, default 1), ``n_gpu_layers`` (default 99 on cuda, 0 on cpu),
  ``split_mode`` ("none" | "layer" | "row", default "layer": llama.cpp's ``-sm`` over the visible GPUs, the
  lock's ``parallel.reference_split_mode``), ``visible_devices`` (CUDA_VISIBLE_DEVICES for the tool runs, set by
  the round to the candidate's GPUs), ``timeout_s`` (per tool run), ``pip_args`` (list, for the sdist download; else $SCOREBOARD_PIP_ARGS),
  ``reference_source`` (a transport for the pinned source, source.ReferenceSource; else $SCOREBOARD_REFERENCE_SOURCE).
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scoreboard.engine import (
    Engine,
    EngineIdentity,
    EngineTarget,
    Geometry,
    GitReference,
    LogitsRequest,
    LogitsResult,
    Prepared,
    Progress,
    Rep,
    SdistReference,
    Workload,
    cache_dir,
)
from scoreboard.errors import EngineError, InputError

from . import bench, build, logits, source
from . import options as _options

def prepare_build(reference: GitReference | SdistReference, cache_dir: Path, device: str = "cpu",
                  ref_id: str = "<id>", progress: Progress | None = None,
                  pip_args: list[str] | None = None, plan: build.BuildPlan | None = None) -> build.Build:
    """A verified build of the pinned reference without a model (for llama-quantize, llama-imatrix, ...).

    Checks the pin (a git ref must still resolve to its commit), then returns the cached build after
    re-hashing every binary, or builds it clean. ``build.Build.tool(name)`` gives a tool's path.
    """
    cache_dir = Path(cache_dir).expanduser()
    plan = plan or build.plan_build(reference, device, ref_id)
    source.verify_pin(reference, cache_dir, ref_id, progress)
    return build.ensure_build(plan, cache_dir, progress, pip_args=pip_args)


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def run_settings(target: EngineTarget) -> bench.RunSettings:
    """Threads, flash attention and offload for both llama-bench and the dumper (pinned, recorded)."""
    opts = options(target)
    threads = target.geometry.n_threads or usable_cpus()
    ngl = opts.n_gpu_layers if opts.n_gpu_layers is not None else (99 if target.device == "cuda" else 0)
    return bench.RunSettings(threads=threads, flash_attn=opts.flash_attn, n_gpu_layers=ngl,
                             split_mode=opts.split_mode, visible_devices=opts.visible_devices)


def options(target: EngineTarget) -> _options.Options:
    """The target's options through the typed model (options.py): unknown or mistyped ones are refused."""
    return _options.parse(target.options)


@dataclass
class LlamaCppHandle:
    """Engine-private state of a prepared reference. `tool(name)` gives llama-quantize, llama-imatrix, ..."""

    build: build.Build
    target: EngineTarget
    settings: bench.RunSettings
    runs_dir: Path
    n_vocab: int | None = None
    last_record: dict[str, Any] = field(default_factory=dict)  # the last llama-bench JSON record

    @property
    def bin_dir(self) -> Path:
        return self.build.bin_dir

    def tool(self, name: str) -> Path:
        return self.build.tool(name)


class LlamaCppEngine(Engine):
    """llama.cpp at a pinned source, built by the harness; llama-bench holds the clock."""

    name = "llamacpp"
    clock = "reference-tool"

    def __init__(self) -> None:
        self._seq = itertools.count()

    # ------------------------------------------------------------------------------------------
    def _reference(self, target: EngineTarget) -> GitReference | SdistReference:
        ref = target.reference
        if not isinstance(ref, (GitReference, SdistReference)):
            raise InputError(f"target {target.target_id!r}: the llamacpp engine needs a git or pypi-sdist reference, "
                             f"got {type(ref).__name__}", "set the target's `reference` in reference.lock")
        return ref

    def _plan(self, target: EngineTarget) -> build.BuildPlan:
        import dataclasses

        opts = options(target)
        plan = build.plan_build(self._reference(target), target.device, opts.reference_id)
        return dataclasses.replace(plan, source_spec=opts.reference_source or "")

    def _identity(self, plan: build.BuildPlan, manifest: dict[str, Any] | None,
                  settings: bench.RunSettings) -> EngineIdentity:
        ref = plan.reference
        src: dict[str, Any] = dict(ref.identity())
        if isinstance(ref, SdistReference) and ref.upstream:
            src["upstream"] = ref.upstream
        if ref.tree:  # the content pin every transport must satisfy
            src["tree"] = ref.tree
            src["tree_exclude"] = list(ref.tree_exclude)
        built_from = (manifest or {}).get("source", {})
        tc = plan.toolchain
        compiler = tc.compiler + (f"; nvcc {tc.nvcc_version}" if tc.nvcc else "")
        return EngineIdentity(
            engine=self.name, version=plan.build_commit, source=src, build_flags=plan.cmake_flags, compiler=compiler,
            binaries=dict(manifest["binaries"]) if manifest else {},
            device=plan.device if not plan.cuda_arch else f"cuda (sm_{plan.cuda_arch})",
            extra={"build_key": plan.key(), "build_commit": plan.build_commit, "targets": list(plan.targets),
                   "toolchain": tc.as_dict(), "cpu": plan.cpu, "cuda_arch": plan.cuda_arch,
                   "run_flags": settings.bench_flags(), "dumper_flags": list(build.DUMPER_FLAGS),
                   "visible_devices": settings.visible_devices,
                   # how the cached build's source arrived and the tree it hashed to ("" for older builds)
                   "source_transport": built_from.get("transport", ""),
                   "source_tree": built_from.get("source_tree", ""),
                   # every file and link under build/bin, recursively (binaries holds the files): the round
                   # compares them with the ones its sealed history recorded for this build_key
                   "build_links": dict(manifest.get("links", {})) if manifest else {},
                   "build_files_sha256": build.files_digest({"files": dict(manifest["binaries"]),
                                                             "links": dict(manifest.get("links", {}))})
                   if manifest else "",
                   "built": manifest is not None})

    # ------------------------------------------------------------------------------------------
    def describe(self, target: EngineTarget) -> EngineIdentity:
        """Source pin, flags, compiler, device; binary hashes when a good build of this plan is cached."""
        plan = self._plan(target)
        cache = cache_dir(options(target).cache_dir)
        return self._identity(plan, build.cached_build(plan, cache), run_settings(target))

    def prepare(self, target: EngineTarget, cache_dir: Path, progress: Progress | None = None) -> Prepared:
        """Check the pin, build (or re-verify the cached build), and check the model file is there."""
        t0 = time.monotonic()
        cache_dir = Path(cache_dir).expanduser()
        settings = run_settings(target)
        missing = [str(p) for p in (target.model_path, *target.shard_paths) if not Path(p).is_file()]
        if missing:  # before the expensive part
            raise InputError(f"target {target.target_id!r}: model file(s) not found: {', '.join(missing)}",
                             "generate or fetch the weights first (`scoreboard weights --help`)")
        plan = self._plan(target)
        b = self._build(target, plan, cache_dir, progress)
        n_vocab = logits.gguf_vocab_size(Path(target.model_path))
        runs = (cache_dir / "llamacpp" / "runs").resolve()  # the tools run with cwd = the bin dir
        runs.mkdir(parents=True, exist_ok=True)
        handle = LlamaCppHandle(build=b, target=target, settings=settings, runs_dir=runs, n_vocab=n_vocab)
        notes = {"cache_hit": b.rebuilt == "", "rebuilt": b.rebuilt, "checks": b.checks,
                 "build_dir": str(b.root), "prepare_s": round(time.monotonic() - t0, 3),
                 "build_durations_s": b.manifest.get("durations_s", {})}
        return Prepared(identity=self._identity(plan, b.manifest, settings), handle=handle, notes=notes)

    def prebuild(self, target: EngineTarget, cache_dir: Path, progress: Progress | None = None) -> build.Build:
        """The part of `prepare` that needs no model: the pin checked, then the build of the plan `prepare` uses
        for `target` (cached and re-hashed, or built clean). A box can build while its weights are still being
        generated; `prepare` then finds this build in the cache and re-hashes its binaries."""
        return self._build(target, self._plan(target), Path(cache_dir).expanduser(), progress)

    def _build(self, target: EngineTarget, plan: build.BuildPlan, cache_dir: Path,
               progress: Progress | None) -> build.Build:
        pip_args = options(target).pip_args
        return prepare_build(plan.reference, cache_dir, plan.device, plan.ref_id, progress,
                             list(pip_args) if pip_args is not None else None, plan)

    # ------------------------------------------------------------------------------------------
    def _handle(self, prepared: Prepared) -> LlamaCppHandle:
        h = prepared.handle
        if not isinstance(h, LlamaCppHandle):
            raise EngineError("prepared state is not from the llamacpp engine", "call prepare() first")
        problems = h.build.verify()  # re-hash before every use: the reference may not change under a round
        if problems:
            raise EngineError(f"llama.cpp build {h.build.root} changed since prepare: {'; '.join(problems[:5])}",
                              f"run prepare again to rebuild it clean, and find out what wrote to {h.bin_dir}")
        return h

    def _log(self, h: LlamaCppHandle, step: str) -> Path:
        return h.runs_dir / f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{next(self._seq)}-{step}.log"

    def logits(self, prepared: Prepared, request: LogitsRequest) -> LogitsResult:
        """float32 [len(positions), vocab] through the dumper, geometry/threads as actually used."""
        h = self._handle(prepared)
        log = self._log(h, "logits")
        out = logits.run_dumper(h.tool(build.DUMPER), Path(h.target.model_path).resolve(), request, h.settings, log,
                                n_vocab=h.n_vocab, timeout_s=options(h.target).timeout_s)
        log.unlink(missing_ok=True)
        return LogitsResult(logits=out.logits, geometry=out.geometry, command=out.command)

    def logits_many(self, prepared: Prepared, requests: list[LogitsRequest]) -> list[LogitsResult]:
        """Several requests of one geometry in one dumper run (one model load, their shared prefix decoded once):
        each request's rows are what logits() gives it alone."""
        h = self._handle(prepared)
        log = self._log(h, "logits")
        outs = logits.run_dumper_many(h.tool(build.DUMPER), Path(h.target.model_path).resolve(), list(requests),
                                      h.settings, log, n_vocab=h.n_vocab, timeout_s=options(h.target).timeout_s)
        log.unlink(missing_ok=True)
        return [LogitsResult(logits=o.logits, geometry=o.geometry, command=o.command) for o in outs]

    def timed(self, prepared: Prepared, workload: Workload, reps: int) -> list[Rep]:
        """Raw per-rep nanoseconds from llama-bench (`-d` depth, `-p`/`-n` the timed part), clock = reference-tool."""
        h = self._handle(prepared)
        geometry: Geometry = h.target.geometry
        log = self._log(h, f"bench-{workload.phase}")
        result = bench.run_bench(h.tool("llama-bench"), Path(h.target.model_path).resolve(), workload, geometry, h.settings,
                                 reps, h.build.manifest["build_commit"], log, options(h.target).timeout_s)
        log.unlink(missing_ok=True)
        h.last_record = result.record
        return result.reps
