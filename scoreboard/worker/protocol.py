"""The worker pipe: what the parent (scoreboard.round.launch) writes to REQUEST.json and what the worker
(scoreboard.worker.serve) writes to RESULT.json, as typed, versioned models (de)serialised only here.

The protocol is harness-only: both ends are always the same harness. A round that re-measures an older
commit's engines (the main or frontier arm) runs them under the *current* harness's worker, so no other
version of this protocol is ever on the other end; a request or result of another version, or a malformed
one, is an error naming the field (the parent reports a malformed result like a crashed worker).

Shape (PROTOCOL "scoreboard-worker/1"):

  WorkerRequest  {protocol, engine, entry_point, harness_engine, import_paths, target, cache_dir, timeout_s, op}
    op: one of TimedOp {kind "timed", workloads, reps}, LogitsOp {kind "logits", requests},
        CheckedOp {kind "checked", checked}, GateOp {kind "gate", requests, checked}
  WorkerResult   {protocol, ok, rank, pid, at_ns} + on success {identity, engine_module, engine_file, ranks,
                  logits, checked, checked_logprobs, checked_logits, peak_memory},
                 on failure {error, hint, transient, traceback}

Pydantic (strict, extra fields forbidden) rather than hand-written dataclass checks: every problem comes
back at once with its path (``op.requests.0.positions.2``), the same way the lock and the receipt report
theirs, and pydantic is already imported by the worker. Torch-free: the sandboxed worker imports this
before any engine.

History: 1 — the first versioned pipe (before it: unversioned dicts, same content); 2 — a workload carries
its decode reveal length; a checked run returns each variant's per-id log-probs and its step's logits rows; the
request's optional ``import_paths`` (a plugin arm's package, put first on the worker's sys.path).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Optional, Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..engine import EngineTarget, Geometry, Workload
from ..errors import EngineError

PROTOCOL = "scoreboard-worker/2"


class ProtocolError(EngineError):
    """A request or result that is not this harness's protocol: another version, or a malformed field."""


class _Wire(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


# -- the engine contract's values on the wire ---------------------------------------------------

class WireGeometry(_Wire):
    n_ctx: int
    n_batch: int
    n_ubatch: int
    n_threads: int = 0

    @classmethod
    def of(cls, g: Geometry) -> WireGeometry:
        return cls(**g.as_dict())

    def geometry(self) -> Geometry:
        return Geometry(self.n_ctx, self.n_batch, self.n_ubatch, self.n_threads)


class WireTarget(_Wire):
    """EngineTarget without `reference` (reference engines run in the parent, never in a worker)."""

    target_id: str
    model_path: str
    shard_paths: tuple[str, ...]
    device: Literal["cpu", "cuda"]
    geometry: WireGeometry
    options: dict[str, Any] = Field(default_factory=dict)
    ranks: int = 1

    @classmethod
    def of(cls, t: EngineTarget) -> WireTarget:
        return cls(target_id=t.target_id, model_path=str(t.model_path), shard_paths=tuple(map(str, t.shard_paths)),
                   device=t.device, geometry=WireGeometry.of(t.geometry), options=dict(t.options), ranks=t.ranks)

    def target(self) -> EngineTarget:
        return EngineTarget(target_id=self.target_id, model_path=Path(self.model_path),
                            shard_paths=tuple(Path(p) for p in self.shard_paths), device=self.device,
                            geometry=self.geometry.geometry(), reference=None, options=dict(self.options),
                            ranks=self.ranks)


class WireWorkload(_Wire):
    phase: Literal["decode", "prefill"]
    depth: int
    n_tokens: int
    prompt_ids: tuple[int, ...]
    reveal: int = 1

    @classmethod
    def of(cls, w: Workload) -> WireWorkload:
        return cls(phase=w.phase, depth=int(w.depth), n_tokens=int(w.n_tokens), prompt_ids=tuple(map(int, w.prompt_ids)),
                   reveal=int(w.reveal))

    def workload(self) -> Workload:
        try:
            return Workload(self.phase, self.depth, self.n_tokens, self.prompt_ids, self.reveal)
        except ValueError as exc:
            raise ProtocolError(f"worker request: a workload: {exc}") from None


# -- requests, one per op -------------------------------------------------------------------------

class LogitsRows(_Wire):
    """One logits request: the whole sequence, and the positions whose next-token rows come back."""

    token_ids: tuple[int, ...]
    positions: tuple[int, ...]

    @classmethod
    def of(cls, token_ids: Sequence[int], positions: Sequence[int]) -> LogitsRows:
        return cls(token_ids=tuple(map(int, token_ids)), positions=tuple(map(int, positions)))


class CheckedRun(_Wire):
    """A workload's untimed begin/step, once per secret variant (`reveals`: the ids step() gets)."""

    workload: WireWorkload
    reveals: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, workload: Workload, reveals: Sequence[Sequence[int]]) -> CheckedRun:
        return cls(workload=WireWorkload.of(workload), reveals=tuple(tuple(map(int, r)) for r in reveals))


class TimedOp(_Wire):
    """The timed session: reps[i] reps of workloads[i], in order, over the clock handshake."""

    parts: ClassVar[tuple[str, ...]] = ("timed",)
    kind: Literal["timed"] = "timed"
    workloads: tuple[WireWorkload, ...]
    reps: tuple[int, ...]

    @classmethod
    def of(cls, workloads: Sequence[Workload], reps: Sequence[int]) -> TimedOp:
        return cls(workloads=tuple(map(WireWorkload.of, workloads)), reps=tuple(map(int, reps)))

    @model_validator(mode="after")
    def _paired(self) -> TimedOp:
        if len(self.workloads) != len(self.reps):
            raise ValueError(f"{len(self.workloads)} workloads but {len(self.reps)} rep counts")
        return self


class LogitsOp(_Wire):
    parts: ClassVar[tuple[str, ...]] = ("logits",)
    kind: Literal["logits"] = "logits"
    requests: tuple[LogitsRows, ...]


class CheckedOp(_Wire):
    parts: ClassVar[tuple[str, ...]] = ("checked",)
    kind: Literal["checked"] = "checked"
    checked: tuple[CheckedRun, ...]


class GateOp(_Wire):
    """The gate's logits and its checked outputs in one process, so that the weights are loaded once."""

    parts: ClassVar[tuple[str, ...]] = ("logits", "checked")
    kind: Literal["gate"] = "gate"
    requests: tuple[LogitsRows, ...]
    checked: tuple[CheckedRun, ...]


WorkerOp = Annotated[TimedOp | LogitsOp | CheckedOp | GateOp, Field(discriminator="kind")]
OPS = ("timed", "logits", "checked", "gate")


HarnessEngine = Optional[Literal["null"]]  # a harness-owned engine a request may name instead of an entry point


class WorkerRequest(_Wire):
    protocol: str = PROTOCOL
    engine: str  # the engine id (what the lock names); messages use it
    # "module:attr" as the parent's registry resolved `engine` (the worker imports exactly that); None only
    # for a harness engine
    entry_point: str | None
    harness_engine: HarnessEngine = None  # the harness's own null engine (no entry point resolves to it)
    # directories the worker puts first on its import path before it imports the entry point: a plugin arm's
    # exported package parent (its own repository's commit), so that it wins over any installed copy
    import_paths: tuple[str, ...] = ()
    target: WireTarget
    cache_dir: str
    timeout_s: float
    op: WorkerOp

    @model_validator(mode="after")
    def _one_engine(self) -> WorkerRequest:
        if (self.entry_point is None) == (self.harness_engine is None):
            raise ValueError("exactly one of entry_point and harness_engine must be set")
        return self


# -- the result ----------------------------------------------------------------------------------

class LogitsFile(_Wire):
    path: str  # an .npy file in the launch's scratch directory: float32 [len(positions), vocab]
    geometry: WireGeometry  # as the engine used it


class PeakMemory(_Wire):
    """One rank's peak memory, in GiB: host RSS and (CUDA engines) the torch allocator's device peak."""

    rank: int
    host_rss_gib: float
    device_gib: float | None

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "host_rss_gib": self.host_rss_gib, "device_gib": self.device_gib}


class WorkerResult(_Wire):
    """What one rank wrote. Rank 0 (or a single worker) carries the op's results; a succeeding rank r > 0
    writes only {protocol, ok, rank, pid, at_ns}."""

    protocol: str = PROTOCOL
    ok: bool
    rank: int = 0
    pid: int = 0
    at_ns: int = 0
    # success
    identity: dict[str, Any] | None = None  # EngineIdentity.as_dict() of the prepared engine
    engine_module: str | None = None
    engine_file: str | None = None
    ranks: list[dict[str, Any]] | None = None  # every rank's fingerprint (multi-rank launches)
    logits: list[LogitsFile] | None = None  # op logits / gate: one per request
    checked: list[list[list[int]]] | None = None  # op checked / gate: per run, per variant, the output ids
    # per run, per variant: the output ids' log-probs (None: an engine of contract < 3 returned none)
    checked_logprobs: list[list[list[float] | None]] | None = None
    # per run, per variant: its step's logits rows, float32 [len(output ids), vocab] (None: not available)
    checked_logits: list[list[LogitsFile | None]] | None = None
    peak_memory: list[PeakMemory] = Field(default_factory=list)
    # failure
    error: str | None = None
    hint: str | None = None
    transient: bool = False
    traceback: str | None = None

    def rank_only(self) -> WorkerResult:
        """A succeeding rank r > 0's own outcome (rank 0 carries the results)."""
        return WorkerResult(ok=self.ok, rank=self.rank, pid=self.pid, at_ns=self.at_ns)


def failure(error: str, hint: str | None = None, transient: bool = False, traceback: str | None = None,
            rank: int = 0) -> WorkerResult:
    return WorkerResult(ok=False, error=error, hint=hint, transient=transient, traceback=traceback, rank=rank)


def result_path(res_path: Path, rank: int) -> Path:
    """Rank 0 (and a single worker) writes RESULT; rank r > 0 writes RESULT.rank{r}.json beside it."""
    return res_path if rank == 0 else res_path.with_name(f"{res_path.stem}.rank{rank}.json")


def pid_path(res_path: Path, rank: int) -> Path:
    """Every rank of a multi-rank launch writes its pid here when it starts."""
    return res_path.with_name(f"{res_path.stem}.rank{rank}.pid")


def check_result(op: TimedOp | LogitsOp | CheckedOp | GateOp, result: WorkerResult) -> None:
    """A successful result carries what its op produces (ProtocolError naming the field when it does not)."""
    problems = []
    if result.identity is None:
        problems.append("identity: missing (every successful op prepared an engine)")
    if isinstance(op, (LogitsOp, GateOp)) and (result.logits is None or len(result.logits) != len(op.requests)):
        got = "none" if result.logits is None else len(result.logits)
        problems.append(f"logits: op {op.kind} asked for {len(op.requests)} logits file(s), got {got}")
    if isinstance(op, (CheckedOp, GateOp)) and result.checked is None:
        problems.append(f"checked: op {op.kind} asked for {len(op.checked)} checked run(s), got none")
    if problems:
        raise ProtocolError("worker result: " + "; ".join(problems))


# -- (de)serialisation: the only place either side turns these into bytes or back ----------------

def encode(msg: WorkerRequest | WorkerResult) -> str:
    return msg.model_dump_json(exclude_defaults=False)


def decode_request(text: str) -> WorkerRequest:
    return _decode(WorkerRequest, text, "worker request")


def decode_result(text: str) -> WorkerResult:
    return _decode(WorkerResult, text, "worker result")


def _decode(model: type[_Wire], text: str, what: str) -> Any:
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ProtocolError(f"{what}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ProtocolError(f"{what}: expected a JSON object, got {type(data).__name__}")
    version = data.get("protocol")
    if version != PROTOCOL:  # checked first: another version's other fields would only add noise
        raise ProtocolError(f"{what}.protocol: {version!r}, this harness speaks {PROTOCOL!r}",
                            "both ends of the pipe are this harness's; a mixed install is a harness bug")
    try:
        return model.model_validate_json(text)
    except ValidationError as exc:
        raise ProtocolError(f"{what}: " + "; ".join(_problem(e) for e in exc.errors())) from None


def _problem(err: Any) -> str:
    loc = [str(x) for x in err["loc"]]
    if len(loc) > 1 and loc[0] == "op" and loc[1] in OPS:  # the union's tag (op.gate.requests...): the op says it
        del loc[1]
    return f"{'.'.join(loc) or '(top level)'}: {err['msg']}"
