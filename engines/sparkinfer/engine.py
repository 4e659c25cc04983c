"""The sparkinfer scoreboard plugin: harness-clocked, in-process, torch on CPU or CUDA.

Code paths (one for checking, the same for timing):

* prefill — tokens go through ``K3Model.forward`` in chunks of ``prefill_chunk(geometry)`` tokens (chunked KDA,
  MLA over the f16 latent cache); ``logits()`` uses exactly this and returns, for each requested
  position p, the next-token logits after consuming ``token_ids[:p+1]``.
* decode at depth d — :meth:`SparkInferEngine.begin` (untimed) fills the prepared engine's one persistent
  cache with the known context ``prompt[:d-1]``: it restores the longest prefix snapshot an earlier begin()
  left (prefix.py: the KDA state at the last multiple of the call size below that begin's end; the latent
  rows stay in the cache) and really prefills the rest through the chunked path, in calls at the absolute
  positions a prefill from zero would make, so the state is that prefill's, bit for bit (as llama-bench -d
  restores its context state for every rep after the first). :meth:`step` (timed) gets the K revealed
  tokens prompt[d-K:d] (``Workload.reveal_len``: 1 under contract 2, chosen by the harness under contract 3)
  and runs K + n_tokens - 1 single-token forwards fed them in order, then g1, ..., g(n-1) (gi = argmax of
  the forward before), and returns [g1, ..., gn]: the greedy continuation, token i being the argmax after
  consuming the prompt + tokens[:i] — what the round teacher-forces through the reference. Under contract 3
  it returns StepOutput(token_ids, logprobs), each log-probability the log-softmax of the row the id is the
  argmax of, computed on the device, and keeps those rows on the device for :meth:`step_logits` (the gate's
  checked run). :func:`greedy_decode` is this path, for tests. With ``options["cuda_graph"]`` (the default
  on CUDA) begin() prefills into graph.py's persistent buffers and captures the static-shape step once
  per attention span; step() replays it per token (the step writes its logits row and log-probability).
* prefill at depth d — :meth:`begin` fills ``prompt[:d]`` the same way (untimed); :meth:`step` ingests the
  ``n_tokens`` revealed tokens in those chunks and returns ``[argmax]`` of the last position's
  logits (one id; with its log-probability under contract 3, and that row for step_logits).

The engine never reads a clock. Options (``EngineTarget.options``, typed in options.py: a target pins them in
reference.lock as ``candidate_options``): ``dtype`` of the weights and matmuls
("float32" by default, "bfloat16", "float16"; norms, softmaxes, router and recurrent state stay f32),
``cuda_graph`` (bool; default true on CUDA, refused on CPU) and ``faults`` (faults.py). On k3-mini, CUDA
float32 matched CPU float32 to KL 4e-11; float16 / bfloat16 flip top-k routing (KL mean 0.011 / 0.028 vs
float32), so a target opts into them explicitly.
"""

from __future__ import annotations

import os
import subprocess
from collections import Counter, OrderedDict
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

from scoreboard.engine import (
    Engine,
    EngineIdentity,
    EngineTarget,
    Geometry,
    LogitsRequest,
    LogitsResult,
    Prepared,
    Progress,
    StepOutput,
    Workload,
)
from scoreboard.errors import EngineError, ScoreboardError, TransientError

from . import OMP_WAIT_POLICY, __version__
from . import options as _options
from .faults import Faults, apply_config_faults, parse_faults
from .graph import StaticDecoder
from .model import CACHE_DTYPE, K3Cache, K3Model
from .prefix import PrefixStore
from .weights import load_weights

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
_REPO = Path(__file__).resolve().parents[2]
_WEIGHTS: OrderedDict[tuple, Any] = OrderedDict()  # loaded weight sets, keyed by files + device + dtype
_WEIGHTS_MAX = 2


@dataclass
class Loaded:
    """Prepared.handle: the model and what it was built for."""

    model: K3Model
    cfg: Any
    device: str
    dtype: str
    geometry: Geometry
    faults: Faults
    decode_steps: int = 0  # decode step() calls in this process (the cheat_when_timed fault counts them)
    static_decode: bool = False  # decode through graph.StaticDecoder (captured in a CUDA graph on CUDA)
    decoder: StaticDecoder | None = None  # built by the first begin() that uses it (static_decode)
    context: Context | None = None  # the cache every begin() fills, and its prefix snapshots
    last_rows: torch.Tensor | None = None  # [outputs, V] f32 on the device: the last step()'s logits rows


@dataclass
class Context:
    """The one persistent cache of a prepared engine (the static decoder's buffers when static_decode is on):
    every begin() fills it, restoring what it can from the prefix snapshots (prefix.py); `generation` counts
    the begin() calls, so a state made by an earlier one is refused."""

    cache: K3Cache
    store: PrefixStore
    generation: int = 0


@dataclass
class DecodeState:
    cache: K3Cache  # the known context prompt[:depth-K], filled
    n_tokens: int  # the ids step() generates
    generation: int  # the begin() this state was made by (Context.generation)
    static: bool = False  # step() replays the StaticDecoder's step
    n_reveal: int = 1  # K: the ids step() gets and consumes before generating


@dataclass
class PrefillState:
    cache: K3Cache  # prompt[:depth], filled
    n_tokens: int  # the revealed tokens step() ingests
    generation: int

    @property
    def n_reveal(self) -> int:
        return self.n_tokens


def checked_config(target: EngineTarget) -> Any:
    """The model's K3Config through the project's config checks (never defaulted), every shard present."""
    from scoreboard.engine import load_k3_config

    try:
        cfg = load_k3_config(Path(target.model_path))
    except ScoreboardError as exc:
        raise EngineError(str(exc), exc.hint) from exc
    if target.shard_paths and tuple(Path(p) for p in target.shard_paths) != tuple(cfg.shards):
        raise EngineError(f"target shards {[str(p) for p in target.shard_paths]} differ from the model's "
                          f"own shard set {[str(p) for p in cfg.shards]}", "pin every shard of the model")
    return cfg


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=_REPO, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _version(pkg: str) -> str:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return ""


def options(target: EngineTarget) -> _options.Options:
    """The target's options through the typed model (options.py): unknown or mistyped ones are refused."""
    return _options.parse(target.options)


def _dtype_name(target: EngineTarget) -> str:
    return options(target).dtype


def _cuda_graph(target: EngineTarget) -> bool:
    value = options(target).cuda_graph
    if value is None:
        return target.device == "cuda"
    if value and target.device != "cuda":
        raise EngineError("options.cuda_graph: CUDA graphs need a cuda target, this one is cpu",
                          "drop cuda_graph from the cpu target's candidate_options")
    return value


def _threads(geometry: Geometry) -> int:
    return geometry.n_threads or os.cpu_count() or 1


class SparkInferEngine(Engine):
    """Kimi K3 in torch; the harness times begin/step around synchronize()."""

    name = "sparkinfer"
    clock = "harness"
    max_ranks = 1024  # expert parallel over torch.distributed (parallel.py); at most one rank per expert

    # -- identity ------------------------------------------------------------------------------
    def describe(self, target: EngineTarget) -> EngineIdentity:
        commit = _git("rev-parse", "HEAD") or ""
        dirty = bool(_git("status", "--porcelain", "--untracked-files=no")) if commit else False
        faults = parse_faults(options(target).faults or None)
        return EngineIdentity(
            engine=self.name, version=__version__,
            source={"package": "engines.sparkinfer", "commit": commit, "dirty": dirty},
            device=target.device,
            extra={"torch": torch.__version__, "gguf": _version("gguf"), "dtype": _dtype_name(target),
                   "kv_cache": str(CACHE_DTYPE).removeprefix("torch."), "faults": list(faults.names),
                   "cuda_graph": _cuda_graph(target),
                   "omp_wait_policy": OMP_WAIT_POLICY,
                   "geometry": target.geometry.as_dict()},
        )

    # -- load ----------------------------------------------------------------------------------
    def prepare(self, target: EngineTarget, cache_dir: Path, progress: Progress | None = None) -> Prepared:
        identity = self.describe(target)
        if target.device == "cuda" and not torch.cuda.is_available():
            raise EngineError("target device is cuda but torch sees no CUDA device",
                              "run on the GPU box, or use a cpu target (e.g. k3-mini-cpu)")
        if target.ranks > 1:  # one rank of the harness-launched world: this rank's expert band
            import torch.distributed as dist

            from .parallel import prepare_rank

            world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
            if world != target.ranks:
                raise EngineError(f"target asks for {target.ranks} ranks, this process is in a world of {world}",
                                  "multi-rank targets are launched by the harness (`scoreboard round run`)")
            return prepare_rank(target)
        cfg = checked_config(target)
        faults = parse_faults(options(target).faults or None)
        dtype = _dtype_name(target)
        torch.set_num_threads(_threads(target.geometry))
        weights, types = self._weights(cfg, target.device, dtype, progress)
        model = K3Model(apply_config_faults(cfg, faults), weights, faults)
        after = self.describe(target)
        if after.source["commit"] != identity.source["commit"] or after.extra != identity.extra:
            raise EngineError(f"engine identity changed while preparing: {identity.source} -> {after.source}",
                              "re-run once the source tree is stable")
        if model.cfg.n_layer != len(weights.layers):
            raise EngineError(f"loaded {len(weights.layers)} layers for a {model.cfg.n_layer}-layer config",
                              "report this as a sparkinfer bug")
        # on CUDA the Triton kernels run once each matched its torch form here (a box whose Triton cannot
        # compile keeps the torch form; the note, in the identity the receipt records, says which ran)
        kernels = model.enable_kernels() if target.device == "cuda" else "torch: cpu"
        identity = replace(identity, extra={**identity.extra, "kernels": kernels})  # recorded in the receipt
        handle = Loaded(model, cfg, target.device, dtype, target.geometry, faults,
                        static_decode=identity.extra["cuda_graph"])
        return Prepared(identity=identity, handle=handle,
                        notes={"n_params": cfg.n_params(), "n_layer": cfg.n_layer, "mla_layers": list(cfg.mla_layers),
                               "kda_chunk": model.kda_chunk, "threads": torch.get_num_threads(),
                               "tensor_types": dict(sorted(Counter(types.values()).items()))})

    def _weights(self, cfg: Any, device: str, dtype: str, progress: Progress | None) -> tuple[Any, dict[str, str]]:
        """(weights, tensor name -> ggml type), loaded once per (files, device, dtype) in this process."""
        files = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in cfg.shards)
        key = (files, device, dtype)
        if key in _WEIGHTS:
            _WEIGHTS.move_to_end(key)
            return _WEIGHTS[key]
        try:
            loaded = load_weights(cfg, tuple(cfg.shards), device, DTYPES[dtype], progress)
        except torch.cuda.OutOfMemoryError as exc:  # a retry on a quieter device may succeed
            raise TransientError(f"out of device memory loading {cfg.shards[0]}: {exc}",
                                 "free the GPU (another process?) and retry") from exc
        _WEIGHTS[key] = loaded
        while len(_WEIGHTS) > _WEIGHTS_MAX:
            _WEIGHTS.popitem(last=False)
        return loaded

    def close(self, prepared: Prepared) -> None:
        prepared.handle = None

    # -- logits --------------------------------------------------------------------------------
    def logits(self, prepared: Prepared, request: LogitsRequest) -> LogitsResult:
        h = _handle(prepared)
        ids, positions = list(request.token_ids), list(request.positions)
        if not positions:
            raise EngineError("logits request has no positions", "ask for at least one position")
        bad = [p for p in positions if not 0 <= p < len(ids)]
        if bad:
            raise EngineError(f"positions {bad[:5]} outside the {len(ids)} token ids",
                              "positions index the token ids: 0 <= p < len(token_ids)")
        torch.set_num_threads(_threads(request.geometry))
        want = sorted(set(positions))
        with torch.inference_mode():
            cache = h.model.new_cache(_n_ctx(request.geometry, want[-1] + 1))
            rows = prefill(h.model, cache, _ids(h, ids[: want[-1] + 1]), prefill_chunk(request.geometry), want)
        got = dict(zip(want, rows.cpu().numpy().astype(np.float32)))
        out = np.stack([got[p] for p in positions]).astype(np.float32)
        geom = replace(request.geometry, n_threads=torch.get_num_threads())
        return LogitsResult(logits=out, geometry=geom)

    # -- timed ---------------------------------------------------------------------------------
    def begin(self, prepared: Prepared, workload: Workload) -> DecodeState | PrefillState:
        h = _handle(prepared)
        torch.set_num_threads(_threads(h.geometry))
        p, d, n = list(workload.prompt_ids), workload.depth, workload.n_tokens
        if len(p) != workload.known_len:
            raise EngineError(f"{workload.phase} workload has {len(p)} known prompt ids, depth {d} gives "
                              f"{workload.known_len}", "build workloads with Workload.split")
        need = d + n  # cache rows: the context plus the tokens the timed part feeds
        known = _checked(h, p)
        with torch.inference_mode():
            ctx = _context(h, _n_ctx(h.geometry, need))
            static = workload.phase == "decode" and h.decoder is not None
            if static:
                h.decoder.ready(need)  # type: ignore[union-attr]  # the span's graph, captured on first use
            ctx.generation += 1
            ctx.store.begin(ctx.cache, known, lambda cache, ids: prefill(h.model, cache, ids, prefill_chunk(h.geometry),
                                                                         []), h.device)
            if h.decoder is not None:
                h.decoder.check()
            if workload.phase == "prefill":
                return PrefillState(ctx.cache, n, ctx.generation)
            return DecodeState(ctx.cache, n, ctx.generation, static, workload.reveal_len)

    def step(self, prepared: Prepared, state: DecodeState | PrefillState, revealed: tuple[int, ...]) -> Any:
        """The timed part: decode consumes the K revealed ids in order, then generates n_tokens greedy ids;
        prefill ingests its revealed ids, then the greedy next one. Returns contract 3's StepOutput (the ids and
        each one's log-probability, computed on the device from the logits row it is the argmax of) where the
        harness defines it, else (contract 2) the ids; the rows stay on the device for step_logits()."""
        h = _handle(prepared)
        if len(revealed) != state.n_reveal:
            raise EngineError(f"step() got {len(revealed)} revealed ids, this workload reveals {state.n_reveal}",
                              "pass exactly the revealed part of the prompt")
        h.last_rows = None
        with torch.inference_mode():
            ids = _ids(h, revealed)
            _owner(h, state).store.writes_from(state.cache.n_past)  # decode and prefill write from n_past on
            if isinstance(state, PrefillState):
                n = int(ids.shape[0])
                rows = prefill(h.model, state.cache, ids, prefill_chunk(h.geometry), [state.cache.n_past + n - 1])
                out, lps = _greedy(rows)
                h.last_rows = rows
                return _output(out, lps)
            h.decode_steps += 1
            if h.faults.cheat_when_timed and h.decode_steps > 1 and os.path.exists("clock.to-worker"):
                return _output([int(revealed[-1])] * state.n_tokens, [0.0] * state.n_tokens)  # no forward at all
            if not state.static:
                out, lps, h.last_rows = decode(h.model, state.cache, ids, state.n_tokens)
            else:
                out, lps, h.last_rows = h.decoder.run(ids, state.n_tokens)  # type: ignore[union-attr]  # begin made it
            return _output(out, lps)

    def step_logits(self, prepared: Prepared) -> np.ndarray:
        """The logits rows of the last step() (float32 [its outputs, V]): decode, row i the row whose argmax is
        its i-th id; prefill, the last position's row. Read untimed, right after step() (the gate's checked run):
        the rows were kept on the device by the step itself (the CUDA graph's step writes them)."""
        h = _handle(prepared)
        if h.last_rows is None:
            raise EngineError("sparkinfer: step_logits() has no step() to read (none ran, or it took no forward)",
                              "call it right after step()")
        return h.last_rows.float().cpu().numpy()

    def synchronize(self, prepared: Prepared) -> None:
        h = prepared.handle
        if h is not None and h.device == "cuda":
            torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------
# the two code paths (plain functions: the engine methods and the gate's checked run share them)

PREFILL_CHUNK = 2048  # tokens per forward call of a prefill, at least the geometry's n_ubatch


def prefill_chunk(geometry: Geometry) -> int:
    """Tokens per forward call when prefilling: n_ubatch is llama.cpp's physical batch; sparkinfer's launches
    per call barely depend on the token count (one grouped product per expert matrix, one chunk scan), so a
    2048-token prompt in one call launches a quarter of the kernels four 512-token calls do. The results are the
    same per token up to rounding (test_sparkinfer_engine)."""
    return max(geometry.n_ubatch, PREFILL_CHUNK)


def prefill(model: K3Model, cache: K3Cache, ids: torch.Tensor, n_ubatch: int, positions: list[int]) -> torch.Tensor:
    """Feed ids [T] in chunks of n_ubatch from cache.n_past; logits [len(positions), V] for the absolute
    positions asked for (sorted, each within this call's range), in order."""
    start = cache.n_past
    rows: list[torch.Tensor] = []
    pos = sorted(positions)
    for c0 in range(0, int(ids.shape[0]), n_ubatch):
        chunk = ids[c0:c0 + n_ubatch]
        lo, hi = start + c0, start + c0 + int(chunk.shape[0])
        want = [p - lo for p in pos if lo <= p < hi]
        out = model.forward(chunk, cache, torch.tensor(want, device=ids.device) if want else None)
        if out is not None:
            rows.append(out)
    if sum(int(r.shape[0]) for r in rows) != len(pos):
        raise EngineError(f"positions {pos[:5]} not all within the fed range {start}..{cache.n_past - 1}")
    return torch.cat(rows, 0) if rows else torch.empty(0)


def decode(model: K3Model, cache: K3Cache, seed: torch.Tensor, n_tokens: int
           ) -> tuple[list[int], list[float], torch.Tensor]:
    """Single-token forwards: the K ids of seed [K] in order, then n_tokens greedy ids (each argmax fed next).
    -> (the n_tokens argmaxes, their log-probabilities, their logits rows [n_tokens, V] on the device); one
    synchronization, at the end."""
    feed = seed.reshape(-1)
    k = int(feed.shape[0])
    row0 = torch.zeros(1, dtype=torch.long, device=feed.device)
    tok, rows = feed[:1], []
    for i in range(k + n_tokens - 1):
        logits = model.forward(tok, cache, row0)  # [1, V]
        rows.append(logits)
        tok = feed[i + 1:i + 2] if i + 1 < k else logits.argmax(-1)  # type: ignore[union-attr]  # stays on device
    out = torch.cat(rows[k - 1:])  # type: ignore[arg-type]  # [n_tokens, V]
    ids, lps = _greedy(out)
    return ids, lps, out


def _greedy(rows: torch.Tensor) -> tuple[list[int], list[float]]:
    """The argmax of each logits row [R, V] and its log-softmax probability (f32, on the rows' device)."""
    top = rows.argmax(-1)
    lps = torch.log_softmax(rows.float(), -1).gather(-1, top[:, None])[:, 0]
    return [int(x) for x in top.tolist()], [float(x) for x in lps.tolist()]


def _output(ids: list[int], logprobs: list[float]) -> StepOutput:
    """step()'s result (contract 3): the ids and each one's log-probability."""
    return StepOutput(token_ids=ids, logprobs=logprobs)


def token_ids(out: Any) -> list[int]:
    """The ids of a step() result (a StepOutput, or an id list a test built)."""
    return list(getattr(out, "token_ids", out))


def _context(h: Loaded, n_ctx: int) -> Context:
    """The prepared engine's persistent cache for n_ctx rows (made on first use, or anew for another n_ctx): the
    static decoder's buffers when static_decode is on (built here, capturing nothing yet), else a plain cache."""
    if h.context is None or h.context.cache.n_ctx != n_ctx:
        if h.static_decode:
            h.decoder = StaticDecoder(h.model, n_ctx, capture=h.device == "cuda")
            cache = h.decoder.cache
        else:
            cache = h.model.new_cache(n_ctx)
        h.context = Context(cache, PrefixStore(prefill_chunk(h.geometry)))
    return h.context


def _owner(h: Loaded, state: DecodeState | PrefillState) -> Context:
    """The context a state was made in, while no later begin() has taken it over."""
    if h.context is None or h.context.generation != state.generation or h.context.cache is not state.cache:
        raise EngineError("sparkinfer: this state was superseded by a later begin() (one cache per prepared "
                          "engine)", "call step() on a state before the next begin()")
    return h.context


def greedy_decode(prepared: Prepared, prompt_ids: list[int] | tuple[int, ...], depth: int, n_tokens: int) -> list[int]:
    """Exactly what begin()+step() of a decode workload generate for the full prompt (as the harness splits it:
    Workload.split), the ids."""
    engine = SparkInferEngine()
    workload, revealed = Workload.split("decode", depth, n_tokens, prompt_ids)
    state = engine.begin(prepared, workload)
    return token_ids(engine.step(prepared, state, revealed))


def _handle(prepared: Prepared) -> Loaded:
    if not isinstance(prepared.handle, Loaded):
        raise EngineError("sparkinfer: this Prepared was closed or not made by sparkinfer.prepare()",
                          "call prepare() again")
    return prepared.handle


def _checked(h: Loaded, ids: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    bad = [i for i in ids if not 0 <= int(i) < h.cfg.n_vocab]
    if bad:
        raise EngineError(f"token ids {bad[:5]} outside the vocabulary (0..{h.cfg.n_vocab - 1})",
                          "tokenize with this model's tokenizer")
    return tuple(int(i) for i in ids)


def _ids(h: Loaded, ids: list[int] | tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(_checked(h, ids), dtype=torch.long, device=h.device)


def _n_ctx(geometry: Geometry, need: int) -> int:
    if need > geometry.n_ctx:
        raise EngineError(f"{need} tokens do not fit the pinned n_ctx {geometry.n_ctx}",
                          "raise geometry.n_ctx in the target, or ask for less depth")
    return geometry.n_ctx
