"""Measuring one calibration (`scoreboard gate calibrate TARGET`): the instrument's arms, and a candidate engine's own.

What a record means, how it is separated, sealed, chained and checked is scoreboard.calibrate; the instrument and
an engine's additions are scoreboard.instrument. This module runs the arms through the round's own code
(preflight, GateStage rows and grading, fresh sandboxed workers) and assembles the record. No printing here:
progress goes through `report`.
"""

from __future__ import annotations

import os
import secrets
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, cast

import numpy as np

from . import instrument as inst
from .cache import cache_dir as default_cache_dir
from .calibrate import (FORMAT_VERSION, _forbidden_roots, definition, definition_sha256, extension_base,
                        file_bytes, join_parts, new_calibration_id, noise_pair, part_changes, read_chain,
                        separation_problems, summary, write_record)
from .errors import InputError
from .history.receipt import utc_now
from .lockfile import Target, lock_digest, load_lock

DEFAULT_SEEDS = 20
# seeds per worker launch (weights loaded once: start-up dominates on small models; on the H200 a sparkinfer
# worker spends ~6 s in torch import, CUDA init and the weight load before its first seed): the default 20 seeds
# in one launch per arm; each seed in a launch gets the target's worker timeout (speed.timeout_s)
SEEDS_PER_WORKER = 20

Report = Callable[..., None]


def _noop(*_a: Any, **_k: Any) -> None:
    return None


@dataclass
class CalibrationOptions:
    target: str
    lock_path: Path = Path("reference.lock")
    candidate: str = "main"  # the instrument's commit of this harness's repository (main | <rev> | <path>)
    seeds: int = DEFAULT_SEEDS
    first_seed: int | None = None  # seeds first_seed .. first_seed + seeds - 1; default: unpredictable seeds
    rounds_dir: Path = Path("rounds")
    cache_dir: Path = field(default_factory=default_cache_dir)  # explicit, else $SCOREBOARD_CACHE, else ~/.cache
    seal: bool = True
    allow_node_mismatch: bool = False
    # the operator accepts a reference build whose files differ from the ones the latest sealed round recorded
    # for its build key (a deliberate rebuild, e.g. on a fresh box); the record's reference identity says so
    renew_reference_anchor: bool = False
    # the candidate engine's own repository (a plugin): its faults and precisions are measured from its main
    engine_repo: Path | None = None
    repo: Path | None = None  # the git repository whose commits --candidate names (None: the harness's checkout)
    # add the seeds to the target's latest calibration (calibrate.extension_base) instead of calibrating afresh: the
    # sealed record then holds that record's seeds and runs as sealed, then these
    extend: bool = False


@dataclass
class CalibrationOutcome:
    record: dict[str, Any]
    path: Path | None
    problems: list[str] = field(default_factory=list)

    @property
    def separated(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class Rows:
    """Gate rows of one prompt: the positions graded at each depth, every position sorted, the token ids sent."""

    per_depth: dict[int, list[int]]
    positions: list[int]
    ids: tuple[int, ...]


@dataclass(frozen=True)
class SeedRows:
    """One seed's gate rows, as a round with that seed draws them (and the fault suite's: the same rows at the
    target's gate.fault_depths, on the prompt's prefix through the deepest), and the reference's logits."""

    seed: int
    prompt: Any  # the gate's Prompt
    rows: Rows
    fault_rows: Rows
    reference: np.ndarray | None = None  # float32 [len(rows.positions), vocab], once the reference has run

    def of(self, arm: str) -> Rows:
        return self.fault_rows if arm.startswith("fault:") else self.rows

    def reference_at(self, positions: list[int]) -> np.ndarray:
        """The reference's rows at `positions` (a subset of rows.positions)."""
        assert self.reference is not None
        at = {p: i for i, p in enumerate(self.rows.positions)}
        return self.reference[[at[p] for p in positions]]


def run_calibration(opts: CalibrationOptions, report: Report = _noop) -> CalibrationOutcome:
    """Measure, summarize, seal and record (unless opts.seal is False). Bad input raises before any engine runs."""
    from .round import ready, sandbox

    scratch = sandbox.new_scratch_root()  # private to this calibration: the arms' exports, every launch's dir
    reserve = ready.SealReserve()  # the seal's space, held from before the first measurement until it writes
    try:
        return _run(opts, report, scratch, reserve)
    finally:
        reserve.release()
        sandbox.remove_tree(scratch)


def _seeds(opts: CalibrationOptions, taken: Iterable[int] = ()) -> list[int]:
    """first_seed.., else unpredictable: a round's seed is secrets.randbits(31), the calibration samples that space;
    never one of `taken` (the seeds of the calibration being extended)."""
    if opts.seeds < 1:
        raise InputError(f"--seeds {opts.seeds}: must be at least 1", "20 seeds is the default; 2 is a smoke test")
    used = set(taken)
    if opts.first_seed is not None:
        given = [opts.first_seed + i for i in range(opts.seeds)]
        again = sorted(used.intersection(given))
        if again:
            raise InputError(f"--first-seed {opts.first_seed}: seeds {again[:8]} are already in the calibration being "
                             "extended", "pick a --first-seed past them, or leave it out (unpredictable seeds)")
        return given
    rng = secrets.SystemRandom()
    seeds: list[int] = []
    while len(seeds) < opts.seeds:
        s = rng.randrange(1 << 31)
        if s not in used:
            used.add(s)
            seeds.append(s)
    return seeds


def _engines_tree(repo: Path) -> Any:
    """commit -> the git tree hash of engines/ at that commit in `repo` (what round.candidate.export checks an
    export against), None when git does not have it."""
    from .round.candidate import _git

    def tree(commit: str) -> str | None:
        try:
            return _git(["rev-parse", "--verify", f"{commit}^{{commit}}:engines"], repo) or None
        except InputError:
            return None
    return tree


def _check_sealable(opts: CalibrationOptions, lock: Any) -> None:
    """Whatever sealing needs, before anything is measured: a signing key the lock pins, records no git step
    rolled back, the chain readable, rounds/ writable."""
    from .history.durable import refuse_unsettled
    from .history.trust import pinned_signing_key

    pinned_signing_key(lock, opts.lock_path, _forbidden_roots(opts.rounds_dir))
    refuse_unsettled(opts.rounds_dir, opts.lock_path)  # never chain onto records a git step rolled back
    read_chain(opts.rounds_dir)
    opts.rounds_dir.mkdir(parents=True, exist_ok=True)
    if not os.access(opts.rounds_dir, os.W_OK):
        raise InputError(f"{opts.rounds_dir}: not writable; the calibration record could not be sealed there",
                         "pass --out DIR of a writable rounds directory")


def _engine_suite(opts: CalibrationOptions, target: Target, scratch: Path, main_branch: str,
                  instrument_src: Any) -> inst.EngineSuite | None:
    """The candidate engine's own additions (None when the candidate is the instrument), its hook asked in a fresh
    interpreter and every arm's options checked: all before anything runs."""
    from .round import armcode

    engine = target.candidate_engine
    if engine == inst.INSTRUMENT:
        if opts.engine_repo is not None:
            raise InputError(f"--engine-repo {opts.engine_repo}: target {opts.target}'s candidate is the instrument "
                             f"({inst.INSTRUMENT}), which this repository holds", "omit --engine-repo")
        return None
    source, note = inst.engine_source(engine, opts.engine_repo, scratch, main_branch, instrument_src)
    if source is None:
        return inst.EngineSuite(engine, None, None, note)
    check = armcode.check(engine, source, opts.cache_dir, None, "calibration", device=target.device,
                          isolation="bwrap", scratch=scratch, target_device=target.device)
    if check is None:  # no sandbox here: preflight refuses the calibration before anything is measured
        return inst.EngineSuite(engine, source, None, "not measured: the sandbox cannot start on this machine")
    if check.calibration is None:
        return inst.EngineSuite(engine, source, None, "the engine declares no faults or precisions of its own "
                                                      "(Engine.calibration returns None)")
    arms = inst.suite_arms(engine, check.calibration)
    inst.check_suite_options(engine, opts.target, target.candidate_options, arms)
    return inst.EngineSuite(engine, source, check.calibration, arms=arms)


def _run(opts: CalibrationOptions, report: Report, scratch: Path, reserve: Any) -> CalibrationOutcome:
    from .round import candidate as cand_mod
    from .round.arms import WorkerClient, worker_arm
    from .round.run import Round, RoundOptions, Sources, preflight_checks, with_reference
    from .round.stages import GateStage, Preflight

    lock = load_lock(opts.lock_path)
    target = lock.target(opts.target)
    view = inst.instrument_view(lock, opts.target)  # the target as the instrument's workers run it
    if opts.seal:
        _check_sealable(opts, lock)
        from .round.ready import RESERVE_MIN_BYTES

        reserve.hold([opts.rounds_dir], RESERVE_MIN_BYTES)
    t_start, created = time.perf_counter(), utc_now()
    stage_seconds: dict[str, float] = {}
    repo = opts.repo or cand_mod.HARNESS_ROOT
    source = cand_mod.resolve(opts.candidate, scratch, repo, lock.main_branch)
    base_rec = None
    if opts.extend:  # refused here, before any engine runs, unless the seeds can join that record
        base_rec = extension_base(lock, opts.target, opts.rounds_dir, opts.lock_path, _engines_tree(repo),
                                  source.engines_tree if source.kind == "git" else "")
    seeds = _seeds(opts, base_rec[0]["seeds"] if base_rec else ())
    round_opts = RoundOptions(target=opts.target, lock_path=opts.lock_path, candidate=opts.candidate, seed=seeds[0],
                              seal=False, rounds_dir=opts.rounds_dir, cache_dir=opts.cache_dir,
                              allow_node_mismatch=opts.allow_node_mismatch, require_calibration=False,
                              renew_reference_anchor=opts.renew_reference_anchor)
    opts.cache_dir.mkdir(parents=True, exist_ok=True)
    report("stage", name="instrument")
    suite = _engine_suite(opts, target, scratch, lock.main_branch, source)
    rnd = Round(round_opts, view, report, scratch, Sources(source))
    report("stage", name="preflight")
    t0 = time.perf_counter()
    checked = preflight_checks(rnd)  # everything but the reference: node, sandbox, weights, model, fit
    stage_seconds["preflight"] = round(time.perf_counter() - t0, 3)
    # The reference's preparation runs beside the instrument's workers, which need nothing of it: on a bare box it
    # is a build from the pinned source (CUDA llama.cpp: ~5 minutes of CPU on one H200's host), and the workers
    # spend that time on the GPU. Its logits come after both; a failed build stops the workers at the next arm.
    with ThreadPoolExecutor(1, thread_name_prefix="scoreboard-reference") as pool:
        def prepare() -> Preflight:
            t = time.perf_counter()
            done = with_reference(rnd, checked)
            stage_seconds["reference_prepare"] = round(time.perf_counter() - t, 3)
            return done
        ref_job = pool.submit(prepare)

        def reference_failed() -> None:
            if ref_job.done():
                ref_job.result()  # raises the preparation's own error

        cand = worker_arm("candidate", rnd.ctx, rnd.log, source, checked.targets.candidate)
        # the gate draws prompts and rows without the reference; its reference arm is the one prepared above
        gate = GateStage(rnd.ctx, Preflight(checked.shards, checked.config, checked.fit, checked.ceiling,
                                            checked.targets, cast(Any, None)), cand, rnd.log)
        base = checked.targets.candidate
        noise = noise_pair(opts.target, view.target(opts.target), base.options)
        rows = _seed_rows(gate, seeds, target.gate.graded_fault_depths())

        report("stage", name="candidate workers")
        t0 = time.perf_counter()
        inst_arms = _instrument_arms(noise)
        logits, identities = _measure(cand.worker(), base, inst_arms, rows, target, report, reference_failed)
        if suite is not None and suite.arms:
            engine_client = WorkerClient(rnd.ctx, rnd.log, suite.source, base, engine=suite.engine)
            engine_base = replace(base, options=dict(target.candidate_options))
            got, ids = _measure(engine_client, engine_base, suite.arms, rows, target, report, reference_failed)
            logits |= got
            identities |= {f"engine:{k}": v for k, v in ids.items()}
        stage_seconds["candidate"] = round(time.perf_counter() - t0, 3)
        if not ref_job.done():
            report("step", message="waiting for the reference's preparation")
        pre = ref_job.result()
    rnd.set_up_arms(pre)

    report("stage", name="reference")
    t0 = time.perf_counter()
    rows = _reference_rows(pre, rnd, rows, report)
    stage_seconds["reference"] = round(time.perf_counter() - t0, 3)

    runs = [_grade(gate, r, i, logits, noise, suite) for i, r in enumerate(rows)]
    record = _record(opts, lock, target, created, seeds, source, rnd, base, noise, suite, identities, runs,
                     stage_seconds)
    if base_rec is not None:
        changed = part_changes(base_rec[0], record)
        if changed:  # measured, so kept: sealed as a calibration of these seeds alone, saying why it stands apart
            record["extension_refused"] = {"calibration_id": base_rec[0]["calibration_id"], "changes": changed}
        else:
            record = join_parts(base_rec[0], base_rec[1], record)
    problems = separation_problems(record, target.gate)
    record["separation"] = {"separated": not problems, "problems": problems}
    record["stage_seconds"]["total"] = round(time.perf_counter() - t_start, 3)
    return CalibrationOutcome(record, _seal(opts, record, report, reserve), problems)


def _seed_rows(gate: Any, seeds: list[int], fault_depths: tuple[int, ...]) -> list[SeedRows]:
    """Each seed's prompt as a round with that seed draws it, its gate rows, and the fault suite's rows."""
    out = []
    for seed in seeds:
        prompt = gate.draw(seed)
        out.append(SeedRows(seed, prompt, Rows(*gate.rows(prompt)), Rows(*gate.rows(prompt, fault_depths))))
    return out


def _reference_rows(pre: Any, rnd: Any, rows: list[SeedRows], report: Report) -> list[SeedRows]:
    """The reference's logits at every seed's gate rows (the fault rows are a subset of them)."""
    from .engine import LogitsRequest

    out = []
    for i, r in enumerate(rows):
        report("progress", task="reference logits", done=i, total=len(rows), message=f"seed {r.seed}")
        ref = pre.reference.logits(LogitsRequest(r.rows.ids, tuple(r.rows.positions), pre.targets.geometry))
        if ref.command:
            rnd.log.command(ref.command)
        out.append(replace(r, reference=ref.logits))
    report("progress", task="reference logits", done=len(rows), total=len(rows), message="done")
    return out


def _instrument_arms(noise: dict[str, str]) -> list[tuple[str, dict[str, Any]]]:
    """(arm name, extra options) of the instrument: as it is, its other precision, every fault."""
    arms: list[tuple[str, dict[str, Any]]] = [("correct", {})]
    arms += [(f"dtype:{dt}", {"dtype": dt}) for dt in (noise["precise"], noise["coarse"])
             if dt != noise["candidate_dtype"]]
    return arms + [(f"fault:{f}", {"faults": [f]}) for f in inst.instrument_faults()]


def _measure(client: Any, base: Any, arms: list[tuple[str, dict[str, Any]]], rows: list[SeedRows], target: Target,
             report: Report, stop: Callable[[], None] = _noop) -> tuple[dict[str, list[np.ndarray]], dict[str, Any]]:
    """Every arm's logits for every seed (SEEDS_PER_WORKER seeds per fresh worker) at its rows (a fault's: the
    fault rows), and its identity; `stop` raises before a launch when the calibration cannot go on."""
    from .worker.protocol import LogitsOp, LogitsRows

    batches = [list(range(i, min(i + SEEDS_PER_WORKER, len(rows)))) for i in range(0, len(rows), SEEDS_PER_WORKER)]
    total, done = len(arms) * len(batches), 0
    logits: dict[str, list[np.ndarray]] = {}
    identities: dict[str, Any] = {}
    for name, extra in arms:
        variant = replace(base, options={**{k: v for k, v in base.options.items() if k != "faults"}, **extra})
        out: list[np.ndarray] = []
        for b in batches:
            stop()
            report("progress", task="candidate workers", done=done, total=total,
                   message=f"{client.engine_name} {name}: seeds {', '.join(str(rows[i].seed) for i in b)}")
            res = client.call(LogitsOp(requests=tuple(LogitsRows.of(rows[i].of(name).ids, rows[i].of(name).positions)
                                                      for i in b)),
                              target=variant, timeout_s=target.speed.timeout_s * len(b)).result
            identities.setdefault(name, res.identity)
            out += [np.load(f.path) for f in res.logits or []]
            done += 1
        logits[name] = out
    report("progress", task="candidate workers", done=total, total=total, message=f"{client.engine_name} done")
    return logits, identities


def _depth_numbers(result: Any) -> list[dict[str, Any]]:
    return [{"depth": d.depth, "rows": d.rows, "kl_mean": d.kl_mean, "kl_p99": d.kl_p99, "kl_max": d.kl_max,
             "top1": d.top1} for d in result.depths]


def _grade(gate: Any, r: SeedRows, i: int, logits: dict[str, list[np.ndarray]], noise: dict[str, str],
           suite: inst.EngineSuite | None) -> dict[str, Any]:
    """One seed's numbers per arm: the correct instrument and every fault against the reference; each noise floor
    with its precise side graded as the "reference"."""
    def grade(p: np.ndarray, q: np.ndarray, at: Rows = r.rows) -> list[dict[str, Any]]:
        return _depth_numbers(gate.grade(at.per_depth, at.positions, p, q))

    assert r.reference is not None
    own = "correct"
    precise = own if noise["precise"] == noise["candidate_dtype"] else f"dtype:{noise['precise']}"
    coarse = own if noise["coarse"] == noise["candidate_dtype"] else f"dtype:{noise['coarse']}"
    f = r.fault_rows
    faults = {name.removeprefix("fault:"): grade(r.reference_at(f.positions), arm[i], f)
              for name, arm in logits.items() if name.startswith("fault:")}
    run: dict[str, Any] = {"seed": r.seed, "prompt": r.prompt.describe(), "correct": grade(r.reference, logits[own][i]),
                           "noise_floor": grade(logits[precise][i], logits[coarse][i]), "faults": faults}
    if suite is not None and suite.suite is not None and suite.suite.precisions is not None:
        run["engine_noise_floor"] = grade(logits["engine_precise"][i], logits["engine_coarse"][i])
    return run


def _record(opts: CalibrationOptions, lock: Any, target: Target, created: str, seeds: list[int], source: Any,
            rnd: Any, base: Any, noise: dict[str, str], suite: inst.EngineSuite | None, identities: dict[str, Any],
            runs: list[dict[str, Any]], stage_seconds: dict[str, float]) -> dict[str, Any]:
    defn = definition(lock, opts.target)
    faults = list(inst.instrument_faults())
    if suite is not None and suite.suite is not None:
        faults += [inst.fault_arm(suite.engine, n) for n in sorted(suite.suite.faults)]
    record: dict[str, Any] = {
        "kind": "calibration", "format_version": FORMAT_VERSION,
        "calibration_id": new_calibration_id(opts.target, created), "created_at": created, "target": opts.target,
        "lock_sha256": lock_digest(opts.lock_path), "lock_target": target.model_dump(mode="json", by_alias=True),
        "definition": defn, "definition_sha256": definition_sha256(defn),
        "policy": {"margin": target.gate.calibration_margin, "kl_max": target.gate.kl_max,
                   "kl_p99_max": target.gate.kl_p99_max, "top1_min": target.gate.top1_min,
                   "depths": list(target.gate.depths), "rows_per_depth": target.gate.rows_per_depth,
                   "fault_depths": list(target.gate.graded_fault_depths())},
        "seeds": seeds,
        # what measured: the bundled instrument at a commit of this harness's repository (never a candidate's)
        "instrument": {"engine": inst.INSTRUMENT, "label": source.label, "commit": source.commit,
                       "dirty": source.dirty, "is_main": source.is_main, "kind": source.kind,
                       "engines_tree": source.engines_tree, "options": dict(base.options),
                       "identity": identities["correct"]},
        "reference": {"engine": target.reference_engine, "identity": rnd.reference.identity if rnd.reference else {}},
        "noise_floor": {**noise, "identities": {n: identities[n] for n in identities if n.startswith("dtype:")}},
        "faults": faults,
        "fault_identities": {f: identities.get(f"fault:{f}") or identities.get(f"engine:fault:{f}") for f in faults},
        "runs": runs,
        "environment": rnd.environment().model_dump(mode="json", by_alias=True, exclude_unset=True),
        "commands": rnd.log.commands, "stage_seconds": stage_seconds,
    }
    if suite is not None:
        record["engine"] = {**suite.record(), "identities": {k.removeprefix("engine:"): v for k, v in
                                                            identities.items() if k.startswith("engine:")}}
    record["summary"] = summary(record)
    return record


def _seal(opts: CalibrationOptions, record: dict[str, Any], report: Report, reserve: Any) -> Path | None:
    """The record sealed into the chain (None when opts.seal is False); what was measured is never lost to a
    failing seal: the unsealed record is kept and named."""
    if not opts.seal:
        return None
    report("stage", name="seal")
    try:
        reserve.release()  # the space held since before the first measurement, for the writes below
        path = write_record(record, opts.rounds_dir)
    except Exception as exc:  # what was measured is never lost: the unsealed record is kept and named
        raise _unsealed(record, opts, exc) from exc
    from .history import durable

    durable.save(opts.rounds_dir, opts.lock_path, f"calibration {record['calibration_id']}")  # sealed: kept
    return path


def _unsealed(record: dict[str, Any], opts: CalibrationOptions, exc: Exception) -> InputError:
    """The error of a calibration whose record could not be sealed, after keeping the record wherever it can go
    (the cache, the system temp dir, the user's home; when none takes it, the error carries it as JSON)."""
    from .round.ready import keep_first

    places = [opts.cache_dir / "calibrations-unsealed", Path(tempfile.gettempdir()) / "scoreboard-unsealed",
              Path.home() / "scoreboard-unsealed"]
    data = file_bytes(record)
    keep, failed = keep_first(data, f"{record['calibration_id']}.json", places)
    where = (f"the unsealed record is at {keep}" if keep is not None else
             f"the unsealed record could not be written anywhere ({'; '.join(failed)}); it follows:\n"
             + data.decode())
    return InputError(f"sealing the calibration failed ({exc}); {where}",
                      "fix the cause and re-run the calibration (an unsealed record is not relied on)")
