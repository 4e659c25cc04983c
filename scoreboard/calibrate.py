"""`scoreboard gate calibrate TARGET`: measure that a target's gate bars separate a correct engine from bugs.

For N seeds, each drawing the gate's prompt exactly as a round with that seed draws it, three comparisons go
through the round's own gate code (preflight, GateStage rows and grading, fresh candidate workers):

* ``correct``: KL(reference || candidate), what a round's gate measures;
* ``noise_floor``: KL(candidate at the more precise of two dtypes || candidate at the other): how far rounding
  alone moves the answer (cpu: float64 vs float32 matmuls, since the target pins float32 and an honest float32
  engine differs from another only by accumulation rounding; cuda: float32 vs float16);
* ``faults``: KL(reference || candidate with one injected bug), for every fault that changes the gate's logits.

Separated with margin m (the target's ``gate.calibration_margin``, default 20) means, at every gate depth and
on every seed: noise-floor KL mean <= kl_max / m, correct-engine KL mean <= kl_max and p99 <= kl_p99_max (it
passes the bars), both with top-1 >= top1_min; the noise floor's top-1 over all seeds' rows >= 0.99 at every
depth (NOISE_TOP1_POOLED_MIN);
and every fault, on its best seed (lowest KL), reads KL mean >= kl_max x m at its worst depth (the depth at
which the gate rejects it). A fault's top-1 may be anything: the KL bar alone already rejects it with margin.

The result is a sealed record ``rounds/calibrations/<id>.json`` chained in ``rounds/calibrations.jsonl`` (a
hash chain of its own, so a calibration never reorders the rounds' ledger). `round run` refuses a target
whose latest record is missing, was made against another definition of the target (bars, weights pins,
geometry, reference pin, engines, candidate options) or does not separate the bars; `scoreboard verify`
checks every record and every receipt's reference to one. No printing here: progress goes through `report`.
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Mapping

import numpy as np
from pydantic import BaseModel, ConfigDict

from .history import ledger
from .cache import cache_dir as default_cache_dir
from .errors import InputError, NonCompliant
from .fields import changes
from .lockfile import GatePolicy, Lock, Target, atomic_write_text, lock_digest, load_lock
from .history.receipt import Receipt, utc_now
from .history.seal import canonical_bytes, check_seal, check_signature, load_private_key, make_seal, sha256_hex

CHAIN_NAME = "calibrations.jsonl"
RECORDS_DIR = "calibrations"
FORMAT_VERSION = "1.0"
DEFAULT_SEEDS = 20
# seeds per candidate worker launch (weights loaded once: start-up dominates on small models; on the H200 a
# sparkinfer worker spends ~6 s in torch import, CUDA init and the weight load before its first seed): the
# default 20 seeds in one launch per arm; each seed in a launch gets the target's worker timeout (speed.timeout_s)
SEEDS_PER_WORKER = 20
PRECISION = {"float64": 3, "float32": 2, "float16": 1, "bfloat16": 1}
# Rounding alone may flip at most this share of the gate's argmaxes, pooled over every seed's rows at each depth:
# a workload whose top-1 moves under f16 rounding more often is ill-conditioned (routing near-ties), and its
# gate cannot tell a correct engine from a broken one. Pooled, not per seed: on 32 rows a single near-tie flip
# already reads 0.969, while 20 seeds x 32 rows resolve a 1% rate.
NOISE_TOP1_POOLED_MIN = 0.99

Report = Callable[..., None]


def _noop(*_a: Any, **_k: Any) -> None:
    return None


# ----------------------------------------------------------------------------------------------
# what a calibration is about: the target's definition

def definition(lock: Lock, target_id: str) -> dict[str, Any]:
    """Everything that changes what the gate compares or where its bars sit: the gate table, the weights pin,
    the geometry, the reference pin, the engines, the device and the candidate's options. Speed, tiers,
    metrics, fit and parallel layout are left out (they do not move the gate's logits)."""
    t = lock.target(target_id)
    dump = t.model_dump(mode="json", by_alias=True)
    w = lock.weights[t.weights]
    ref = lock.references[t.reference]
    return {
        "target": target_id, "model": t.model, "quant": t.quant, "node": t.node, "device": t.device,
        "reference_engine": t.reference_engine, "candidate_engine": t.candidate_engine,
        "gate": dump["gate"], "geometry": dump["geometry"],
        "candidate_options": dump.get("candidate_options") or {},
        "weights": {"id": t.weights, "repo": w.repo, "revision": w.revision, "spec": w.spec, "seed": w.seed,
                    "quant": w.quant, "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in w.files]},
        "reference": {"id": t.reference, **ref.identity(), "cmake_flags": list(ref.cmake_flags)},
    }


def definition_sha256(defn: Mapping[str, Any]) -> str:
    return sha256_hex(canonical_bytes(defn))


def definition_changes(then: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """`gate.kl_max: 0.001 -> 0.002` for every field that differs."""
    return changes(then, now)


def noise_pair(target_id: str, target: Target, candidate_options: Mapping[str, Any]) -> dict[str, str]:
    """The noise floor's two dtypes: the candidate's own and `gate.noise_dtype` (derived when empty)."""
    own = str(candidate_options.get("dtype") or "float32")
    other = target.gate.noise_dtype
    if not other:
        if target.device == "cpu":
            other = "float64" if own != "float64" else "float32"
        else:
            other = "float16" if own == "float32" else "float32"
    if other == own:
        raise InputError(f"targets.{target_id}.gate.noise_dtype: {other!r} is the candidate's own dtype; "
                         "the noise floor needs a second precision", "pick another dtype, or leave it empty")
    precise, coarse = sorted((own, other), key=lambda d: -PRECISION.get(d, 0))
    return {"candidate_dtype": own, "other_dtype": other, "precise": precise, "coarse": coarse}


def gate_faults(engine: str) -> tuple[str, ...]:
    """The engine's injected bugs that change the gate's logits (the timed-only ones are the speed stage's)."""
    if engine == "sparkinfer":
        from engines.sparkinfer.faults import GATE_FAULTS  # plain names, no torch import

        return tuple(GATE_FAULTS)
    return ()


# ----------------------------------------------------------------------------------------------
# separation: one pure function over the raw per-seed numbers (the command and `round run` share it)

def _depths(run_arm: list[Mapping[str, Any]]) -> dict[int, Mapping[str, Any]]:
    return {int(d["depth"]): d for d in run_arm}


def summary(record: Mapping[str, Any]) -> dict[str, Any]:
    """Per arm and depth over seeds: worst / mean / best KL mean, worst KL p99, worst / mean top-1; and the
    gate's view of each seed (its worst depth), whose best seed is what a fault's separation rests on."""
    arms: dict[str, list[list[Mapping[str, Any]]]] = {"correct": [], "noise_floor": []}
    for run in record["runs"]:
        arms["correct"].append(run["correct"])
        arms["noise_floor"].append(run["noise_floor"])
        for name, res in run["faults"].items():
            arms.setdefault(f"fault:{name}", []).append(res)
    out: dict[str, Any] = {}
    for arm, seeds in arms.items():
        per_depth: dict[str, Any] = {}
        for d in sorted({int(x["depth"]) for s in seeds for x in s}):
            rows = [_depths(s)[d] for s in seeds]
            km = [float(r["kl_mean"]) for r in rows]
            t1 = [float(r["top1"]) for r in rows]
            per_depth[str(d)] = {"kl_mean_worst": max(km), "kl_mean_mean": float(np.mean(km)), "kl_mean_best": min(km),
                                 "kl_p99_worst": max(float(r["kl_p99"]) for r in rows), "top1_worst": min(t1),
                                 "top1_mean": float(np.mean(t1)), "top1_best": max(t1)}
        gate_view = [max(float(x["kl_mean"]) for x in s) for s in seeds]
        out[arm] = {"depths": per_depth, "seed_worst_depth_kl_mean": {"worst": max(gate_view), "best": min(gate_view),
                                                                       "mean": float(np.mean(gate_view))}}
    return out


def pooled_top1(record: Mapping[str, Any], arm: str) -> dict[int, float]:
    """depth -> top-1 agreement over every seed's rows at that depth (each seed weighted by its row count)."""
    hits: dict[int, float] = {}
    rows: dict[int, int] = {}
    for run in record["runs"]:
        for d in run[arm]:
            n = int(d.get("rows") or 1)
            hits[int(d["depth"])] = hits.get(int(d["depth"]), 0.0) + float(d["top1"]) * n
            rows[int(d["depth"])] = rows.get(int(d["depth"]), 0) + n
    return {d: hits[d] / rows[d] for d in hits}


def separation_problems(record: Mapping[str, Any], policy: GatePolicy) -> list[str]:
    """Every bar the record's measurements do not separate with the policy's margin ([] = separated).
    Each problem names the arm, the bar, the seed and depth, and by how much it misses."""
    m = policy.calibration_margin
    low, high = policy.kl_max / m, policy.kl_max * m
    seeds = [int(r["seed"]) for r in record["runs"]]
    problems: list[str] = []
    if not record["runs"]:
        return ["the record holds no seeds"]
    noise = record.get("noise_floor") or {}
    labels = {"correct": "correct engine (reference vs candidate)",
              "noise_floor": f"noise floor (candidate {noise.get('precise')} vs {noise.get('coarse')})"}
    for arm, label in labels.items():
        worst_mean = worst_p99 = worst_top1 = None
        for run in record["runs"]:
            for d in run[arm]:
                at = (int(run["seed"]), int(d["depth"]))
                if worst_mean is None or d["kl_mean"] > worst_mean[0]:
                    worst_mean = (float(d["kl_mean"]), *at)
                if worst_p99 is None or d["kl_p99"] > worst_p99[0]:
                    worst_p99 = (float(d["kl_p99"]), *at)
                if worst_top1 is None or d["top1"] < worst_top1[0]:
                    worst_top1 = (float(d["top1"]), *at)
        # the noise floor (rounding alone) must sit a margin below the bar; the reference against a correct
        # candidate must pass the bar on every seed (on a GPU it carries the reference's own f16 arithmetic)
        bar = low if arm == "noise_floor" else policy.kl_max
        if worst_mean and worst_mean[0] > bar:
            v, s, d = worst_mean
            what = f"kl_max / margin = {policy.kl_max:g} / {m:g} = {low:.3g}" if arm == "noise_floor" \
                else f"kl_max {policy.kl_max:g}: a correct engine would be rejected"
            problems.append(f"{label}: KL mean {v:.3g} at depth {d} (seed {s}) > {what} ({v / bar:.3g}x over)")
        if arm == "correct" and worst_p99 and worst_p99[0] > policy.kl_p99_max:
            v, s, d = worst_p99
            problems.append(f"{label}: KL p99 {v:.3g} at depth {d} (seed {s}) > kl_p99_max {policy.kl_p99_max:g} "
                            f"({v / policy.kl_p99_max:.3g}x over): a correct engine would be rejected")
        if worst_top1 and worst_top1[0] < policy.top1_min:
            v, s, d = worst_top1
            problems.append(f"{label}: top-1 {v:.4f} at depth {d} (seed {s}) < top1_min {policy.top1_min:g} "
                            f"({policy.top1_min - v:.4f} short)")
    for d, t1 in sorted(pooled_top1(record, "noise_floor").items()):
        if t1 < NOISE_TOP1_POOLED_MIN:
            problems.append(f"{labels['noise_floor']}: top-1 over all seeds' rows {t1:.4f} at depth {d} < "
                            f"{NOISE_TOP1_POOLED_MIN:g} ({NOISE_TOP1_POOLED_MIN - t1:.4f} short): rounding alone "
                            "flips the argmax too often for this workload")
    for name in record.get("faults") or []:
        best = None
        for run in record["runs"]:
            res = run["faults"].get(name)
            if not res:
                problems.append(f"fault {name}: not measured on seed {run['seed']}")
                continue
            top = max(res, key=lambda d: d["kl_mean"])  # the depth at which the gate rejects it
            if best is None or top["kl_mean"] < best[0]:
                best = (float(top["kl_mean"]), int(run["seed"]), int(top["depth"]))
        if best and best[0] < high:
            v, s, d = best
            short = high / v if v > 0 else float("inf")
            problems.append(f"fault {name}: on its best seed ({s}) its worst depth ({d}) reads KL mean {v:.3g} "
                            f"< kl_max x margin = {policy.kl_max:g} x {m:g} = {high:.3g} ({short:.3g}x short)")
    if not record.get("faults"):
        problems.append("no fault suite: nothing shows that the bars reject a broken engine")
    if len(set(seeds)) != len(seeds):
        problems.append(f"seeds repeat ({seeds}): each seed must be a separate draw")
    return problems


# ----------------------------------------------------------------------------------------------
# running one

@dataclass
class CalibrationOptions:
    target: str
    lock_path: Path = Path("reference.lock")
    candidate: str = "main"
    seeds: int = DEFAULT_SEEDS
    first_seed: int | None = None  # seeds first_seed .. first_seed + seeds - 1; default: unpredictable seeds
    rounds_dir: Path = Path("rounds")
    cache_dir: Path = field(default_factory=default_cache_dir)  # explicit, else $SCOREBOARD_CACHE, else ~/.cache
    seal: bool = True
    allow_node_mismatch: bool = False
    # the operator accepts a reference build whose files differ from the ones the latest sealed round recorded
    # for its build key (a deliberate rebuild, e.g. on a fresh box); the record's reference identity says so
    renew_reference_anchor: bool = False
    repo: Path | None = None  # the git repository whose commits --candidate names (None: the harness's checkout)


@dataclass
class CalibrationOutcome:
    record: dict[str, Any]
    path: Path | None
    problems: list[str] = field(default_factory=list)

    @property
    def separated(self) -> bool:
        return not self.problems


def _depth_numbers(result: Any) -> list[dict[str, Any]]:
    return [{"depth": d.depth, "rows": d.rows, "kl_mean": d.kl_mean, "kl_p99": d.kl_p99, "kl_max": d.kl_max,
             "top1": d.top1} for d in result.depths]


def run_calibration(opts: CalibrationOptions, report: Report = _noop) -> CalibrationOutcome:
    """Measure, summarize, seal and record (unless opts.seal is False). Bad input raises before any engine runs."""
    from .round import ready, sandbox

    scratch = sandbox.new_scratch_root()  # private to this calibration: the arm's export, every launch's dir
    reserve = ready.SealReserve()  # the seal's space, held from before the first measurement until it writes
    try:
        return _run_calibration(opts, report, scratch, reserve)
    finally:
        reserve.release()
        sandbox.remove_tree(scratch)


def _run_calibration(opts: CalibrationOptions, report: Report, scratch: Path, reserve: Any) -> CalibrationOutcome:
    from .round import candidate as cand_mod
    from .round.run import Round, RoundOptions, Sources, preflight
    from .round.stages import GateStage

    if opts.seeds < 1:
        raise InputError(f"--seeds {opts.seeds}: must be at least 1", "20 seeds is the default; 2 is a smoke test")
    lock = load_lock(opts.lock_path)
    target = lock.target(opts.target)
    faults = gate_faults(target.candidate_engine)
    # a round's seed is unpredictable (secrets.randbits(31)); the calibration samples the same space
    seeds = ([opts.first_seed + i for i in range(opts.seeds)] if opts.first_seed is not None
             else secrets.SystemRandom().sample(range(1 << 31), opts.seeds))
    if opts.seal:  # whatever sealing needs is checked before anything is measured
        load_private_key(None, _forbidden_roots(opts.rounds_dir))
        read_chain(opts.rounds_dir)
        opts.rounds_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(opts.rounds_dir, os.W_OK):
            raise InputError(f"{opts.rounds_dir}: not writable; the calibration record could not be sealed there",
                             "pass --out DIR of a writable rounds directory")
        from .round.ready import RESERVE_MIN_BYTES

        reserve.hold([opts.rounds_dir], RESERVE_MIN_BYTES)
    t_start = time.perf_counter()
    created = utc_now()
    stage_seconds: dict[str, float] = {}
    round_opts = RoundOptions(target=opts.target, lock_path=opts.lock_path, candidate=opts.candidate, seed=seeds[0],
                              seal=False, rounds_dir=opts.rounds_dir, cache_dir=opts.cache_dir,
                              allow_node_mismatch=opts.allow_node_mismatch, require_calibration=False,
                              renew_reference_anchor=opts.renew_reference_anchor)
    opts.cache_dir.mkdir(parents=True, exist_ok=True)
    report("stage", name="candidate")
    source = cand_mod.resolve(opts.candidate, scratch, opts.repo or cand_mod.HARNESS_ROOT, lock.main_branch)
    rnd = Round(round_opts, lock, report, scratch, Sources(source))
    report("stage", name="preflight")
    t0 = time.perf_counter()
    pre = preflight(rnd)
    rnd.set_up_arms(pre)
    stage_seconds["preflight"] = round(time.perf_counter() - t0, 3)
    cand = rnd.arm("candidate")
    assert cand is not None
    gate = GateStage(rnd.ctx, pre, cand, rnd.log)
    base = pre.targets.candidate
    noise = noise_pair(opts.target, target, base.options)

    report("stage", name="reference")
    t0 = time.perf_counter()
    rows: list[tuple[int, Any, dict[int, list[int]], list[int], tuple[int, ...], np.ndarray]] = []
    geom = pre.targets.geometry
    from .engine import LogitsRequest
    from .worker.protocol import LogitsOp, LogitsRows

    for i, seed in enumerate(seeds):
        report("progress", task="reference logits", done=i, total=len(seeds), message=f"seed {seed}")
        prompt = gate.draw(seed)
        per_depth, positions, ids = gate.rows(prompt)
        ref = pre.reference.logits(LogitsRequest(ids, tuple(positions), geom))
        if ref.command:
            rnd.log.command(ref.command)
        rows.append((seed, prompt, per_depth, positions, ids, ref.logits))
    report("progress", task="reference logits", done=len(seeds), total=len(seeds), message="done")
    stage_seconds["reference"] = round(time.perf_counter() - t0, 3)

    # each arm: (name, extra candidate options); the noise floor's precise side is graded as the "reference"
    arms: list[tuple[str, dict[str, Any]]] = [("correct", {})]
    for dt in (noise["precise"], noise["coarse"]):
        if dt != noise["candidate_dtype"]:
            arms.append((f"dtype:{dt}", {"dtype": dt}))
    arms += [(f"fault:{f}", {"faults": [f]}) for f in faults]
    report("stage", name="candidate workers")
    t0 = time.perf_counter()
    logits: dict[str, list[np.ndarray]] = {}
    identities: dict[str, Any] = {}
    batches = [list(range(i, min(i + SEEDS_PER_WORKER, len(seeds)))) for i in range(0, len(seeds), SEEDS_PER_WORKER)]
    total, done = len(arms) * len(batches), 0
    for name, extra in arms:
        variant = replace(base, options={**{k: v for k, v in base.options.items() if k != "faults"}, **extra})
        out: list[np.ndarray] = []
        for b in batches:
            report("progress", task="candidate workers", done=done, total=total,
                   message=f"{name}: seeds {', '.join(str(seeds[i]) for i in b)}")
            res = cand.worker().call(LogitsOp(requests=tuple(LogitsRows.of(rows[i][4], rows[i][3]) for i in b)),
                                     target=variant, timeout_s=target.speed.timeout_s * len(b)).result
            identities.setdefault(name, res.identity)
            out += [np.load(f.path) for f in res.logits or []]
            done += 1
        logits[name] = out
    report("progress", task="candidate workers", done=total, total=total, message="done")
    stage_seconds["candidate"] = round(time.perf_counter() - t0, 3)

    own = "correct"
    precise = own if noise["precise"] == noise["candidate_dtype"] else f"dtype:{noise['precise']}"
    coarse = own if noise["coarse"] == noise["candidate_dtype"] else f"dtype:{noise['coarse']}"
    runs = []
    for i, (seed, prompt, per_depth, positions, _ids, ref) in enumerate(rows):
        run: dict[str, Any] = {"seed": seed, "prompt": prompt.describe(),
                               "correct": _depth_numbers(gate.grade(per_depth, positions, ref, logits[own][i])),
                               "noise_floor": _depth_numbers(gate.grade(per_depth, positions, logits[precise][i],
                                                                        logits[coarse][i])),
                               "faults": {f: _depth_numbers(gate.grade(per_depth, positions, ref, logits[f"fault:{f}"][i]))
                                          for f in faults}}
        runs.append(run)
    defn = definition(lock, opts.target)
    src = source
    record: dict[str, Any] = {
        "kind": "calibration", "format_version": FORMAT_VERSION, "calibration_id": new_calibration_id(opts.target, created),
        "created_at": created, "target": opts.target, "lock_sha256": lock_digest(opts.lock_path),
        "lock_target": target.model_dump(mode="json", by_alias=True),
        "definition": defn, "definition_sha256": definition_sha256(defn),
        "policy": {"margin": target.gate.calibration_margin, "kl_max": target.gate.kl_max,
                   "kl_p99_max": target.gate.kl_p99_max, "top1_min": target.gate.top1_min,
                   "depths": list(target.gate.depths), "rows_per_depth": target.gate.rows_per_depth},
        "seeds": seeds,
        "candidate": {"engine": target.candidate_engine, "label": src.label, "commit": src.commit, "dirty": src.dirty,
                      "is_main": src.is_main, "options": dict(base.options), "identity": identities["correct"]},
        "reference": {"engine": target.reference_engine, "identity": rnd.reference.identity if rnd.reference else {}},
        "noise_floor": {**noise, "identities": {n: identities[n] for n in identities if n.startswith("dtype:")}},
        "faults": list(faults),
        "fault_identities": {f: identities[f"fault:{f}"] for f in faults},
        "runs": runs,
        "environment": rnd.environment().model_dump(mode="json", by_alias=True, exclude_unset=True), "commands": rnd.log.commands,
        "stage_seconds": stage_seconds,
    }
    record["summary"] = summary(record)
    problems = separation_problems(record, target.gate)
    record["separation"] = {"separated": not problems, "problems": problems}
    record["stage_seconds"]["total"] = round(time.perf_counter() - t_start, 3)
    path = None
    if opts.seal:
        report("stage", name="seal")
        try:
            reserve.release()  # the space held since before the first measurement, for the writes below
            path = write_record(record, opts.rounds_dir)
        except Exception as exc:  # what was measured is never lost: the unsealed record is kept and named
            raise _unsealed(record, opts, exc) from exc
    return CalibrationOutcome(record, path, problems)


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


def _forbidden_roots(rounds_dir: str | os.PathLike[str]) -> list[Path]:
    return [Path.cwd(), Path(rounds_dir).resolve().parent]


def new_calibration_id(target: str, created_at: str) -> str:
    stamp = created_at.replace("-", "").replace(":", "")
    cid = f"cal-{stamp}-{target}-{secrets.token_hex(4)}"
    if os.sep in cid or not all(c.isalnum() or c in "._-" for c in cid):
        raise InputError(f"target {target!r} cannot form a calibration id (use letters, digits, '.', '_', '-')")
    return cid


# ----------------------------------------------------------------------------------------------
# on disk: sealed record + hash chain

class ChainLine(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["calibration"]
    calibration_id: str
    date: str  # the record's created_at
    target: str
    definition_sha256: str
    separated: bool
    record_sha256: str  # sha256 of the record file's bytes
    seal_sha256: str  # the record's seal.sha256
    prev_sha256: str  # sha256 of the previous line's bytes ("" for line 1)


REQUIRED = ("kind", "format_version", "calibration_id", "created_at", "target", "definition", "definition_sha256",
            "policy", "seeds", "candidate", "reference", "noise_floor", "faults", "runs", "summary", "separation")


def chain_path(rounds_dir: str | os.PathLike[str]) -> Path:
    return Path(rounds_dir) / CHAIN_NAME


def record_path(rounds_dir: str | os.PathLike[str], calibration_id: str) -> Path:
    return Path(rounds_dir) / RECORDS_DIR / f"{calibration_id}.json"


def record_problems(data: Any) -> list[str]:
    if not isinstance(data, Mapping):
        return ["<root>: a calibration record is a JSON object"]
    problems = [f"{k}: required key is missing" for k in REQUIRED if k not in data]
    if data.get("kind") != "calibration":
        problems.append(f"kind: {data.get('kind')!r}, expected 'calibration'")
    if not problems and data["definition_sha256"] != definition_sha256(data["definition"]):
        problems.append("definition_sha256: does not match the recorded definition")
    return problems


def file_bytes(record: Mapping[str, Any]) -> bytes:
    return (json.dumps(record, indent=1, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n").encode()


def _read_lines(rounds_dir: str | os.PathLike[str]) -> list[bytes]:
    return ledger.read_chain_file(chain_path(rounds_dir))


def chain_problems(lines: list[bytes]) -> list[tuple[int, str, str]]:
    """The calibration chain's problems, by the same rules as the rounds' ledger (schema: ChainLine)."""
    return ledger.chain_problems(lines, ChainLine)


def read_chain(rounds_dir: str | os.PathLike[str]) -> list[ChainLine]:
    lines = _read_lines(rounds_dir)
    problems = chain_problems(lines)
    if problems:
        where = chain_path(rounds_dir)
        raise NonCompliant("calibration chain is broken:\n" + "\n".join(f"  {where}:{n}: {f}: {m}" for n, f, m in problems),
                           "run `scoreboard verify`; restore rounds/calibrations.jsonl from git")
    return [ChainLine.model_validate(json.loads(raw)) for raw in lines]


def write_record(record: Mapping[str, Any], rounds_dir: str | os.PathLike[str],
                 signing_key: str | os.PathLike[str] | None = None,
                 forbidden_roots: Iterable[Path] | None = None) -> Path:
    """Seal (signed when a key is configured, like receipts), write once, append the chain line."""
    from .history.records import _write_once

    if record.get("seal") is not None:
        raise InputError(f"calibration {record.get('calibration_id')}: already sealed")
    problems = record_problems(record)
    if problems:
        raise InputError("calibration record: " + "; ".join(problems))
    roots = list(forbidden_roots) if forbidden_roots is not None else _forbidden_roots(rounds_dir)
    key = load_private_key(signing_key, roots)
    with ledger.exclusive(rounds_dir):
        lines = _read_lines(rounds_dir)
        if chain_problems(lines):
            read_chain(rounds_dir)  # raises with the report: never extend a broken chain
        prev = sha256_hex(lines[-1]) if lines else ""
        body = json.loads(json.dumps(dict(record)))
        sealed = {**body, "seal": make_seal(body, prev, key)}
        data = file_bytes(sealed)
        line = ChainLine(kind="calibration", calibration_id=sealed["calibration_id"], date=sealed["created_at"],
                         target=sealed["target"], definition_sha256=sealed["definition_sha256"],
                         separated=bool(sealed["separation"]["separated"]), record_sha256=sha256_hex(data),
                         seal_sha256=sealed["seal"]["sha256"], prev_sha256=prev)
        path = record_path(rounds_dir, sealed["calibration_id"])
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_once(path, data)
        text = b"".join(raw + b"\n" for raw in [*lines, canonical_bytes(line.model_dump(mode="json"))])
        atomic_write_text(chain_path(rounds_dir), text.decode("utf-8"))
    return path


def _load_checked(rounds_dir: Path, line: ChainLine) -> dict[str, Any]:
    """The record a chain line names, refused unless its bytes and seal are what the line recorded."""
    path = record_path(rounds_dir, line.calibration_id)
    if not path.is_file():
        raise NonCompliant(f"{path}: the calibration named by {chain_path(rounds_dir)} is missing",
                           "restore it from git; run `scoreboard verify`")
    raw = path.read_bytes()
    data = json.loads(raw)
    bad = record_problems(data) + [f"{f}: {m}" for f, m in check_seal(data)]
    if sha256_hex(raw) != line.record_sha256:
        bad.append("file bytes differ from the chain line's record_sha256")
    if bad:
        raise NonCompliant(f"{path}: " + "; ".join(bad), "an edited calibration is a claim, not a measurement; "
                                                         "run `scoreboard verify`")
    return data


def latest_calibration(rounds_dir: str | os.PathLike[str], target_id: str) -> tuple[dict[str, Any], ChainLine] | None:
    """The target's latest calibration record, verified (chain, file hash, seal); None when there is none.

    rounds/ is the harness's own history: no candidate process writes it (the candidate runs in its worker,
    and a PR's tree is a separate checkout), and an edit to a record or its chain is caught here by the seal
    and the chain before any engine runs.
    """
    rounds = Path(rounds_dir)
    lines = [ln for ln in read_chain(rounds) if ln.target == target_id]
    if not lines:
        return None
    return _load_checked(rounds, lines[-1]), lines[-1]


def check_calibration(lock: Lock, target_id: str, rounds_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The receipt's ``calibration`` field for a target whose latest calibration separates the current bars;
    InputError naming the bar (and by how much) otherwise."""
    t = lock.target(target_id)
    out = "" if Path(rounds_dir) == Path("rounds") else f" --out {rounds_dir}"
    hint = f"run `scoreboard gate calibrate {target_id}{out}` (and commit the record it writes)"
    found = latest_calibration(rounds_dir, target_id)
    if found is None:
        raise InputError(f"target {target_id!r} has no calibration in {chain_path(rounds_dir)}: nothing shows that its "
                         "gate bars separate a correct engine from rounding noise and known faults", hint)
    rec, line = found
    now = definition(lock, target_id)
    if definition_sha256(now) != rec["definition_sha256"]:
        changes = definition_changes(rec["definition"], now)
        raise InputError(f"target {target_id!r}: its latest calibration {rec['calibration_id']} was made against a "
                         "different definition of the target:\n  " + "\n  ".join(changes[:12]), hint)
    problems = separation_problems(rec, t.gate)
    if problems:
        raise InputError(f"target {target_id!r}: its latest calibration {rec['calibration_id']} does not separate "
                         f"the gate bars with margin {t.gate.calibration_margin:g}:\n  " + "\n  ".join(problems),
                         "move the bars (or make the workload better conditioned), then " + hint)
    return {"status": "calibrated", "calibration_id": rec["calibration_id"], "record_sha256": line.record_sha256,
            "seal_sha256": line.seal_sha256, "definition_sha256": rec["definition_sha256"],
            "margin": t.gate.calibration_margin, "seeds": len(rec["seeds"])}


def skipped(reason: str) -> dict[str, Any]:
    """The receipt's ``calibration`` field of a round run without one (tests only): it moves no frontier."""
    return {"status": "skipped", "reason": reason}


# ----------------------------------------------------------------------------------------------
# verify

def verify_problems(rounds_dir: str | os.PathLike[str], trusted: Any = None,
                    receipts: Mapping[str, Receipt] | None = None) -> tuple[int, list[tuple[str, str, str]]]:
    """(records checked, problems as (file, field, message)): the chain, every record's bytes, seal and
    signature, orphan records, and every receipt's reference to a calibration."""
    rounds = Path(rounds_dir)
    cp = chain_path(rounds)
    problems: list[tuple[str, str, str]] = []
    lines, file_problem = ledger.read_chain_for_report(cp)
    if file_problem:
        problems.append((str(cp), "<file>", file_problem))
    problems += [(f"{cp}:{n}", f, m) for n, f, m in chain_problems(lines)]
    named: dict[str, ChainLine] = {}
    for n, line in ledger.valid_lines(lines, ChainLine):
        if line.calibration_id in named:
            problems.append((f"{cp}:{n}", "calibration_id", f"{line.calibration_id} already on an earlier line"))
        named[line.calibration_id] = line
        path = record_path(rounds, line.calibration_id)
        if not path.is_file():
            problems.append((f"{cp}:{n}", "calibration_id", f"{path} is missing (deleted?)"))
            continue
        raw_rec = path.read_bytes()
        try:
            data = json.loads(raw_rec)
        except ValueError as exc:
            problems.append((str(path), "<file>", f"not JSON ({exc})"))
            continue
        problems += [(str(path), *_split(p)) for p in record_problems(data)]
        problems += [(str(path), f, m) for f, m in check_seal(data) + check_signature(data, trusted)]
        if sha256_hex(raw_rec) != line.record_sha256:
            problems.append((f"{cp}:{n}", "record_sha256", f"{path} bytes changed since the line was written"))
        if isinstance(data, Mapping):
            for k, v in (("target", line.target), ("calibration_id", line.calibration_id),
                         ("definition_sha256", line.definition_sha256)):
                if data.get(k) != v:
                    problems.append((f"{cp}:{n}", k, f"{v!r} but {path} says {data.get(k)!r}"))
            if (data.get("seal") or {}).get("prev_ledger_sha256") != line.prev_sha256:
                problems.append((f"{cp}:{n}", "prev_sha256", f"{path} was sealed after a different chain line"))
            if (data.get("separation") or {}).get("separated") != line.separated:
                problems.append((f"{cp}:{n}", "separated", f"differs from {path} separation.separated"))
    recs_dir = rounds / RECORDS_DIR
    for p in sorted(recs_dir.glob("*.json")) if recs_dir.is_dir() else []:
        if p.stem not in named:
            problems.append((str(p), "<file>", f"no line in {cp} (deleted line?)"))
    for rid, r in (receipts or {}).items():
        cal = r.calibration
        if cal is None or cal.status != "calibrated":
            continue
        named_line = named.get(cal.calibration_id)
        where = str(rounds / f"{rid}.json")
        if named_line is None:
            problems.append((where, "calibration.calibration_id", f"{cal.calibration_id!r} is not in {cp}"))
        elif (cal.record_sha256, cal.seal_sha256) != (named_line.record_sha256, named_line.seal_sha256):
            problems.append((where, "calibration.record_sha256",
                             f"does not match {cp}'s line for {named_line.calibration_id}"))
        elif named_line.target != r.target:
            problems.append((where, "calibration.calibration_id", f"calibrates target {named_line.target!r}, not "
                                                                   f"{r.target!r}"))
    return len(named), problems


def _split(p: str) -> tuple[str, str]:
    head, _, tail = p.partition(": ")
    return (head, tail) if tail else ("<root>", p)
