"""The engine contract: what a plugin provides and what the harness keeps for itself.

An engine is discovered through the entry point group ``scoreboard.engines``; the entry point's name
is the engine id used in ``reference.lock`` and in receipts. It provides:

* ``describe(target)`` -> :class:`EngineIdentity` — cheap, GPU-free, deterministic: what would run.
* ``prepare(target, cache_dir, progress)`` -> :class:`Prepared` — idempotent expensive work (fetch,
  build, load weights) keyed by what it depends on; verifies identity afterwards.
* ``logits(prepared, request)`` -> :class:`LogitsResult` — float32 ``[len(positions), vocab]`` for the
  given token ids, through the same code path as the timed run, batch geometry pinned and echoed.
* timed work, in one of two ways (``clock`` class attribute):

  - ``clock = "harness"`` (every candidate): ``begin(prepared, workload)`` does the untimed part with
    the secret part of the prompt withheld and returns a state; ``step(prepared, state, revealed)`` does
    the timed part on the tokens revealed at the start of the clock; ``synchronize(prepared)`` waits for
    the device. What each phase sees (``Workload.known_len`` / ``Workload.reveal_len``):

    - decode at depth d: ``begin`` gets ``prompt[:d-K]`` (and fills it: d-K tokens of real context),
      K = ``Workload.reveal`` (chosen by the harness so that the revealed tokens hold at least 40 bits: no
      ``begin`` can enumerate their continuations); ``step`` gets the K tokens at positions d-K..d-1,
      consumes them in order, and returns ``n_tokens`` greedy ids g1..gn (g1 = argmax after consuming the
      last revealed token, g(i+1) = argmax after consuming gi), so the timed part is the K tokens' ingest and
      n single-token forwards, all of them after the reveal (llama-bench's ``-d d-K -pg K,n``);
    - prefill at depth d: ``begin`` gets ``prompt[:d]`` (and fills it); ``step`` gets the ``n_tokens``
      prompt tokens to ingest and returns ``[g]``, the greedy next token after the last of them (the
      argmax of the last position's logits).

    ``step`` returns a :class:`StepOutput`: the ids and, per id, its log-probability under the logits row
    whose argmax it is (computed on the device in f32 inside the timed part), which the round holds against
    the checked run's (a path taken only when timed changes them even where its tokens agree). After a
    ``step`` of the gate's untimed checked run the harness calls ``step_logits(prepared)``: the full logits
    rows of that step (decode: one per generated id; prefill: the last position's), graded against the
    reference's at the same positions, so the decode path itself (a CUDA graph included) is judged.

    The round runs begin/step in a worker process and keeps the clock in the harness's own process,
    outside the candidate's reach (scoreboard.round.clock, scoreboard.worker): the worker prepares, calls
    ``begin``, synchronizes and says "ready"; the harness reads its clock, sends the revealed tokens and
    stops its clock when the complete output has arrived. Every round reveals a different secret token
    (decode) or prompt (prefill) per timed rep, and each rep's output must equal the gate's checked
    output for that variant — an engine cannot do the work before the reveal, and never reports time.
  - ``clock = "reference-tool"`` (the trusted, pinned reference only): ``timed(prepared, workload,
    reps)`` runs the pinned tool (llama-bench) and returns raw per-rep nanoseconds; the harness
    bounds them by its own wall clock.

Multi-process engines (``max_ranks > 1``): for a target with ``ranks = W > 1`` the harness launches W
processes (torchrun) and initializes the default torch.distributed group before ``prepare`` (NCCL on
cuda with one GPU per rank, gloo on cpu; :mod:`scoreboard.worker.distributed`). Every rank runs the same calls;
the engine uses the default group for its own collectives. Rank 0 talks to the harness; the revealed tokens are
broadcast to every rank, and the harness requires every rank to return the same logits and tokens.

The harness, not the engine, owns warm-up, rep counts, interleaving, timeouts, statistics and
sealing. Engine errors are :class:`scoreboard.errors.EngineError` (with a hint); transient ones
(out of memory at load, device lost) are :class:`scoreboard.errors.TransientError`.
"""

from __future__ import annotations

import abc
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Literal
from typing import TYPE_CHECKING

import numpy as np

# The engine contract's version, read from a commit's own scoreboard/engine.py when the round re-measures an
# older commit (the frontier arm): 1 = begin() saw the whole prompt and step(prepared, state) took no reveal;
# 2 = begin() sees only the known prompt and step(prepared, state, revealed) gets the secret reveal;
# 3 = a decode reveals Workload.reveal tokens (>= 40 bits), step() returns a StepOutput with per-id log-probs, and
# step_logits() gives the checked run's full rows.
CONTRACT_VERSION = 3

# The published plugin surface (docs/engines.md, "What an engine may import"): an engine imports from the harness
# only this module and scoreboard.errors. Besides the contract's own types, this module lends the harness helpers
# below, so an engine checks, caches and fails the way the harness does. The surface is versioned with the contract:
# a name leaves it or changes meaning only with a CONTRACT_VERSION bump; adding one is compatible. They are loaded
# on first use (importing the contract stays cheap and cycle-free: no module here is in round/, history/ or pins/,
# and none imports this one); tests/test_engine_surface.py holds engines to it and the table to both rules.
LENT: dict[str, str] = {
    "cache_dir": "scoreboard.cache",  # the harness's cache rule (explicit, $SCOREBOARD_CACHE, ~/.cache/scoreboard)
    "GitReference": "scoreboard.lockfile",  # the pinned reference source a target carries (EngineTarget.reference)
    "SdistReference": "scoreboard.lockfile",
    "atomic_write_text": "scoreboard.lockfile",  # write-to-temp-then-rename
    "ls_remote": "scoreboard.gitref",  # resolve a git ref as the pin audit does
    "GitUnavailable": "scoreboard.gitref",  # ... and its "could not ask" (an error, never drift)
    "compare_scans": "scoreboard.scans",  # a build's files vs recorded hashes, in the harness's wording
    "load_k3_config": "scoreboard.models.k3",  # a Kimi K3 GGUF's config, refusing its known traps by name
    "GIB": "scoreboard.fit",  # bytes per GiB
    "fit_budget": "scoreboard.fit",  # the per-rank memory budget of a target
    "price_weights": "scoreboard.fit",  # ... with the weights line priced by the engine's own plan
    "ram_gib": "scoreboard.environment",  # this host's RAM
    "extract_tar": "scoreboard.archive",  # unpack a tar someone else chose: nothing outside the destination
    "UnsafeMember": "scoreboard.archive",  # ... and the member it refused
}

# what an engine may import from this module: the contract's own names, then the lent helpers
__all__ = ["CONTRACT_VERSION", "Engine", "EngineIdentity", "EngineTarget", "Geometry", "LogitsRequest",
           "LogitsResult", "Phase", "Prepared", "Progress", "Rep", "StepOutput", "Workload", "as_step_output",
           "cache_dir", "GitReference", "SdistReference", "atomic_write_text", "ls_remote", "GitUnavailable",
           "compare_scans", "load_k3_config", "GIB", "fit_budget", "price_weights", "ram_gib", "extract_tar",
           "UnsafeMember"]

if TYPE_CHECKING:
    from .archive import UnsafeMember, extract_tar
    from .cache import cache_dir
    from .environment import ram_gib
    from .fit import GIB, fit_budget, price_weights
    from .lockfile import GitReference, SdistReference, atomic_write_text
    from .models.k3 import load_k3_config
    from .gitref import GitUnavailable, ls_remote
    from .scans import compare_scans


def __getattr__(name: str) -> Any:
    """A lent helper, imported from its module on first use."""
    if name in LENT:
        import importlib

        value = getattr(importlib.import_module(LENT[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

Phase = Literal["decode", "prefill"]
Progress = Callable[[str, float | None], None]  # (message, fraction 0..1 or None)


@dataclass(frozen=True)
class Geometry:
    """Batch geometry: logits depend on it (llama.cpp ubatch 64 vs 512: up to 1e-2), so it is pinned and echoed back."""

    n_ctx: int
    n_batch: int
    n_ubatch: int
    n_threads: int = 0  # 0 = engine default; the engine echoes the value it used

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class EngineTarget:
    """What an engine needs to know about the round's target, resolved from the lock by the harness."""

    target_id: str
    model_path: Path  # first shard; the others sit beside it
    shard_paths: tuple[Path, ...]
    device: Literal["cpu", "cuda"]
    geometry: Geometry
    reference: Any = None  # lockfile.Reference for reference engines (source pin), else None
    options: dict[str, Any] = field(default_factory=dict)  # engine-specific knobs (e.g. faults)
    ranks: int = 1  # processes the harness launched for this engine (lock: parallel.ranks)


@dataclass(frozen=True)
class EngineIdentity:
    """Stamped into every receipt: enough to know exactly what ran."""

    engine: str
    version: str
    source: dict[str, Any]  # git repo/ref/commit, sdist package/version/sha256, or package path+commit
    build_flags: tuple[str, ...] = ()
    compiler: str = ""
    binaries: dict[str, str] = field(default_factory=dict)  # name -> sha256
    device: str = "cpu"
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["build_flags"] = list(self.build_flags)
        return d


@dataclass
class Prepared:
    """Result of prepare(): the identity verified after the expensive work, plus engine-private state."""

    identity: EngineIdentity
    handle: Any = None
    notes: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LogitsRequest:
    token_ids: tuple[int, ...]  # the whole sequence fed in order from position 0
    positions: tuple[int, ...]  # which positions' next-token logits to return
    geometry: Geometry


@dataclass
class LogitsResult:
    logits: np.ndarray  # float32 [len(positions), vocab]
    geometry: Geometry  # as actually used
    command: list[str] = field(default_factory=list)  # exact command line, when a tool ran


@dataclass(frozen=True)
class Workload:
    """A timed workload as begin() sees it: the prompt with its secret part withheld.

    depth = tokens really in the cache when the timed part ends its ingest (decode: d-K filled by begin +
    the K revealed tokens; prefill: d filled by begin, then n_tokens revealed ones)."""

    phase: Phase
    depth: int
    n_tokens: int  # decode: tokens generated; prefill: prompt tokens ingested
    prompt_ids: tuple[int, ...]  # exactly known_len ids, what begin() may see (() for a reference tool's)
    reveal: int = 1  # decode: K, the prompt's last tokens revealed when the clock starts (prefill: unused)

    def __post_init__(self) -> None:
        if self.phase not in ("decode", "prefill"):
            raise ValueError(f"phase must be decode or prefill, not {self.phase!r}")
        if self.depth < 0 or self.n_tokens <= 0:
            raise ValueError("depth must be >= 0 and n_tokens > 0")
        if self.reveal < 1:
            raise ValueError(f"reveal must be >= 1, not {self.reveal}")
        # no prompt ids: a reference tool's workload (llama-bench makes its own tokens; depth 0 decode is fine)
        if self.prompt_ids and self.phase == "decode" and self.depth < self.reveal:
            raise ValueError(f"a decode workload with a prompt needs depth >= {self.reveal}: the tokens at positions "
                             f"depth-{self.reveal}..depth-1 are revealed at the start of the clock")
        if self.prompt_ids and len(self.prompt_ids) != self.known_len:
            raise ValueError(f"a {self.phase} workload at depth {self.depth} gives begin() exactly "
                             f"{self.known_len} prompt ids, not {len(self.prompt_ids)} (the rest is revealed "
                             "at the start of the clock)")

    @property
    def known_len(self) -> int:
        """Prompt ids begin() gets: decode prompt[:depth-K], prefill prompt[:depth]."""
        return self.depth - self.reveal if self.phase == "decode" else self.depth

    @property
    def reveal_len(self) -> int:
        """Ids step() gets at the start of the clock: decode K (``reveal``), prefill n_tokens."""
        return self.reveal if self.phase == "decode" else self.n_tokens

    @property
    def output_len(self) -> int:
        """Ids step() returns: decode n_tokens, prefill 1 (the greedy next token)."""
        return self.n_tokens if self.phase == "decode" else 1

    @classmethod
    def split(cls, phase: Phase, depth: int, n_tokens: int, prompt: tuple[int, ...] | list[int],
              reveal: int = 1) -> tuple["Workload", tuple[int, ...]]:
        """(the workload begin() sees, the ids revealed to step()) of a full prompt; `reveal`: a decode's K."""
        if phase == "decode" and depth < max(1, reveal):
            raise ValueError(f"decode at depth {depth} cannot reveal {reveal} token(s): the tokens at positions "
                             f"depth-{reveal}..depth-1 are the secret")
        known = depth - reveal if phase == "decode" else depth
        n_reveal = reveal if phase == "decode" else n_tokens
        ids = tuple(int(x) for x in prompt)
        if len(ids) < known + n_reveal:
            raise ValueError(f"{phase} at depth {depth} with {n_tokens} tokens needs {known + n_reveal} prompt ids, "
                             f"got {len(ids)}")
        return cls(phase, depth, n_tokens, ids[:known], reveal if phase == "decode" else 1), \
            ids[known:known + n_reveal]


@dataclass
class StepOutput:
    """What step() returns (contract 3): the output ids and, per id, the natural-log softmax probability of that
    id under the logits row whose argmax it is (f32 on the device, inside the timed part). Decode: n_tokens of
    each; prefill: one (the greedy next token). None: an engine of an older contract (no log-probs)."""

    token_ids: list[int]
    logprobs: list[float] | None = None


def as_step_output(out: Any) -> StepOutput:
    """step()'s return value as a StepOutput: a contract-3 StepOutput as it is, a bare id list (contracts 1-2)
    without log-probs. Anything else is an EngineError."""
    from .errors import EngineError

    ids: Any
    lps: Any
    if isinstance(out, StepOutput):
        ids, lps = out.token_ids, out.logprobs
    elif isinstance(out, (list, tuple)):
        ids, lps = out, None
    else:
        raise EngineError(f"step() returned {type(out).__name__}, not a StepOutput or a list of token ids",
                          "return scoreboard.engine.StepOutput(token_ids, logprobs)")
    try:
        tokens = [int(x) for x in ids]
        probs = None if lps is None else [float(x) for x in lps]
    except (TypeError, ValueError) as exc:
        raise EngineError(f"step() returned ids or log-probs that are not numbers: {exc}") from None
    return StepOutput(tokens, probs)


@dataclass
class Rep:
    """One timed repetition: raw nanoseconds, tokens processed, tokens generated (decode)."""

    ns: int
    n_tokens: int
    token_ids: list[int] = field(default_factory=list)
    clock: str = "harness"  # "harness" or "reference-tool"
    command: list[str] = field(default_factory=list)


class Engine(abc.ABC):
    """Base class for engine plugins. Subclasses set ``name`` and ``clock``."""

    name: ClassVar[str] = ""
    clock: ClassVar[Literal["harness", "reference-tool"]] = "harness"
    max_ranks: ClassVar[int] = 1  # > 1: runs as several processes in one torch.distributed group

    @abc.abstractmethod
    def describe(self, target: EngineTarget) -> EngineIdentity: ...

    @abc.abstractmethod
    def prepare(self, target: EngineTarget, cache_dir: Path, progress: Progress | None = None) -> Prepared: ...

    @abc.abstractmethod
    def logits(self, prepared: Prepared, request: LogitsRequest) -> LogitsResult: ...

    # harness-clocked engines
    def begin(self, prepared: Prepared, workload: Workload) -> Any:
        raise NotImplementedError(f"engine {self.name!r} is not harness-clocked")

    def step(self, prepared: Prepared, state: Any, revealed: tuple[int, ...]) -> StepOutput:
        raise NotImplementedError(f"engine {self.name!r} is not harness-clocked")

    def step_logits(self, prepared: Prepared) -> np.ndarray:
        """float32 [len(last step's token_ids), vocab]: the full logits rows of the last step() (decode: row i
        is the row whose argmax is token_ids[i]; prefill: the last position's row). Untimed: the gate's checked
        run calls it right after step()."""
        raise NotImplementedError(f"engine {self.name!r} keeps no logits rows of its last step")

    def synchronize(self, prepared: Prepared) -> None:
        return None

    # reference-tool-clocked engines (trusted reference only)
    def timed(self, prepared: Prepared, workload: Workload, reps: int) -> list[Rep]:
        raise NotImplementedError(f"engine {self.name!r} is not reference-tool-clocked")

    def close(self, prepared: Prepared) -> None:
        return None

    # optional: what this engine adds to its target's calibration (below)
    def calibration(self, device: Literal["cpu", "cuda"]) -> "CalibrationSuite | None":
        return None


# ----------------------------------------------------------------------------------------------
# An engine's own additions to a target's calibration (optional). A target's gate bars are calibrated by the
# harness's bundled instrument (sparkinfer: its injected faults and its two precisions), and every candidate
# engine relies on that record; an engine that knows silent bugs or precisions of its own returns them from
# Engine.calibration(device), and `scoreboard gate calibrate` measures them too when the engine is the target's
# candidate. The harness asks in a fresh interpreter (scoreboard.probe), never in its own process.

@dataclass(frozen=True)
class CalibrationSuite:
    """Each entry is a set of the engine's own options, merged over the target's candidate_options for one arm.

    faults: name -> the options that switch on one known silent bug; the bars must reject each with margin
    (KL mean >= kl_max x margin on its best seed), like the instrument's faults.
    precisions: (precise, coarse) -> the engine's noise floor, KL(engine at precise || engine at coarse), which must
    sit a margin below the bar (<= kl_max / margin), like the instrument's; None: no noise floor of its own."""

    faults: dict[str, dict[str, Any]] = field(default_factory=dict)
    precisions: tuple[dict[str, Any], dict[str, Any]] | None = None


__all__ += ["CalibrationSuite"]
