"""reference.lock: typed models, the one loader, and the comment-preserving writer.

Format history (``schema``):
  1 — references / weights / nodes / targets / slots (this version); additive since: ``[signers.<id>]`` (the
      Ed25519 public keys whose seals history trusts) and ``[sealed_before_pin]`` (records sealed before the first
      signer was pinned, each by id and seal; docs/signing.md).
A lock with an unknown major schema is refused; the loader reports every problem at once, each with
its path into the document (``targets.k3-mini-cpu.reference: unknown reference 'x'``).
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, TypeVar, Union

import tomlkit
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import InputError, LockError
from .slots import slot_name

SCHEMA_MAJOR = 1
DEFAULT_LOCK = "reference.lock"

_SHA1 = re.compile(r"^[0-9a-f]{40}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class _Model(BaseModel):
    # strict: a number written as a string (kl_max = "0.001") or a float where an int belongs
    # (blocks = 4.0) is a typo to fix, not a value to coerce; an int where a float belongs is fine
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


_T = TypeVar("_T")


def _as_tuple(v: Any) -> Any:
    """TOML arrays (and receipts' JSON arrays) arrive as lists; strict tuples take them element-strictly."""
    return tuple(v) if isinstance(v, list) else v


Tuple = Annotated[tuple[_T, ...], BeforeValidator(_as_tuple)]


def _check_sha(value: str, pattern: re.Pattern[str], what: str, allow_empty: bool = False) -> str:
    if allow_empty and value == "":
        return value
    if not pattern.match(value):
        n = 40 if pattern is _SHA1 else 64
        raise ValueError(f"{what} must be {n} lowercase hex characters, got {len(value)}: {value!r}")
    return value


def _check_exclude(v: tuple[str, ...]) -> tuple[str, ...]:
    for e in v:
        if not e or e.startswith("/") or ".." in e.split("/") or e in (".", ".git"):
            raise ValueError(f"tree_exclude entries are paths relative to the source root, got {e!r}")
    if len(set(v)) != len(v):
        raise ValueError("tree_exclude has duplicates")
    return v


class _SourceTree(_Model):
    """What both reference kinds share: how the source is built, and the tree pin any transport can satisfy."""

    cmake_flags: Tuple[str] = ()
    # the git tree id of the source as built (tree_exclude left out): any transport that delivers exactly this
    # tree satisfies the pin; "" = not pinned by tree (only the pinned transport can deliver it)
    tree: str = ""
    tree_exclude: Tuple[str] = ()  # root-relative paths that are not build inputs, removed before hashing

    @field_validator("tree")
    @classmethod
    def _tree(cls, v: str) -> str:
        return _check_sha(v, _SHA1, "a git tree id", allow_empty=True)

    @field_validator("tree_exclude")
    @classmethod
    def _exclude(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return _check_exclude(v)


class GitReference(_SourceTree):
    kind: Literal["git"]
    repo: str
    ref: str
    commit: str
    base_commit: str

    @field_validator("commit", "base_commit")
    @classmethod
    def _sha(cls, v: str) -> str:
        return _check_sha(v, _SHA1, "a git commit")

    def identity(self) -> dict[str, str]:
        return {"kind": "git", "repo": self.repo, "ref": self.ref, "commit": self.commit, "base_commit": self.base_commit}


class SdistReference(_SourceTree):
    kind: Literal["pypi-sdist"]
    package: str
    version: str
    sha256: str
    subdir: str
    upstream: str = ""  # informational, e.g. "ggml-org/llama.cpp@0c1e57098"

    @field_validator("sha256")
    @classmethod
    def _sha(cls, v: str) -> str:
        return _check_sha(v, _SHA256, "an sdist sha256")

    def identity(self) -> dict[str, str]:
        return {"kind": "pypi-sdist", "package": self.package, "version": self.version, "sha256": self.sha256,
                "subdir": self.subdir}


Reference = Annotated[Union[GitReference, SdistReference], Field(discriminator="kind")]


class WeightFile(_Model):
    path: str
    size: int = Field(ge=0)  # bytes; 0 = not yet pinned
    sha256: str = ""  # "" = not yet pinned

    @field_validator("sha256")
    @classmethod
    def _sha(cls, v: str) -> str:
        return _check_sha(v, _SHA256, "a shard sha256", allow_empty=True)

    @property
    def pinned(self) -> bool:
        return bool(self.sha256) and self.size > 0


class Weights(_Model):
    repo: str  # Hugging Face repo id, or "generated"
    revision: str = ""  # 40-hex Hub commit; "" for generated or not yet pinned
    spec: str = ""  # generated weights: the preset name
    seed: int | None = None  # generated weights: the seed
    quant: str = ""  # the quantization the files hold
    files: Tuple[WeightFile] = Field(min_length=1)

    @field_validator("revision")
    @classmethod
    def _rev(cls, v: str) -> str:
        return _check_sha(v, _SHA1, "a Hub revision", allow_empty=True)

    @model_validator(mode="after")
    def _generated(self) -> "Weights":
        if self.repo == "generated" and (not self.spec or self.seed is None):
            raise ValueError("generated weights need `spec` and `seed`")
        return self

    @property
    def fully_pinned(self) -> bool:
        hub_ok = self.repo == "generated" or bool(self.revision)
        return hub_ok and all(f.pinned for f in self.files)


class NodeClass(_Model):
    """What makes two boxes comparable. Empty/None fields match anything."""

    description: str = ""
    gpu_model: str = ""  # substring of the reported GPU name, e.g. "H200"
    gpu_count: int = Field(ge=0)
    gpu_memory_gib: float = Field(default=0, ge=0)  # usable per device, for the fit check
    cpu_arch: str = ""  # e.g. "x86_64"
    min_cpu_cores: int = Field(default=1, ge=1)
    # GB/s per device (per GPU; the host's memory on a cpu node), set generously: the harness refuses a decode
    # rate above this x devices / the bytes one token must read (scoreboard.ceiling). None: no ceiling.
    memory_bandwidth_gbs: float | None = Field(default=None, gt=0, strict=True)


class Metric(_Model):
    phase: Literal["decode", "prefill"]
    depth: int = Field(ge=0)  # tokens in the cache before the timed part
    n_tokens: int = Field(gt=0)  # decode: generated; prefill: prompt tokens
    role: Literal["scored", "guard"]
    unit: Literal["tok/s"] = "tok/s"
    higher_is_better: bool = True

    @property
    def ctx(self) -> int:
        """The slot's context axis: the depth for decode, the prompt length for prefill."""
        return self.depth if self.phase == "decode" else self.depth + self.n_tokens


class GatePolicy(_Model):
    depths: Tuple[int] = Field(min_length=1)
    rows_per_depth: int = Field(ge=1)
    top1_min: float = Field(ge=0, le=1)
    kl_max: float = Field(gt=0)  # nats, mean KL(ref||cand) per depth
    kl_prefer: float = Field(gt=0)  # above this: pass, flagged
    kl_p99_max: float = Field(gt=0)  # nats
    ratchet_ratio: float = Field(default=2.0, gt=1)  # reject when KL > ratio x main's sealed KL ...
    ratchet_floor: float = Field(default=0.0, ge=0)  # ... and KL above this absolute floor
    # `scoreboard gate calibrate` must show the bars separated by this factor: a correct engine and the
    # noise floor at most kl_max / margin on every seed, every known fault at least kl_max x margin
    calibration_margin: float = Field(default=20.0, gt=1)
    # the noise floor's second precision ("" = derived: float64 on cpu; on cuda float16, or float32 when
    # the candidate itself computes in a 16-bit dtype)
    noise_dtype: Literal["", "float64", "float32", "float16", "bfloat16"] = ""
    # the gate depths at which a calibration grades the fault suite (empty: every gate depth). A round's gate
    # rejects a candidate on any one depth, so a fault shown over the bar at a shallower depth is rejected whatever
    # it does deeper: grading faults on the prompt's prefix can only understate them. The correct arm and the noise
    # floors are graded at every depth, always. It spares a calibration each fault's prefill of the deepest prompt
    # (on one H200 at depth 131072, most of a 20-seed calibration's time: docs/calibration.md)
    fault_depths: Tuple[int] = ()

    @model_validator(mode="after")
    def _bars(self) -> "GatePolicy":
        if self.kl_prefer > self.kl_max:
            raise ValueError(f"kl_prefer ({self.kl_prefer}) must not exceed kl_max ({self.kl_max})")
        stray = [d for d in self.fault_depths if d not in self.depths]
        if stray:
            raise ValueError(f"fault_depths {list(stray)} are not gate depths {list(self.depths)}: faults are graded "
                             "at a subset of the depths a round grades")
        if len(set(self.fault_depths)) != len(self.fault_depths):
            raise ValueError(f"fault_depths {list(self.fault_depths)} lists a depth twice")
        return self

    def graded_fault_depths(self) -> tuple[int, ...]:
        """The depths at which a calibration grades each fault, shallowest first."""
        return tuple(sorted(self.fault_depths or self.depths))


class TierPolicy(_Model):
    buckets: dict[str, float]  # label -> minimum gain (fraction of frontier)
    max_ci_width: float = Field(gt=0)  # CI of the ratio wider than this -> inconclusive
    guard_tolerance: float = Field(ge=0, lt=1)  # guard may lose at most this fraction
    confidence: float = Field(default=0.95, gt=0, lt=1)
    bootstrap_resamples: int = Field(default=2000, ge=100)
    min_blocks: int = Field(default=4, ge=2)  # fewer paired blocks: no CI can award a tier or convict a guard

    @field_validator("buckets")
    @classmethod
    def _buckets(cls, v: dict[str, float]) -> dict[str, float]:
        known = ["XS", "S", "M", "L", "XL"]
        bad = [k for k in v if k not in known]
        if bad:
            raise ValueError(f"unknown tier label(s) {bad}; use {known}")
        order = [v[k] for k in known if k in v]
        if any(x <= 0 for x in order) or order != sorted(order) or len(set(order)) != len(order):
            raise ValueError("bucket thresholds must be positive and strictly increasing XS < S < M < L < XL")
        return v


class SpeedPolicy(_Model):
    warmup_reps: int = Field(ge=1)
    reps: int = Field(ge=1)  # reps per arm per block
    blocks: int = Field(ge=2)  # interleaved blocks (each a fresh engine process)
    timeout_s: float = Field(gt=0)
    # warn when the reference arm lands more than this fraction away from its own baseline slot: the box is
    # not what it was (load, thermal state, another tenant), so every ratio measured on it is suspect
    reference_drift_max: float = Field(default=0.25, gt=0)
    # the secret each decode rep reveals when its clock starts, in bits: the prompt's last K tokens, K the fewest
    # normal tokens that hold it (scoreboard.round.reveal), so no untimed begin() can enumerate the continuations
    reveal_bits: int = Field(default=40, ge=1, le=256)
    # nats: a timed rep's per-token log-probs may differ from the checked run's of the same variant by at most this
    # (the same engine on the same inputs; a path taken only when timed moves them far more), and a step's
    # log-probs from its own logits rows' (the engine's arithmetic vs the harness's float64). A speed policy, not
    # a gate bar: it holds the timed path to the checked one, and leaves the calibrated bars as they are
    logprob_tol: float = Field(default=1e-3, gt=0)


class FitPolicy(_Model):
    scratch_gib: float = Field(ge=0)
    plan: str = ""  # e.g. "expert-parallel: experts banded, attention replicated"
    sharded_gib: float = Field(default=0, ge=0)  # weights split across ranks
    replicated_gib: float = Field(default=0, ge=0)  # weights on every rank


class ParallelPolicy(_Model):
    """How many processes the candidate runs as, and how the reference spreads over the same devices.

    ranks: candidate processes in one torch.distributed process group, launched by the harness with
    torchrun (NCCL on cuda, one GPU per rank; gloo on cpu). reference_split_mode: llama.cpp's own
    ``-sm`` over the same visible GPUs (none = one GPU, layer = whole layers per GPU, row = matrices
    split by rows); on a cpu target it is recorded and has no effect.
    """

    ranks: int = Field(default=1, ge=1, le=64)
    reference_split_mode: Literal["none", "layer", "row"] = "layer"

    @staticmethod
    def backend_for(device: str) -> str:
        """torch.distributed backend: NCCL between GPUs, gloo between CPU processes."""
        return "nccl" if device == "cuda" else "gloo"


class Target(_Model):
    description: str = ""
    model: str  # model axis for slot names, e.g. "kimi-k3"
    weights: str
    quant: str
    node: str
    reference: str
    reference_engine: str
    candidate_engine: str
    device: Literal["cpu", "cuda"]
    geometry: dict[str, int]
    metrics: Tuple[Metric] = Field(min_length=1)
    # the decode depths a user of the target cares about (its depth profile): each one not already a decode metric
    # becomes a decode guard of the scored decode's n_tokens, measured for every arm in the same interleaved blocks,
    # so a gain at one depth cannot hide a loss at another
    profile_depths: Tuple[int] = ()
    gate: GatePolicy
    tiers: TierPolicy
    speed: SpeedPolicy
    fit: FitPolicy | None = None
    parallel: ParallelPolicy = Field(default_factory=ParallelPolicy)
    # the candidate engine's options (dtype, CUDA graphs, ...): they change what is measured, so the target pins
    # them; sealed with lock_target. Checked against the engine's typed model where engines are loaded (a round's
    # check_inputs: scoreboard.registry.option_problems), never here: loading the lock loads no engine
    candidate_options: dict[str, Any] = Field(default_factory=dict)
    # the calibration instrument's options (the bundled sparkinfer, whose faults and precisions calibrate the
    # gate's bars) when the candidate is another engine; a sparkinfer candidate's own candidate_options are the
    # instrument's, and this stays empty (scoreboard.instrument)
    instrument_options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("geometry")
    @classmethod
    def _geometry(cls, v: dict[str, int]) -> dict[str, int]:
        need = {"n_ctx", "n_batch", "n_ubatch"}
        missing = sorted(need - set(v))
        if missing:
            raise ValueError(f"geometry is missing {missing}")
        extra = sorted(set(v) - need - {"n_threads"})
        if extra:
            raise ValueError(f"geometry has unknown key(s) {extra}")
        return v

    @model_validator(mode="after")
    def _metrics(self) -> "Target":
        scored = [m for m in self.metrics if m.role == "scored"]
        if len(scored) != 1:
            raise ValueError(f"exactly one metric must have role = 'scored', found {len(scored)}")
        if scored[0].phase == "decode" and scored[0].depth not in self.gate.depths:
            raise ValueError(f"gate.depths {list(self.gate.depths)} must include the scored depth {scored[0].depth}")
        keys = [(m.phase, m.depth) for m in self.metrics]
        if len(set(keys)) != len(keys):
            raise ValueError(f"metrics {keys}: two metrics of one phase at one depth")
        if self.profile_depths:
            if scored[0].phase != "decode":
                raise ValueError("profile_depths needs a decode scored metric (its n_tokens at every depth)")
            bad = [d for d in self.profile_depths if d < 1 or d + scored[0].n_tokens > self.geometry.get("n_ctx", 0)]
            if bad or len(set(self.profile_depths)) != len(self.profile_depths):
                raise ValueError(f"profile_depths {list(self.profile_depths)}: each depth once, >= 1, with its "
                                 f"{scored[0].n_tokens} decoded tokens within geometry.n_ctx")
            have = {m.depth for m in self.metrics if m.phase == "decode"}
            extra = [Metric(phase="decode", depth=d, n_tokens=scored[0].n_tokens, role="guard")
                     for d in sorted(self.profile_depths) if d not in have]
            # decode metrics by depth, then the rest: every launch runs the deepest prefix last
            decode = sorted([m for m in self.metrics if m.phase == "decode"] + extra, key=lambda m: m.depth)
            object.__setattr__(self, "metrics", tuple(decode + [m for m in self.metrics if m.phase != "decode"]))
        return self

    @property
    def scored(self) -> Metric:
        return next(m for m in self.metrics if m.role == "scored")

    @property
    def guards(self) -> tuple[Metric, ...]:
        return tuple(m for m in self.metrics if m.role == "guard")

    def slot(self, engine: str, metric: Metric) -> str:
        return slot_name(self.model, self.node, self.quant, engine, metric.phase, metric.ctx)


class Slot(_Model):
    value: float = Field(ge=0)  # 0 = not measured
    unit: str = "tok/s"
    kind: Literal["baseline", "frontier"]
    reps: int = Field(default=0, ge=0)
    round: str = ""  # round id of the sealed receipt that measured it
    commit: str = ""  # candidate/reference commit measured
    measured_at: str = ""  # ISO 8601 UTC

    @model_validator(mode="after")
    def _provenance(self) -> "Slot":
        if self.value > 0 and not (self.round and self.commit and self.measured_at):
            raise ValueError(f"a non-zero {self.kind} needs provenance: round, commit and measured_at")
        return self


class Signer(_Model):
    """One pinned signing key: a box's Ed25519 public key, pinned by a reviewed change like any other pin."""

    public_key: str  # base64 of the raw 32-byte Ed25519 public key (what a seal's `public_key` embeds)
    added: str  # UTC date the pin was added, YYYY-MM-DD
    note: str = ""  # where the private key is kept (never the key itself)

    @field_validator("public_key")
    @classmethod
    def _key(cls, v: str) -> str:
        import base64
        import binascii

        try:
            raw = base64.b64decode(v, validate=True)
        except (binascii.Error, ValueError):
            raw = b""
        if len(raw) != 32:
            raise ValueError(f"the base64 of a raw 32-byte Ed25519 public key (`scoreboard signer new` prints it), "
                             f"got {v!r}")
        return v

    @field_validator("added")
    @classmethod
    def _added(cls, v: str) -> str:
        if not re.match(r"^\d{4}-\d{2}-\d{2}$", v):
            raise ValueError(f"a UTC date YYYY-MM-DD, got {v!r}")
        return v


class PrePinRecord(_Model):
    """A record sealed (unsigned) before any signer was pinned, trusted by review of its id and seal."""

    id: str = Field(min_length=1)  # round id (rounds/<id>.json) or calibration id (rounds/calibrations/<id>.json)
    seal_sha256: str  # its seal.sha256: any other content under that id is not the reviewed record

    @field_validator("seal_sha256")
    @classmethod
    def _sha(cls, v: str) -> str:
        return _check_sha(v, _SHA256, "a seal sha256")


class SealedBeforePin(_Model):
    rounds: Tuple[PrePinRecord] = ()
    calibrations: Tuple[PrePinRecord] = ()


_BRANCH = re.compile(r"^(?!/)(?!.*(?:\.\.|//|@\{|\.lock$|/$|\.$))[A-Za-z0-9._/-]+$")


class Lock(_Model):
    schema_: int = Field(alias="schema")
    # the branch whose commits are "main": a main round's commit must be on refs/heads/<main_branch>
    main_branch: str = "main"
    references: dict[str, Reference] = Field(default_factory=dict)
    weights: dict[str, Weights] = Field(default_factory=dict)
    nodes: dict[str, NodeClass] = Field(default_factory=dict)
    targets: dict[str, Target] = Field(default_factory=dict)
    slots: dict[str, Slot] = Field(default_factory=dict)
    signers: dict[str, Signer] = Field(default_factory=dict)  # id -> pinned public key (docs/signing.md)
    sealed_before_pin: SealedBeforePin = Field(default_factory=SealedBeforePin)

    @field_validator("main_branch")
    @classmethod
    def _branch(cls, v: str) -> str:
        if not _BRANCH.match(v) or v.startswith(("refs/", "-")):
            raise ValueError(f"a branch name without refs/heads/ (e.g. \"main\"), got {v!r}")
        return v

    def target(self, name: str) -> Target:
        if name not in self.targets:
            import difflib

            close = difflib.get_close_matches(name, self.targets, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"targets: {', '.join(sorted(self.targets))}"
            raise InputError(f"unknown target {name!r} in the lock", hint)
        return self.targets[name]

    def expected_slots(self) -> dict[str, tuple[str, str, Metric]]:
        """Every slot name the targets define: name -> (target id, engine, metric)."""
        out: dict[str, tuple[str, str, Metric]] = {}
        for tid, t in self.targets.items():
            for m in t.metrics:
                for engine in (t.reference_engine, t.candidate_engine):
                    out[t.slot(engine, m)] = (tid, engine, m)
        return out


# ----------------------------------------------------------------------------------------------
# loading

def _loc(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for p in loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif p in ("GitReference", "SdistReference") or str(p) in ("git", "pypi-sdist"):
            continue  # discriminator tag, not a document path
        else:
            parts.append(("." if parts else "") + ("schema" if p == "schema_" else str(p)))
    return "".join(parts)


_TYPE_WORDS = {"float_type": "a number", "int_type": "an integer", "bool_type": "true or false",
               "string_type": "a string", "tuple_type": "an array", "dict_type": "a table"}


def _numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _type_problem(err: Mapping[str, Any], path: str) -> str:
    """A strict-typing error with the value as written and the fix."""
    want, got = _TYPE_WORDS[err["type"]], err.get("input")
    key = path.rsplit(".", 1)[-1]
    msg = f"must be {want}, got {type(got).__name__} {got!r}"
    if isinstance(got, str) and err["type"] in ("float_type", "int_type") and _numeric(got):
        return msg + f" (write it without quotes: {key} = {got.strip()})"
    if isinstance(got, float) and err["type"] == "int_type" and got.is_integer():
        return msg + f" (write a whole number: {key} = {int(got)})"
    if isinstance(got, bool):
        return msg + " (true/false is not a number)"
    return msg


def _pydantic_problems(exc: ValidationError) -> list[str]:
    out = []
    for err in exc.errors():
        path = _loc(err["loc"])
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        if err["type"] == "missing":
            msg = "required key is missing"
        elif err["type"] in _TYPE_WORDS:
            msg = _type_problem(err, path)
        elif err["type"] == "extra_forbidden":
            msg = "unknown key (remove it or check its spelling)"
        elif err["type"] == "union_tag_invalid":
            msg = f"unknown kind {err.get('input', {}).get('kind')!r}; use 'git' or 'pypi-sdist'" if isinstance(
                err.get("input"), dict) else msg
        out.append(f"{path}: {msg}" if path else msg)
    return out


def _name_problems(data: dict[str, Any]) -> list[str]:
    """Cross-references between tables, checked on the raw document so they are reported together
    with structural errors."""
    problems: list[str] = []
    targets = _table_of(data, "targets")
    for tid, t in targets.items():
        if not isinstance(t, dict):
            continue
        base = f"targets.{tid}"
        for key, table, what in (("reference", "references", "reference"), ("weights", "weights", "weights"),
                                 ("node", "nodes", "node class")):
            value = t.get(key)
            known = _table_of(data, table)
            if isinstance(value, str) and value not in known:
                problems.append(f"{base}.{key}: unknown {what} {value!r}")
        if t.get("reference_engine") is not None and t.get("reference_engine") == t.get("candidate_engine"):
            problems.append(f"{base}.candidate_engine: must differ from reference_engine")
        problems += _parallel_problems(base, t, data)
    return problems


def _table_of(doc: Mapping[str, Any], key: str) -> dict[str, Any]:
    """`doc[key]` when it is a table, else an empty one (its own problem is reported elsewhere)."""
    value = doc.get(key)
    return value if isinstance(value, dict) else {}


def _parallel_problems(base: str, t: dict[str, Any], data: dict[str, Any]) -> list[str]:
    """A cuda target's ranks must have a GPU each on its node class (one rank per GPU, never two on one)."""
    par, nodes = t.get("parallel"), data.get("nodes")
    if not isinstance(par, dict) or not isinstance(nodes, dict) or not isinstance(nodes.get(t.get("node")), dict):
        return []
    ranks, node = par.get("ranks", 1), nodes[t["node"]]
    gpus = node.get("gpu_count")
    if t.get("device") == "cuda" and isinstance(ranks, int) and isinstance(gpus, int) and ranks > gpus:
        return [f"{base}.parallel.ranks: {ranks} ranks need {ranks} GPUs, node class {t['node']!r} has {gpus} "
                f"(set ranks <= {gpus}, or use a node class with more GPUs)"]
    cores = node.get("min_cpu_cores", 1)
    geometry = _table_of(t, "geometry")
    threads = geometry.get("n_threads") or 1
    if (t.get("device") == "cpu" and isinstance(ranks, int) and ranks > 1 and isinstance(cores, int)
            and isinstance(threads, int) and ranks * threads > cores):
        return [f"{base}.parallel.ranks: {ranks} cpu ranks x {threads} thread(s) (geometry.n_threads, per rank) on "
                f"node class {t['node']!r}, which guarantees only {cores} cores (keep ranks x n_threads <= {cores}: "
                "oversubscribed ranks time the scheduler, not the engine)"]
    return []


def _slot_problems(lock: Lock) -> list[str]:
    problems: list[str] = []
    expected = lock.expected_slots()
    seen: dict[str, str] = {}
    for name, slot in lock.slots.items():
        if name not in expected:
            problems.append(f"slots.{name}: no target defines this slot (slot names are derived from "
                            f"model/node/quant/engine/phase/ctx; see `scoreboard verify`)")
            continue
        tid, engine, _ = expected[name]
        t = lock.targets[tid]
        want = "baseline" if engine == t.reference_engine else "frontier"
        if slot.kind != want:
            problems.append(f"slots.{name}.kind: must be {want!r} for engine {engine!r}")
        upper = name.upper()
        if upper in seen:
            problems.append(f"slots.{name}: duplicate slot (same name as slots.{seen[upper]})")
        seen[upper] = name
    return problems


def _signer_problems(lock: Lock) -> list[str]:
    """A key pinned twice, or a record listed twice before the pin (each would hide the other's review)."""
    problems: list[str] = []
    keys: dict[str, str] = {}
    for sid, s in lock.signers.items():
        if s.public_key in keys:
            problems.append(f"signers.{sid}.public_key: the same key as signers.{keys[s.public_key]}")
        keys.setdefault(s.public_key, sid)
    for kind in ("rounds", "calibrations"):
        seen: set[str] = set()
        for i, r in enumerate(getattr(lock.sealed_before_pin, kind)):
            if r.id in seen:
                problems.append(f"sealed_before_pin.{kind}[{i}].id: {r.id!r} is listed twice")
            seen.add(r.id)
    return problems


def parse_lock(text: str, path: str = DEFAULT_LOCK) -> Lock:
    """Parse and validate lock text; raise LockError listing every problem with its path."""
    try:
        doc = tomlkit.parse(text)
    except Exception as exc:  # tomlkit raises its own ParseError subclasses (incl. duplicate keys)
        raise LockError([f"not valid TOML: {exc}"], path) from exc
    data = doc.unwrap()
    schema = data.get("schema")
    if schema is None:
        raise LockError(["schema: required key is missing (add `schema = 1` at the top)"], path)
    if not isinstance(schema, int) or isinstance(schema, bool):
        raise LockError([f"schema: must be an integer, got {schema!r}"], path)
    if schema != SCHEMA_MAJOR:
        raise LockError([f"schema: unknown major version {schema}; this scoreboard reads schema {SCHEMA_MAJOR}"],
                        path, hint="update your scoreboard checkout (`git pull && pip install -e .`) or use a lock of schema 1")
    names = _name_problems(data)
    try:
        lock = Lock.model_validate(data)
    except ValidationError as exc:
        raise LockError(_pydantic_problems(exc) + names, path) from None
    problems = names or (_slot_problems(lock) + _signer_problems(lock))  # slot names derive from valid targets only
    if problems:
        raise LockError(problems, path)
    return lock


def load_lock(path: str | os.PathLike[str] = DEFAULT_LOCK) -> Lock:
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{p}: lock file not found", "run from the repository root or pass --lock PATH")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise LockError([f"not UTF-8 text (byte {exc.start}: {exc.object[exc.start:exc.start + 1]!r})"], str(p),
                        hint=f"save {p} as UTF-8 (TOML files are UTF-8), then `scoreboard verify`") from None
    return parse_lock(text, str(p))


def lock_digest(path: str | os.PathLike[str]) -> str:
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# ----------------------------------------------------------------------------------------------
# writing (comment-preserving, atomic)

def atomic_write_text(path: Path, text: str, mode: int | None = None) -> None:
    """Write via a temp file in the same directory + fsync + rename: a crash leaves the old file. `mode`: the
    file's permission bits (default: the temp file's 0600)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def update_lock(path: str | os.PathLike[str], edit) -> Lock:
    """Apply `edit(doc)` to the tomlkit document, validate the result, and write it atomically.

    Comments and layout are preserved; an invalid result is refused and the file is untouched.
    """
    p = Path(path)
    doc = tomlkit.parse(p.read_text(encoding="utf-8"))
    edit(doc)
    text = tomlkit.dumps(doc)
    lock = parse_lock(text, str(p))
    atomic_write_text(p, text)
    return lock


def set_slot(doc: Any, name: str, values: dict[str, Any], comment: str | None = None) -> None:
    """Set one slot's table in a tomlkit document (used by the frontier writer and pinning)."""
    slots = doc.get("slots")
    if slots is None:
        slots = tomlkit.table(is_super_table=True)
        doc["slots"] = slots
    table = slots.get(name)
    if table is None:
        table = tomlkit.inline_table()
        slots[name] = table
    for k, v in values.items():
        table[k] = v
    if comment:
        slots[name].comment(comment)
