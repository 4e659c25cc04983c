"""The round, in order: load lock -> history -> preflight -> gate -> speed -> verdict -> seal -> frontier.

History (ratchet basis, frontier slots and their commits, ledger tip) is read and verified before any
candidate code runs; a broken history refuses the round with nothing written (scoreboard/history/held.py).

Every round that gets past loading the lock produces a receipt (REJECT, inconclusive and aborted
ones too). Ctrl-C propagates and leaves nothing written. No printing here: progress goes through the
`report` callback the CLI supplies.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import ValidationError

from .. import environment
from ..cache import cache_dir as default_cache_dir
from ..errors import EngineError, InputError, ScoreboardError, TransientError
from ..history import durable
from ..history.held import History, load_history
from ..history.trust import pinned_signing_key
from ..history.receipt import (FORMAT_VERSION, Aborted, CalibrationRef, EnvironmentRec, FitRec, GateRec, Receipt,
                               ReferenceSide, Retry, Side, SpeedRec, Verdict, WeightsRec, new_round_id, parse_receipt,
                               utc_now, validation_messages)
from ..lockfile import Lock, Target, lock_digest, load_lock
from . import armcode
from . import candidate as cand_mod
from . import ready, sandbox
from .arms import Arm, worker_arm
from .context import RoundContext, RoundLog, Targets
from .launch import prober
from .stages import (GateStage, Preflight, SpeedStage, check_node, check_reference_anchor, decode_ceiling_of,
                     fingerprint, isolation_record, model_and_fit, prepare_reference, weights)

Report = Callable[..., None]


def _noop(*_a: Any, **_k: Any) -> None:
    return None


@dataclass
class RoundOptions:
    target: str
    lock_path: Path = Path("reference.lock")
    candidate: str = "main"
    seed: int | None = None
    blocks: int | None = None
    reps: int | None = None
    seal: bool = True
    rounds_dir: Path = Path("rounds")
    cache_dir: Path = field(default_factory=default_cache_dir)  # explicit, else $SCOREBOARD_CACHE, else ~/.cache
    # tests and calibration only (never the CLI): merged over the target's own `candidate_options` from the lock,
    # key by key (a key given here wins), e.g. {"faults": ["..."]}; both, and the merge, go into the receipt
    candidate_options: dict[str, Any] = field(default_factory=dict)
    max_transient_retries: int = 2
    update_frontier: bool = True
    allow_node_mismatch: bool = False
    gate_only: bool = False  # tests: stop after the gate (no speed, no verdict, nothing sealed)
    # the operator accepts a reference build whose files differ from the ones sealed for its build key (a
    # deliberate rebuild); the receipt records the previous anchor round and every difference
    renew_reference_anchor: bool = False
    # where the reference's pinned source comes from when it must be built (engines.llamacpp.source.ReferenceSource:
    # "pin", git+<url>@<rev>, a directory, an sdist file); None = $SCOREBOARD_REFERENCE_SOURCE, else the pin's own.
    # Any transport must deliver exactly the pinned tree.
    reference_source: str | None = None

    # tests only (never an environment variable a candidate could set): False runs a target without a
    # calibration; the receipt says so and moves no frontier
    require_calibration: bool = True

    # "bwrap" (candidate workers sandboxed) or "none": an explicit opt-out for tests that cannot run under the
    # sandbox; never read from the environment (a candidate could set that); its receipts move no frontier
    isolation: str = "bwrap"
    repo: Path = cand_mod.HARNESS_ROOT  # the git repository whose commits are main and the candidates
    # an engine repository of its own (--engine-repo): the candidate engine is a plugin whose arms are commits of
    # that repository (main: its main branch), not of `repo`
    engine_repo: Path | None = None


class UnsealedReceipt(ScoreboardError):
    """Sealing failed after the round ran; `path` holds the complete unsealed receipt (a claim, not a record), or
    is None when no place could take it: then `receipt` is all there is, and the CLI prints it to stderr."""

    def __init__(self, message: str, path: Path | None, cause_hint: str | None = None,
                 receipt: dict[str, Any] | None = None):
        super().__init__(message, (f"{cause_hint}; then " if cause_hint else "fix the cause named above; then ")
                         + "run the round again (an unsealed receipt is kept for inspection, it is not a measurement "
                         "of record)")
        self.path = path
        self.receipt = receipt


@dataclass
class RoundOutcome:
    receipt: dict[str, Any]  # the receipt's JSON: the sealed body, seal aside (or as it stands when nothing was sealed)
    path: Path | None
    exit_code: int
    frontier_change: Any = None
    records: str | None = None  # where the sealed round's records were saved (durable.Saved.describe)

    def parsed(self) -> Receipt:
        """The receipt as its typed model (InputError naming every problem when it does not validate)."""
        return parse_receipt(self.receipt)


class _Abort(Exception):
    def __init__(self, stage: str, exc: ScoreboardError):
        super().__init__(exc.message)
        self.stage = stage
        self.exc = exc


@dataclass(frozen=True)
class Sources:
    """Where each candidate-side arm's engines/ come from, resolved before the receipt exists."""

    candidate: cand_mod.CandidateSource
    main: cand_mod.CandidateSource | None = None  # a PR round's main
    frontier: cand_mod.CandidateSource | None = None  # a main round: the frontier's commit, re-measured

    def named(self) -> dict[str, cand_mod.CandidateSource]:
        out = {"candidate": self.candidate}
        if self.main is not None:
            out["main"] = self.main
        if self.frontier is not None:
            out["frontier"] = self.frontier
        return out


def receipt_json(receipt: Receipt) -> dict[str, Any]:
    """The receipt's JSON: every key a section was given, and no other (the form that is sealed)."""
    return receipt.model_dump(mode="json", by_alias=True, exclude_unset=True)


class Round:
    """One round while it runs: the fixed context the stages get, and the receipt's typed sections as the
    stages return them; `assemble` builds the `Receipt` from those sections."""

    def __init__(self, opts: RoundOptions, lock: Lock, report: Report, scratch: Path, sources: Sources,
                 history: History | None = None):
        self.opts = opts
        self.lock = lock
        self.target: Target = lock.target(opts.target)
        self.report = report
        self.seed = opts.seed if opts.seed is not None else secrets.randbits(31)
        self.created_at = utc_now()
        self.round_id = new_round_id(opts.target, self.created_at)
        self.lock_sha256 = lock_digest(opts.lock_path)
        self.candidate_options = candidate_options(self.target, opts, opts.target)
        self.ctx = RoundContext(
            target_id=opts.target, target=self.target, lock=lock, seed=self.seed, cache_dir=opts.cache_dir,
            scratch=scratch, rounds_dir=opts.rounds_dir, isolation=opts.isolation,
            candidate_options=self.candidate_options, report=report, allow_node_mismatch=opts.allow_node_mismatch,
            renew_reference_anchor=opts.renew_reference_anchor, reference_source=opts.reference_source,
            blocks=opts.blocks, reps=opts.reps, round_id=self.round_id)
        self.log = RoundLog()
        self.sources = sources
        self.history = history
        self.pre: Preflight | None = None
        self.arms: list[Arm] = []  # the reference, the candidate, then main or frontier: set up after preflight
        # the receipt's sections
        self.status: Literal["verdict", "aborted"] = "verdict"
        self.calibration: CalibrationRef | None = None
        self.fingerprint: dict[str, Any] | None = None  # environment: the box (scoreboard.environment)
        self.isolation: dict[str, Any] | None = None  # environment.isolation
        self.fit: FitRec | None = None  # environment.fit
        self.weights: WeightsRec | None = None
        self.reference: ReferenceSide | None = None
        self.candidate: Side | None = None
        self.main: Side | None = None
        self.gate: GateRec | None = None
        self.speed: SpeedRec | None = None
        self.verdict: Verdict | None = None
        self.aborted: Aborted | None = None
        self.retries: list[Retry] = []
        self.stage_seconds: dict[str, float] = {}
        self.reserve: ready.SealReserve | None = None  # released just before the seal writes
        self.provenance: dict[str, Any] = {"candidate_options": {
            "lock": dict(self.target.candidate_options), "round_overrides": dict(opts.candidate_options),
            "effective": dict(self.candidate_options)}}

    # -- helpers -------------------------------------------------------------------------------
    def stage(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run one stage with timing, bounded retries of transient failures, and abort on errors."""
        self.report("stage", name=name)
        t0 = time.perf_counter()
        attempt = 0
        try:
            while True:
                try:
                    return fn()
                except TransientError as exc:
                    attempt += 1
                    self.retries.append(Retry(stage=name, error=exc.message, at=utc_now()))
                    if attempt > self.opts.max_transient_retries:
                        raise _Abort(name, exc) from exc
                    self.report("retry", stage=name, error=exc.message, attempt=attempt)
                except ScoreboardError as exc:
                    raise _Abort(name, exc) from exc
        finally:
            self.stage_seconds[name] = round(time.perf_counter() - t0, 3)

    def set_up_arms(self, pre: Preflight) -> None:
        """The round's arms once preflight prepared the reference: every candidate-side arm runs the
        candidate's engine target from its own source tree."""
        self.pre = pre
        self.arms = [pre.reference] + [worker_arm(name, self.ctx, self.log, src, pre.targets.candidate)
                                       for name, src in self.sources.named().items()]

    def arm(self, name: str) -> Arm | None:
        return next((a for a in self.arms if a.name == name), None)

    def environment(self) -> EnvironmentRec:
        """The environment section: the fingerprint and what the round observed about the box."""
        env: dict[str, Any] = dict(self.fingerprint or {})
        if self.isolation is not None:
            env["isolation"] = dict(self.isolation)
            if self.log.binds is not None and "binds" not in env["isolation"]:
                env["isolation"]["binds"] = self.log.binds
            for k, v in (self.log.sandbox or {}).items():
                env["isolation"].setdefault(k, v)
        if self.fit is not None:
            env["fit"] = self.fit
        if self.log.ranks is not None:
            env["ranks"] = self.log.ranks
            env["rank_problems"] = self.log.rank_problems
        peaks = self.log.peak_memory()
        if peaks is not None:
            env["peak_memory"] = peaks
        return EnvironmentRec.model_validate(env)

    def sections(self) -> dict[str, Any]:
        """The receipt's sections recorded so far, by field name (a section not yet known is absent or None)."""
        out: dict[str, Any] = {
            "format_version": FORMAT_VERSION, "round_id": self.round_id, "created_at": self.created_at,
            "status": self.status, "target": self.opts.target, "lock_sha256": self.lock_sha256,
            "lock_target": self.target.model_dump(mode="json", by_alias=True), "candidate": self.candidate,
            "main": self.main, "reference": self.reference, "weights": self.weights, "environment": self.environment(),
            "seed": self.seed, "geometry": dict(self.target.geometry), "gate": self.gate, "speed": self.speed,
            "verdict": self.verdict, "aborted": self.aborted, "retries": list(self.retries),
            "commands": self.log.commands, "stage_seconds": self.stage_seconds, "provenance": self.provenance}
        if self.calibration is not None:
            out["calibration"] = self.calibration
        return out

    def assemble(self) -> Receipt:
        """The receipt from the sections recorded so far, validated (docs/receipt-format.md)."""
        return Receipt(**self.sections())

    def draft(self) -> dict[str, Any]:
        """The receipt's JSON as it stands, unvalidated: a round stopped before its verdict (gate_only), or
        one whose sections do not form a valid receipt (kept for inspection, never sealed)."""
        return receipt_json(Receipt.model_construct(**self.sections()))

    @property
    def target_id(self) -> str:
        return self.opts.target


def candidate_options(target: Target, opts: RoundOptions, target_id: str) -> dict[str, Any]:
    """The candidate engine's options: the lock's, with RoundOptions.candidate_options (tests, calibration)
    over them key by key; checked against the engine's typed options model before any engine runs."""
    from .. import registry
    from ..errors import LockError

    merged = {**target.candidate_options, **opts.candidate_options}
    problems = registry.option_problems(target.candidate_engine, merged, f"targets.{target_id}.candidate_options",
                                        in_lock=False)
    if problems is None:
        raise InputError(f"targets.{target_id}.candidate_engine: engine {target.candidate_engine!r} or its typed "
                         "options could not be loaded", "`scoreboard engines` lists the installed engines")
    if problems:
        overridden = sorted(opts.candidate_options)
        raise LockError(problems, str(opts.lock_path),
                        hint=(f"keys {overridden} came from RoundOptions.candidate_options, the rest from the lock"
                              if overridden else None))
    return merged


def run_round(opts: RoundOptions, report: Report = _noop) -> RoundOutcome:
    """Run a round end to end. Input errors raise before the receipt exists (nothing is written);
    what the round observes once it has started becomes a sealed receipt (docs/receipt-format.md)."""
    lock = load_lock(opts.lock_path)
    check_inputs(opts, lock)
    # History (ratchet basis, frontier, ledger tip) is read and verified here, before any candidate
    # code runs, and held: a broken ledger refuses the round with nothing written.
    history = load_history(opts.rounds_dir, lock, opts.target, opts.lock_path)
    durable.refuse_unsettled(opts.rounds_dir, opts.lock_path)  # records a git step rolled back: nothing written
    # private to this round (0700): the arms' exports and every launch's scratch dir; removed however it ends
    scratch = sandbox.new_scratch_root()
    reserve = ready.SealReserve()  # the seal's space, held from preflight until the seal writes
    try:
        return _run(opts, lock, report, history, scratch, reserve)
    finally:
        reserve.release()
        sandbox.remove_tree(scratch)


def origin(opts: RoundOptions, target: Target) -> cand_mod.Origin:
    """The repository the round's candidate-side arms are commits of."""
    if opts.engine_repo is None:
        return cand_mod.Origin(opts.repo)
    return cand_mod.Origin(cand_mod.plugin_repo(opts.engine_repo), target.candidate_engine)


def _run(opts: RoundOptions, lock: Lock, report: Report, history: History, scratch: Path,
         reserve: ready.SealReserve) -> RoundOutcome:
    branch = lock.main_branch
    # Resolving the arms reads only the user's spec and the git repository they are commits of (the harness's,
    # or --engine-repo's): a typo here (a commit or branch that does not exist, a directory that is no checkout,
    # main off the main branch, an engine the commit's pyproject.toml does not declare) is an input error, never
    # an observation about the box, so it is refused before any receipt exists. Every git arm is a clean export
    # of its commit into this round's private scratch.
    where = origin(opts, lock.target(opts.target))
    src = where.resolve(opts.candidate, scratch, branch)
    main_src = None if src.is_main else where.main_arm(scratch, branch)
    if src.plugin is None:  # a plugin's package layout is its own (armcode checks its entry point)
        cand_mod.require_engine(src, lock.target(opts.target).candidate_engine)
    # what the end of the round needs (signing, rounds/), before anything runs: InputError, nothing written
    ready_record = ready.check_before_round(opts.rounds_dir, opts.lock_path, opts.seal, opts.update_frontier)
    if opts.seal:  # what it seals must be signed by a key the lock pins, or it would be untrusted history
        pinned_signing_key(lock, opts.lock_path, [Path.cwd(), opts.rounds_dir.resolve().parent])
        ready_record["seal_reserve"] = reserve.hold(
            [opts.rounds_dir] + ([Path(opts.lock_path).absolute().parent] if opts.update_frontier else []),
            ready.seal_bytes(opts.rounds_dir, opts.lock_path))
    calibration = _calibration(opts, lock)  # refused here: before any engine runs, nothing written
    opts.cache_dir.mkdir(parents=True, exist_ok=True)
    frontier_src, frontier_note = _frontier_source(history, where, scratch) if src.is_main else (None, None)
    rnd = Round(opts, lock, report, scratch, Sources(src, main_src, frontier_src), history)
    rnd.reserve = reserve
    rnd.calibration = CalibrationRef.model_validate(calibration)
    rnd.provenance["ready"] = ready_record
    if frontier_note:
        rnd.provenance["frontier_arm"] = frontier_note
    if where.plugin:
        rnd.provenance["engine_repo"] = armcode.repo_record(where, rnd.sources.named())
    # the harness's own worker, and main's engine, must start in the worker's own environment: an environment
    # problem (or a broken installed entry point), nothing written
    report("step", message="worker imports in the worker's own environment")
    harness_side = main_src or src
    if harness_side.plugin is None:  # a plugin arm's engine is not the installed copy: armcode.check imports it
        ready.check_worker_imports(rnd.target.candidate_engine, cand_mod.import_root(harness_side, opts.cache_dir),
                                   rnd.ctx.device_env(), "main (harness)", _prober(rnd))
    report("step", message="the candidate engine's entry point in a fresh interpreter")
    armcode.check(rnd.target.candidate_engine, harness_side, opts.cache_dir, rnd.ctx.device_env(), "main (harness)",
                  isolation=opts.isolation, scratch=scratch, target_device=rnd.target.device)
    try:
        rnd.set_up_arms(rnd.stage("preflight", lambda: _preflight(rnd)))
        assert rnd.pre is not None
        cand = rnd.arm("candidate")
        assert cand is not None
        gate = GateStage(rnd.ctx, rnd.pre, cand, rnd.log)
        rnd.stage("gate", lambda: _gate(rnd, gate))
        assert rnd.gate is not None
        if opts.gate_only:
            return RoundOutcome(rnd.draft(), None, 0 if rnd.gate.pass_ else 2)
        if rnd.gate.pass_:
            rnd.stage("speed", lambda: _speed(rnd, gate))
        rnd.stage("verdict", lambda: _verdict(rnd))
    except _Abort as ab:
        _mark_aborted(rnd, ab.stage, ab.exc)
    return _finish(rnd)


def check_inputs(opts: RoundOptions, lock: Lock) -> None:
    """Everything the user typed or the lock says, checked before anything runs (InputError, exit 1): the
    target's engines and, through their typed options models, what the lock pins for the candidate.

    Only facts that need no measurement belong here: the options (--reference-source parsed too), the
    target's names and engines, the generated weights' file list, whether the weights can seal at all, and
    whether this box is of the target's node class at all (a target typed for another box). What else needs
    the box (hashing shards, building the reference, running an engine) is observed by the round.
    """
    from .. import registry
    from ..errors import LockError
    from .stages import check_reference_source, refuse_other_node

    t = lock.target(opts.target)
    check_reference_source(opts.reference_source)
    if opts.seed is not None and not 0 <= opts.seed < 2 ** 63:
        raise InputError(f"--seed {opts.seed}: must be an integer from 0 to 2**63-1",
                         "omit --seed for an unpredictable one, or pass e.g. --seed 7")
    least_blocks = max(2, t.tiers.min_blocks)
    for name, value, least, why in (
            ("--blocks", opts.blocks, least_blocks,
             f"target {opts.target}'s tier policy needs min_blocks = {t.tiers.min_blocks} paired blocks before "
             "any verdict is more than inconclusive"),
            ("--reps", opts.reps, 1, "every block needs at least one timed rep")):
        if value is not None and value < least:
            raise InputError(f"{name} {value}: must be at least {least} ({why})",
                             f"pass {name} {least} or more, or omit it for the policy's default")
    known = registry.available()
    for field_name in ("reference_engine", "candidate_engine"):
        engine = getattr(t, field_name)
        if engine not in known:
            raise InputError(f"targets.{opts.target}.{field_name}: unknown engine {engine!r} (registered: "
                             f"{', '.join(known) or 'none'})", f"fix {field_name} in {opts.lock_path}, or install "
                             "the engine's package (`scoreboard engines` lists what is registered)")
    installed = armcode.installed_elsewhere(t.candidate_engine) if opts.engine_repo is None else None
    if installed:
        raise InputError(f"targets.{opts.target}.candidate_engine: engine {t.candidate_engine!r} is installed "
                         f"({installed}), not part of this repository's engines/: every arm of a round of this "
                         "repository's commits would run that one installed copy",
                         f"compare the plugin's own commits: `scoreboard round run --target {opts.target} --engine-repo "
                         "<the plugin's git checkout> --candidate main|<commit>`")
    lock_options = registry.option_problems(t.candidate_engine, t.candidate_options,
                                            f"targets.{opts.target}.candidate_options")
    if lock_options:  # what the lock pins, by the engine's LockOptions (the loader loads no engine to check it)
        raise LockError(lock_options, str(opts.lock_path))
    w = lock.weights[t.weights]
    if w.repo == "generated":
        from ..weights.generate import shard_names
        from ..weights.presets import get_spec

        want = shard_names(get_spec(w.spec))
        have = [f.path for f in w.files]
        if have != want:
            raise InputError(f"weights.{t.weights}.files: spec {w.spec} writes {want}, the lock lists {have}",
                             f"fix the file list in {opts.lock_path}")
    if opts.seal and not w.fully_pinned:
        raise InputError(f"target {opts.target}: weights {t.weights} are not fully pinned, so the round could "
                         "not seal what it measures",
                         f"pin them first: `scoreboard pin weights --target {opts.target} --revision <40-hex Hub commit>` "
                         "(or run with --no-seal for an unsealed trial)")
    refuse_other_node(lock, opts.target, allow=opts.allow_node_mismatch)


def _preflight(rnd: Round) -> Preflight:
    """A PR candidate's own worker imports and entry point first (its failure is the candidate's, recorded), then
    preflight."""
    src = rnd.sources.candidate
    if not src.is_main:
        who = f"candidate ({src.label})"
        if src.plugin is None:
            ready.check_worker_imports(rnd.target.candidate_engine, cand_mod.import_root(src, rnd.opts.cache_dir),
                                       rnd.ctx.device_env(), who, _prober(rnd), candidate=True)
        armcode.check(rnd.target.candidate_engine, src, rnd.opts.cache_dir, rnd.ctx.device_env(), who, candidate=True,
                      isolation=rnd.ctx.isolation, scratch=rnd.ctx.scratch, target_device=rnd.target.device)
    return preflight(rnd)


def _prober(rnd: Round) -> ready.ProbeLaunch:
    """The import probe's launch: the sandbox, limits and environment of the round's every other launch."""
    return prober(rnd.target.device, rnd.ctx.scratch, rnd.opts.cache_dir, rnd.ctx.isolation,
                  on_launch=rnd.log.record_launch)


def preflight(rnd: Round) -> Preflight:
    """Refuse rather than run something else: node class, weights, model config, fit, reference build.
    Each section is recorded as soon as it is known, so a refusal later in preflight still shows it."""
    return with_reference(rnd, preflight_checks(rnd))


@dataclass(frozen=True)
class Checked:
    """Preflight short of the reference: the node, the sandbox, the weights re-hashed, the model and its fit."""

    shards: tuple[Path, ...]
    config: Any
    fit: Any
    ceiling: dict[str, Any] | None
    targets: Targets


def preflight_checks(rnd: Round) -> Checked:
    """Every preflight section but the reference's preparation (which, on a bare box, is a build of minutes)."""
    ctx = rnd.ctx
    rnd.fingerprint = fingerprint(ctx)
    rnd.isolation = isolation_record(ctx.isolation, rnd.sources.named())  # refuses a missing/broken sandbox
    check_node(ctx, rnd.fingerprint)
    shards, rnd.weights = weights(ctx)
    config, fit, rnd.fit = model_and_fit(ctx, shards)
    ceiling = decode_ceiling_of(ctx, shards, config)
    return Checked(shards, config, fit, ceiling, ctx.targets(shards))


def with_reference(rnd: Round, checked: Checked) -> Preflight:
    """The reference prepared at its pin (built or re-verified) and its files checked against the anchor."""
    reference, rnd.reference = prepare_reference(rnd.ctx, rnd.log, checked.targets)
    check_reference_anchor(rnd.ctx, rnd.reference.identity)
    return Preflight(checked.shards, checked.config, checked.fit, checked.ceiling, checked.targets, reference)


def _gate(rnd: Round, gate: GateStage) -> None:
    ref, res = gate.collect()
    identity = res.identity
    if not isinstance(identity, dict):
        raise EngineError(f"the gate worker's identity is {type(identity).__name__}, not an object")
    cand, main = rnd.arm("candidate"), rnd.arm("main")
    assert cand is not None and rnd.history is not None
    rnd.candidate = Side.model_validate(cand.side(identity))
    if main is not None:
        rnd.main = Side.model_validate(main.side({}))
    # the ratchet basis was read and seal-checked at preflight, before this candidate's process ran
    # (which may have hidden or rewritten rounds/ since): never re-read here
    h = rnd.history
    rnd.gate = gate.judge(ref, res, h.ratchet_baselines(), h.ratchet.round_id if h.ratchet else None)


def _speed(rnd: Round, gate: GateStage) -> None:
    assert rnd.pre is not None and rnd.history is not None
    stage = SpeedStage(rnd.ctx, rnd.pre, rnd.arms, gate, rnd.history)
    rnd.speed = stage.measure()  # measured: recorded before any check below can fail
    rnd.speed = stage.check(rnd.speed)


def _frontier_source(history: History, where: cand_mod.Origin,
                     scratch: Path) -> tuple[cand_mod.CandidateSource | None, str | None]:
    """A main round re-measures the commit that set the scored frontier, as the arm "frontier", so its
    gain is a same-round ratio (None when there is no frontier yet: the round is a BASELINE), with the
    receipt's note when that commit cannot run here."""
    fs = history.scored_frontier
    if fs is None:
        return None, None
    from ..engine import CONTRACT_VERSION

    try:
        version = where.contract_version(fs.commit, CONTRACT_VERSION)
    except InputError as exc:
        raise _frontier_missing(fs, exc, where.repo) from None
    if version != CONTRACT_VERSION:
        # its engine cannot run under this harness's worker: the verdict falls back to the pinned slot, and
        # the receipt says why (the next main round re-measures a frontier this round sets)
        return None, (f"not measured: the frontier's commit {fs.commit[:12]} speaks engine contract {version}, "
                      f"this harness {CONTRACT_VERSION}; the verdict is against the pinned slot {fs.slot}")
    try:
        return where.export(fs.commit, "frontier", True, scratch), None
    except InputError as exc:
        raise _frontier_missing(fs, exc, where.repo) from None


def _frontier_missing(fs: Any, exc: InputError, repo: Path) -> InputError:
    return InputError(
        f"the frontier's commit {fs.commit} (slot {fs.slot}, sealed by round {fs.round_id}) cannot be checked "
        f"out from {repo}: {exc.message}",
        f"fetch it (`git fetch origin {fs.commit}`, or `git fetch --unshallow` in a shallow clone); if main's "
        "history was rewritten and the commit is gone, lower the frontier deliberately with "
        "`scoreboard frontier lower` from a sealed receipt of today's main")


def _calibration(opts: RoundOptions, lock: Lock) -> dict[str, Any]:
    """What the receipt says about the calibration the target's bars rely on (InputError when none holds)."""
    from ..calibrate import check_calibration, skipped

    lock.target(opts.target)
    if not opts.require_calibration:
        return skipped("RoundOptions.require_calibration is False (a test round): no calibration was checked")
    return check_calibration(lock, opts.target, opts.rounds_dir, opts.lock_path)


def _verdict(rnd: Round) -> None:
    from ..tiers import Scoring, verdict_from_scoring

    assert rnd.candidate is not None  # recorded by the gate stage
    v = verdict_from_scoring(Scoring(rnd.gate, rnd.speed, rnd.seed, rnd.candidate.is_main), rnd.target)
    rnd.verdict = Verdict.model_validate(v.as_dict())  # the receipt writes every verdict field, defaults included


def _mark_aborted(rnd: Round, stage: str, exc: ScoreboardError) -> None:
    rnd.status = "aborted"
    rnd.verdict = None
    reason = exc.message + (f" (next: {exc.hint})" if exc.hint else "")
    rnd.aborted = Aborted(stage=stage, reason=reason, transient=isinstance(exc, TransientError))
    _fill_sides(rnd)


def _fill_sides(rnd: Round) -> None:
    """An aborted round still records who was going to run; unknown identities stay empty."""
    t, src = rnd.target, rnd.sources.candidate
    if rnd.candidate is None:
        rnd.candidate = Side(engine=t.candidate_engine, label=rnd.opts.candidate, commit=src.commit,
                             dirty=src.dirty, is_main=src.is_main, identity={})
    if rnd.reference is None:
        rnd.reference = ReferenceSide(engine=t.reference_engine, identity={})
    if rnd.candidate.is_main:
        rnd.main = None


def _finish(rnd: Round) -> RoundOutcome:
    from ..history.records import write_receipt

    _fill_sides(rnd)
    if not rnd.fingerprint:
        rnd.fingerprint = environment.fingerprint()
    path, change = None, None
    weights_pinned = bool(rnd.weights and rnd.weights.fully_pinned)
    if rnd.opts.seal and not weights_pinned and rnd.status == "verdict":
        rnd.provenance["unsealable"] = "weights not fully pinned: the round ran but cannot seal"
    receipt = _validated(rnd)
    r = receipt_json(receipt)
    # An aborted round is sealed too, but never on weights that cannot seal (check_inputs refuses those)
    if rnd.opts.seal and rnd.lock.weights[rnd.target.weights].fully_pinned and \
            (weights_pinned or receipt.status == "aborted"):
        rnd.report("stage", name="seal")  # the seal cannot time itself inside the bytes it seals
        try:
            if rnd.history is not None:
                rnd.history.check_extends(rnd.opts.rounds_dir)
            if rnd.reserve is not None:
                rnd.reserve.release()  # the space held since preflight, for the writes below
            path = write_receipt(r, rnd.opts.rounds_dir)
        except Exception as exc:  # whatever broke the seal, what was measured is kept
            cause = exc.message if isinstance(exc, ScoreboardError) else f"{type(exc).__name__}: {exc}"
            raise _unsealed(f"sealing failed: {cause}", r, rnd, getattr(exc, "hint", None)) from exc
        if receipt.status == "verdict" and receipt.candidate.is_main and rnd.opts.update_frontier:
            from ..history.frontier import raise_frontier

            change = raise_frontier(rnd.opts.lock_path, path, rnd.opts.rounds_dir)
        return RoundOutcome(r, path, _exit_code(receipt), change, _durable(rnd, path).describe())
    return RoundOutcome(r, path, _exit_code(receipt), change)


def _durable(rnd: Round, path: Path) -> durable.Saved:
    """The sealed round's records committed to the records ref before the round reports success."""
    try:
        return durable.save(rnd.opts.rounds_dir, rnd.opts.lock_path, f"round {rnd.round_id}")
    except ScoreboardError as exc:
        raise ScoreboardError(f"the round is sealed ({path}) and on the ledger, but its records were not saved to "
                              f"{durable.locate(rnd.opts.rounds_dir).describe()}: {exc.message}",
                              f"fix the cause, then `scoreboard frontier resume --lock {rnd.opts.lock_path} --rounds "
                              f"{rnd.opts.rounds_dir}` saves them") from exc


def _validated(rnd: Round) -> Receipt:
    """The round's Receipt; sections that do not form a valid one are saved unsealed and named."""
    try:
        return rnd.assemble()
    except ValidationError as exc:
        problems = validation_messages(exc)
        raise _unsealed(f"the round's receipt is not valid ({len(problems)} problem(s): {'; '.join(problems)})",
                        rnd.draft(), rnd) from None


def _unsealed(what: str, receipt: dict[str, Any], rnd: Round, hint: str | None = None) -> UnsealedReceipt:
    """The error of a round whose receipt could not be sealed, after saving the receipt wherever it can go."""
    saved, failed = ready.save_unsealed(receipt, rnd.opts.rounds_dir, rnd.opts.cache_dir)
    if saved is not None:
        return UnsealedReceipt(f"{what}; the complete unsealed receipt is saved at {saved}", saved, hint, receipt)
    return UnsealedReceipt(f"{what}; the complete unsealed receipt could not be written anywhere "
                           f"({'; '.join(failed)}): it follows on stderr as JSON", None, hint, receipt)


def _exit_code(r: Receipt) -> int:
    if r.status == "aborted" or r.verdict is None:
        return 1
    return 0 if r.verdict.compliant else 2  # REJECT or regression
