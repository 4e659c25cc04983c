"""The receipt: versioned typed model of one round's record, and the arithmetic read back from it.

Format history (``format_version``, major.minor; docs/receipt-format.md is the reference):
  1.0 — first release: pins, environment, seed, gate per depth, raw per-rep speed samples,
        verdict, aborted, provenance, commands, stage timings, seal {sha256, prev_ledger_sha256,
        fields, algorithm, signature, public_key}.
  1.1 — optional top-level ``calibration`` (the sealed calibration the gate bars relied on, or
        ``skipped``); 1.0 receipts have none and stay valid.
  1.2 — optional ``notes`` in a same-round arm's ``output_check`` (variants whose outputs varied across
        blocks, each graded by the reference); a comparison arm failing its check or the ceiling flags
        the metric (inconclusive), it no longer REJECTs the candidate.
  1.3 — a decode reveals K >= 1 tokens (``gate.checked.<metric>.reveal_len``, ``reveal_bits``); per rep, the
        output's ``logprobs`` in each block; the gate's ``decode_path`` (the checked run's own step rows graded
        against the reference) and each metric's checked ``logprobs``; a metric's ``timed_logprob_dev``.
        and verdict label ``regression`` (the scored metric's whole CI below -guard_tolerance; exit 2); optional
        ``baseline`` in each ``speed.metrics[]`` (the reference's baseline slot as read at round start): a
        verdict against the pinned frontier slot whose reference drifted past ``speed.reference_drift_max``
        from it is inconclusive (verdict.flags). A reader before 1.3 refuses a ``regression`` label by name
        (verdict.label).
A receipt of an unknown major version is refused; a newer minor of a known major is read (the top
level still forbids unknown keys, so a minor may only add keys inside open sections).

The verdict is its own section computed by code; provenance is a separate free-form section whose
keys may never name a verdict field (provenance can't overwrite one), and `add_provenance` is the only merge helper.
"""

from __future__ import annotations

import os
import re
import secrets
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Mapping

from pydantic import (BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, ValidationError, field_validator,
                      model_serializer, model_validator)

from ..errors import InputError

if TYPE_CHECKING:
    from ..lockfile import Target

FORMAT_VERSION = "1.3"
FORMAT_MAJOR = 1

VERDICT_LABELS = ("REJECT", "regression", "none", "XS", "S", "M", "L", "XL", "BASELINE", "inconclusive")  # the one list
NOT_COMPLIANT = ("REJECT", "regression")  # labels a round exits 2 for
# what a verdict's gain is measured against (scoreboard.tiers): a same-round arm, the pinned slot, or nothing
VERDICT_BASES = ("main-same-round", "frontier-same-round", "frontier-slot", "none")
ARMS = ("reference", "candidate", "main", "frontier")  # main: a PR round's; frontier: a main round's
_STAMP = "%Y-%m-%dT%H:%M:%SZ"
_ROUND_ID = re.compile(r"^(\d{8}T\d{6}Z)-([A-Za-z0-9][A-Za-z0-9._-]*)-([0-9a-f]{8})$")


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Open(BaseModel):
    """A section other components may extend with keys of their own (kept on round-trip)."""

    model_config = ConfigDict(extra="allow")
    # open keys given a typed field after receipts already carried them (or lacked them): a dump writes
    # them only when the receipt has them, so every dump of a receipt keeps the keys it had
    _OPTIONAL_KEYS: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> Any:
        out = handler(self)
        if self._OPTIONAL_KEYS and isinstance(out, dict):
            for k in self._OPTIONAL_KEYS - self.model_fields_set:
                out.pop(k, None)
        return out


class Side(_Closed):
    """The candidate, or main when the candidate is a PR."""

    engine: str
    label: str  # "main" | a git rev | a path
    commit: str  # 40 hex, or "" when not a git checkout
    dirty: bool
    is_main: bool
    identity: dict[str, Any]  # EngineIdentity.as_dict()

    @field_validator("commit")
    @classmethod
    def _commit(cls, v: str) -> str:
        if v and not re.fullmatch(r"[0-9a-f]{40}", v):
            raise ValueError(f"must be 40 lowercase hex characters or '', got {v!r}")
        return v


class ReferenceSide(_Closed):
    engine: str
    identity: dict[str, Any]


class WeightFileRec(_Closed):
    path: str
    size: int = Field(ge=0)  # bytes
    sha256: str


class WeightsRec(_Closed):
    id: str
    files: list[WeightFileRec]
    fully_pinned: bool


class FitRec(_Open):
    """environment.fit: the fit check's prediction per rank (scoreboard.fit), made before any engine ran."""

    ranks: int = Field(ge=1)
    need_gib_per_rank: float
    usable_gib: float
    lines: dict[str, float]  # budget item -> GiB per rank


class PeakRec(_Open):
    """environment.peak_memory[]: per rank, the largest peak any candidate launch reached (GiB; None: not
    measured, e.g. no CUDA in that process) — measured, next to the fit's prediction."""

    rank: int
    host_rss_gib: float | None = None
    device_gib: float | None = None


class EnvironmentRec(_Open):
    """The box as the round observed it: the fingerprint (scoreboard.environment, open), plus the round's
    own typed observations under fixed keys. Every key is optional: older and aborted receipts lack some."""

    parallel: dict[str, Any] | None = None  # ranks, backend, launcher, reference_split_mode, visible_devices
    isolation: dict[str, Any] | None = None  # the sandbox and each arm's code origin (round.sandbox.check)
    fit: FitRec | None = None
    ranks: list[dict[str, Any]] | None = None  # each candidate rank's fingerprint (first launch)
    rank_problems: list[str] | None = None  # what was wrong with that world (allowed by allow_node_mismatch)
    peak_memory: list[PeakRec] | None = None


class GateRec(_Open):
    """The gate section (round.stages.GateStage.judge): every depth graded, then each variant's checked output."""

    depths: list[dict[str, Any]]  # per depth {depth, rows, kl_mean, kl_p99, kl_max, top1, ..., pass}
    pass_: bool = Field(alias="pass")
    flagged: bool = False
    reasons: list[str]
    worst: dict[str, Any] | None = None  # the worst kl_mean, kl_p99, kl_max (nats) and top1 over the depths
    prompt: dict[str, Any] | None = None  # the drawn prompt (round.prompt.Prompt.describe)
    ratchet_round: str | None = None  # the sealed round whose KL per depth the ratchet compared with
    geometry: dict[str, int] | None = None  # the reference's geometry for the gate rows
    # what the timed reps must reproduce, per "<phase>@<depth>": {"outputs": [token ids per variant]}
    checked: dict[str, Any] | None = None
    greedy: dict[str, Any] | None = None  # receipts before per-variant reveals: one checked decode per key
    greedy_check: list[dict[str, Any]] | None = None  # per checked decode {metric, top1_vs_reference, ...}
    prefill_check: list[dict[str, Any]] | None = None  # per prefill variant {metric, token, reference_token, ...}
    checked_distinct: dict[str, int] | None = None  # per metric: how many variants' outputs differ
    # 1.3: per decode metric, the checked run's own step rows graded against the reference's (depth, rows, KL, top-1)
    decode_path: list[dict[str, Any]] | None = None
    _OPTIONAL_KEYS = frozenset({"worst", "prompt", "ratchet_round", "geometry", "checked", "greedy", "greedy_check",
                                "prefill_check", "checked_distinct", "decode_path"})


class Block(_Open):
    block: int = Field(ge=0)
    samples_ns: list[int]  # per timed rep: harness wall-clock nanoseconds
    n_tokens: list[int]  # per timed rep: tokens processed
    wall_ns: int = Field(ge=0)
    command: list[str]
    token_ids: list[list[int]] | None = None  # candidate/main only: tokens generated per rep
    variants: list[Any] | None = None  # per rep: the index of the prompt variant it ran
    worker_ns: list[Any] | None = None  # per rep: the worker's own reading (ns), beside the harness's
    clock: str | None = None  # "harness" (the parent's clock around the handshake) | "reference-tool"
    # 1.3: per rep, the output ids' log-probs the engine computed in the timed step (None: an older contract's)
    logprobs: list[list[float] | None] | None = None
    _OPTIONAL_KEYS = frozenset({"variants", "worker_ns", "clock", "logprobs"})

    @model_validator(mode="after")
    def _samples(self) -> "Block":
        if not self.samples_ns or len(self.samples_ns) != len(self.n_tokens):
            raise ValueError(f"samples_ns ({len(self.samples_ns)}) and n_tokens ({len(self.n_tokens)}) must be "
                             "non-empty and of equal length")
        if min(self.samples_ns) <= 0 or min(self.n_tokens) <= 0:
            raise ValueError("samples_ns and n_tokens must be positive")
        return self


class OutputCheck(_Open):
    """A same-round arm's timed outputs checked: every distinct output of each variant passes the reference."""

    ok: bool
    reasons: list[str]  # the outputs that failed the reference
    graded_by_reference: int | None = None  # outputs unlike the candidate's, graded against the reference
    notes: list[str] | None = None  # 1.2: variants whose outputs varied across blocks (each graded)
    _OPTIONAL_KEYS = frozenset({"graded_by_reference", "notes"})


class Arm(_Open):
    blocks: list[Block] = Field(min_length=1)
    output_check: OutputCheck | None = None
    implausible: str | None = None  # why its fastest reps are above the physical ceiling
    _OPTIONAL_KEYS = frozenset({"output_check", "implausible"})


class SpeedMetric(_Open):
    phase: Literal["decode", "prefill"]
    depth: int = Field(ge=0)
    n_tokens: int = Field(gt=0)
    role: Literal["scored", "guard"]
    slot: str  # the candidate's slot, from Target.slot (cross-checked when the frontier is written)
    arms: dict[str, Arm]
    timed_output_ok: bool
    frontier: float | int | None = None  # tok/s: the candidate slot as read at round start (int kept as written)
    plausible: bool | None = None  # no candidate-side arm above the physical ceiling
    # 1.3: the largest |timed - checked| log-prob (nats) over the candidate's timed reps (None: none to compare)
    timed_logprob_dev: float | None = None
    baseline: float | int | None = None  # 1.3, tok/s: the reference's baseline slot as read at round start (0: none)
    _OPTIONAL_KEYS = frozenset({"frontier", "plausible", "timed_logprob_dev", "baseline"})

    @field_validator("arms")
    @classmethod
    def _arms(cls, v: dict[str, Arm]) -> dict[str, Arm]:
        unknown = sorted(set(v) - set(ARMS))
        if unknown:
            raise ValueError(f"unknown arm(s) {unknown}; arms are {list(ARMS)}")
        missing = [a for a in ("reference", "candidate") if a not in v]
        if missing:
            raise ValueError(f"missing arm(s) {missing}")
        return v


class HandshakeRec(_Open):
    """speed.handshake: the harness's null engine through the same launch and handshake (what a rep costs)."""

    engine: str
    metric: str
    reps: int
    round_trip_ns: list[int]  # per rep
    median_ns: int
    max_ns: int
    wall_ns: int  # the launch's wall clock


class FrontierArmRec(_Open):
    """speed.frontier_arm: a main round's re-measured frontier commit and the slot it set."""

    commit: str
    slot: str
    slot_value: float | int  # tok/s as sealed
    round_id: str


class SpeedRec(_Open):
    schedule: list[list[str]]  # per block, the arm order actually run
    metrics: list[SpeedMetric] = Field(min_length=1)
    ceiling: dict[str, Any] | None = None  # the physical ceiling the samples are checked against
    blocks: int | None = None  # interleaved blocks run
    reps: int | None = None  # timed reps per block
    warmup_reps: int | None = None  # discarded reps at the start of every launch
    clock: str | None = None  # "parent-handshake"
    n_variants: int | None = None  # secret variants per metric
    handshake: HandshakeRec | None = None
    frontier_arm: FrontierArmRec | None = None
    _OPTIONAL_KEYS = frozenset({"ceiling", "blocks", "reps", "warmup_reps", "clock", "n_variants", "handshake",
                                "frontier_arm"})

    @model_validator(mode="after")
    def _one_scored(self) -> "SpeedRec":
        n = sum(m.role == "scored" for m in self.metrics)
        if n != 1:
            raise ValueError(f"exactly one metric must have role 'scored', found {n}")
        return self


class Verdict(_Open):
    """The verdict section, and the one verdict type: computed by scoreboard.tiers from the raw data (never
    copied from provenance), read back from receipts by the same model."""

    model_config = ConfigDict(extra="allow", frozen=True)

    label: Literal[VERDICT_LABELS]  # type: ignore[valid-type]
    gain: float | None = None  # (value - frontier) / frontier; None when no speed numbers count
    gain_ci: tuple[float, float] | None = None  # [lo, hi] fractions; None for claims and REJECT-by-gate
    basis: Literal[VERDICT_BASES] | None = None  # type: ignore[valid-type]
    frontier: float | None = None  # tok/s of the basis; None: not used
    value: float | None = None  # tok/s of the candidate (geomean of block values, or the claimed number)
    speed_label: str | None = None  # the label the speed earned (also under a guard REJECT); None: no speed
    reasons: list[str]
    explanation: str = ""  # one paragraph, plain English, with the numbers
    claim: bool = False  # True: claimed, not measured; never moves anything
    flags: list[str] = Field(default_factory=list)  # metrics not scored and why (zero-variance samples)

    @property
    def compliant(self) -> bool:
        return self.label not in NOT_COMPLIANT

    def as_dict(self) -> dict[str, Any]:
        """The receipt's verdict section, every field written."""
        return self.model_dump(mode="json")


class Aborted(_Closed):
    stage: str
    reason: str
    transient: bool


class Retry(_Closed):
    stage: str
    error: str
    at: str


class SealRec(_Closed):
    sha256: str
    prev_ledger_sha256: str
    fields: dict[str, str] = Field(default_factory=dict)
    algorithm: Literal["ed25519"] | None = None
    signature: str | None = None
    public_key: str | None = None


class CalibrationRef(_Open):
    """1.1: the sealed calibration (rounds/calibrations/<id>.json) whose measurements showed the target's bars
    separated, or ``skipped`` for a test round run without one (such a round never moves a slot)."""

    status: Literal["calibrated", "skipped"]
    calibration_id: str = ""
    record_sha256: str = ""  # sha256 of the record file's bytes
    seal_sha256: str = ""
    definition_sha256: str = ""  # the target definition it was made against
    reason: str = ""  # skipped: why


# the keys provenance may never use, anywhere in its tree (so it can never overwrite a verdict)
# ("flags" came later than the rule, and older provenance may use it for something else)
VERDICT_KEYS = (frozenset(Verdict.model_fields) - {"flags"}) | {"verdict", "pass", "tier", "status", "seal"}


def _verdict_keys_in(obj: Any, path: str) -> list[str]:
    hits: list[str] = []
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            p = f"{path}.{k}"
            if k in VERDICT_KEYS:
                hits.append(p)
            hits.extend(_verdict_keys_in(v, p))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            hits.extend(_verdict_keys_in(v, f"{path}[{i}]"))
    return hits


class Receipt(_Closed):
    format_version: str
    round_id: str
    created_at: str  # UTC, %Y-%m-%dT%H:%M:%SZ
    status: Literal["verdict", "aborted"]
    target: str
    lock_sha256: str  # sha256 of reference.lock bytes at round start ("" if it could not be read)
    lock_target: dict[str, Any] | None  # the target table as loaded (the policy actually used)
    candidate: Side
    main: Side | None
    reference: ReferenceSide
    weights: WeightsRec | None
    environment: EnvironmentRec
    seed: int
    geometry: dict[str, int] | None
    gate: GateRec | None
    speed: SpeedRec | None
    verdict: Verdict | None
    aborted: Aborted | None
    retries: list[Retry]
    commands: list[list[str]]
    stage_seconds: dict[str, float]
    provenance: dict[str, Any] = Field(default_factory=dict)
    calibration: CalibrationRef | None = None  # 1.1: the calibration the gate bars relied on
    seal: SealRec | None = None

    @field_validator("format_version")
    @classmethod
    def _version(cls, v: str) -> str:
        check_format_version(v)
        return v

    @field_validator("created_at")
    @classmethod
    def _created(cls, v: str) -> str:
        try:
            datetime.strptime(v, _STAMP)
        except ValueError:
            raise ValueError(f"must be UTC like 2026-11-29T14:15:00Z, got {v!r}") from None
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "Receipt":
        m = _ROUND_ID.match(self.round_id)
        if not m:
            raise ValueError(f"round_id {self.round_id!r} is not <YYYYMMDDTHHMMSSZ>-<target>-<8 hex>")
        if m.group(2) != self.target:
            raise ValueError(f"round_id names target {m.group(2)!r} but target is {self.target!r}")
        if self.status == "verdict":
            missing = [k for k in ("verdict", "gate", "lock_target", "weights") if getattr(self, k) is None]
            if missing or self.aborted is not None or self.gate is None or self.verdict is None:
                raise ValueError(f"status 'verdict' needs {missing or 'verdict'} set and aborted null")
            if not self.gate.pass_ and self.verdict.label != "REJECT":
                raise ValueError(f"gate.pass is false but verdict.label is {self.verdict.label!r} (must be REJECT)")
        elif self.aborted is None or self.verdict is not None:
            raise ValueError("status 'aborted' needs aborted {stage, reason, transient} and verdict null")
        if self.candidate.is_main and self.main is not None:
            raise ValueError("main must be null when the candidate is main")
        for i, metric in enumerate(self.speed.metrics if self.speed else []):
            if "main" in metric.arms and self.candidate.is_main:
                raise ValueError(f"speed.metrics[{i}].arms: a main round has no 'main' arm (its basis is 'frontier')")
            if "frontier" in metric.arms and not self.candidate.is_main:
                raise ValueError(f"speed.metrics[{i}].arms: a PR round has no 'frontier' arm (its basis is 'main')")
        hits = _verdict_keys_in(self.provenance, "provenance")
        if hits:
            raise ValueError(f"provenance may not use verdict keys: {hits}")
        return self


# ----------------------------------------------------------------------------------------------
# helpers

UPGRADE_HINT = "upgrade scoreboard (`git pull && pip install -e .`), then run the command again"


def format_version_problem(v: Any) -> str | None:
    """What is wrong with a receipt's ``format_version`` `v`, worded to follow "format_version: " (None: this
    scoreboard reads it). The one wording of the unknown-major refusal, wherever a receipt is read."""
    m = re.fullmatch(r"(\d+)\.(\d+)", v) if isinstance(v, str) else None
    if not m:
        return f"must be 'major.minor' like {FORMAT_VERSION!r}, got {v!r}"
    if int(m.group(1)) != FORMAT_MAJOR:
        return f"{v!r} has unknown major version {m.group(1)}; this scoreboard reads receipt format {FORMAT_MAJOR}.x"
    return None


def check_format_version(v: Any) -> None:
    """ValueError (for a pydantic validator) when this scoreboard does not read format_version `v`."""
    problem = format_version_problem(v)
    if problem:
        raise ValueError(problem)


def refuse_unknown_format(data: Any, file: str | os.PathLike[str]) -> None:
    """InputError (exit 1) naming the file, the version found, the versions read and the next command,
    unless this scoreboard reads the receipt's format. A newer minor of a known major is read."""
    version = data.get("format_version") if isinstance(data, Mapping) else None
    problem = format_version_problem(version)
    if problem:
        known_shape = isinstance(version, str) and re.fullmatch(r"\d+\.\d+", version)
        raise InputError(f"{file}: format_version {problem}", UPGRADE_HINT if known_shape else
                         "see docs/receipt-format.md")


def format_major_known(v: Any) -> bool:
    """Whether this scoreboard reads receipts of format_version `v` (its major is FORMAT_MAJOR)."""
    return format_version_problem(v) is None


def receipt_target(receipt: Receipt | Mapping[str, Any]) -> Target:
    """The target table the round actually used (``lock_target``: the policy it was judged under), as a
    typed lockfile.Target; InputError names the first bad field. A Mapping is a receipt still being
    assembled (or a partial one): only its ``lock_target`` and ``round_id`` are read."""
    from ..lockfile import Target

    if isinstance(receipt, Receipt):
        raw, rid = receipt.lock_target, receipt.round_id
    elif isinstance(receipt, Mapping) and "lock_target" in receipt:
        raw, rid = receipt["lock_target"], receipt.get("round_id", "?")
    else:
        raise InputError("receipt lock_target: required field is missing", "the receipt is incomplete; re-run the round")
    try:
        return Target.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        where = f"lock_target.{loc}" if loc else "lock_target"
        raise InputError(f"receipt {rid}: lock_target is not a valid target: {where}: "
                         f"{first['msg']}", "pass --lock reference.lock to score with the current lock's policy"
                         ) from None


def validation_messages(exc: ValidationError, root: str = "") -> list[str]:
    """Each error of `exc` as "<dotted.path>: <message>", paths under `root` (a section's name) when given."""
    out = []
    for err in exc.errors():
        path = ".".join(str(p) for p in ([root] if root else []) + list(err["loc"]))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key (not in receipt format 1.x; see docs/receipt-format.md)"
        out.append(f"{path}: {msg}" if path else msg)
    return out


def validation_problems(data: Any) -> list[str]:
    """Every problem with a receipt dict, each with its field path (empty = valid)."""
    if not isinstance(data, Mapping):
        return [f"<root>: a receipt is a JSON object, got {type(data).__name__}"]
    problem = format_version_problem(data.get("format_version"))
    if problem:
        return [f"format_version: {problem}"]
    try:
        Receipt.model_validate(data)
    except ValidationError as exc:
        return validation_messages(exc)
    return []


def parse_receipt(data: Any, what: str = "receipt") -> Receipt:
    """Validate a receipt dict; InputError lists every problem with its field path."""
    problems = validation_problems(data)
    if problems:
        raise InputError(f"{what}: {len(problems)} problem(s)\n" + "\n".join(f"  {p}" for p in problems),
                         "see docs/receipt-format.md")
    return Receipt.model_validate(data)


def normalize(data: Mapping[str, Any]) -> dict[str, Any]:
    """The receipt dict as the model reads it (ints in float fields become floats; unset defaults
    omitted). Sealing always happens on this form so that read -> validate -> dump is the identity."""
    return parse_receipt(data).model_dump(mode="json", by_alias=True, exclude_unset=True)


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime(_STAMP)


def new_round_id(target: str, created_at: str | None = None) -> str:
    """`<UTC stamp>-<target>-<8 hex of random>`, e.g. 20261129T141500Z-k3-mini-cpu-3f9a1c2e."""
    stamp = datetime.strptime(created_at or utc_now(), _STAMP).strftime("%Y%m%dT%H%M%SZ")
    rid = f"{stamp}-{target}-{secrets.token_hex(4)}"
    if not _ROUND_ID.match(rid) or os.sep in rid:
        raise InputError(f"target {target!r} cannot form a round id (use letters, digits, '.', '_', '-')")
    return rid


def add_provenance(receipt: Mapping[str, Any], facts: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `receipt` with `facts` merged into its ``provenance`` section.

    Refuses any key that names a verdict field (anywhere in `facts`) and refuses sealed receipts.
    """
    if receipt.get("seal") is not None:
        raise InputError("provenance cannot be added to a sealed receipt (it would break the seal)")
    hits = _verdict_keys_in(facts, "provenance")
    if hits:
        raise InputError(f"provenance may not set verdict fields: {hits}",
                         "verdict fields are computed by scoreboard.tiers from the raw samples")
    out = dict(receipt)
    out["provenance"] = {**dict(receipt.get("provenance") or {}), **facts}
    return out


# ----------------------------------------------------------------------------------------------
# arithmetic read back from the raw samples (the one definition frontier and verify share)

def rep_throughputs(block: Block) -> list[float]:
    """tok/s per rep = n_tokens / (ns / 1e9), from raw harness nanoseconds."""
    return [n / (ns / 1e9) for ns, n in zip(block.samples_ns, block.n_tokens)]


def distinct_outputs(blocks: list[Block]) -> dict[int, list[tuple[int, ...]]]:
    """variant -> the different outputs an arm's timed reps of it produced, in the order first seen."""
    seen: dict[int, list[tuple[int, ...]]] = {}
    for b in blocks:
        for v, ids in zip(b.variants or [], b.token_ids or []):
            outs = seen.setdefault(v, [])
            if tuple(ids) not in outs:
                outs.append(tuple(ids))
    return seen


def arm_value(metric: SpeedMetric, arm: str) -> float:
    """The arm's value (tok/s): geometric mean over blocks of the per-block median rep throughput —
    the same estimator the verdict uses (scoreboard.stats.arm_stats().value)."""
    from ..stats import block_value, geometric_mean

    return geometric_mean([block_value(b.samples_ns, b.n_tokens) for b in metric.arms[arm].blocks])


def arm_reps(metric: SpeedMetric, arm: str) -> int:
    """Timed reps (warm-ups excluded) across all blocks of one arm."""
    return sum(len(b.samples_ns) for b in metric.arms[arm].blocks)


def scored_metric(receipt: Receipt) -> SpeedMetric | None:
    if not receipt.speed:
        return None
    return next((m for m in receipt.speed.metrics if m.role == "scored"), None)


def metric_label(m: SpeedMetric) -> str:
    """A recorded metric's display name, e.g. "decode 32 tok @ depth 512" (as scoreboard.tiers.metric_name)."""
    return f"{m.phase} {m.n_tokens} tok @ depth {m.depth}"
