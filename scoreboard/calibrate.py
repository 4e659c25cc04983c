"""`scoreboard gate calibrate TARGET`: measure that a target's gate bars separate a correct engine from bugs.

The bars are the target's (its workload, its reference, its bars), so they are measured with one instrument
whatever the target's candidate engine is: the bundled sparkinfer engine (scoreboard.instrument), its injected
faults and its two precisions. For N seeds, each drawing the gate's prompt exactly as a round with that seed draws
it, three comparisons go through the round's own gate code (preflight, GateStage rows and grading, fresh workers):

* ``correct``: KL(reference || instrument), what a round's gate measures for a correct engine;
* ``noise_floor``: KL(instrument at the more precise of two dtypes || instrument at the other): how far rounding
  alone moves the answer (cpu: float64 vs float32 matmuls, since the target pins float32 and an honest float32
  engine differs from another only by accumulation rounding; cuda: float32 vs float16);
* ``faults``: KL(reference || instrument with one injected bug), for every fault that changes the gate's logits.

A candidate engine that is not the instrument may add faults and a noise floor of its own (Engine.calibration):
``faults`` then also holds ``<engine>:<fault>`` (KL(reference || that engine with its bug)) and every run an
``engine_noise_floor`` (KL(engine at its precise || at its coarse options)), held to the same bars.

Separated with margin m (the target's ``gate.calibration_margin``, default 20) means, at every gate depth and
on every seed: every noise floor's KL mean <= kl_max / m, correct-engine KL mean <= kl_max and p99 <= kl_p99_max
(it passes the bars), all with top-1 >= top1_min; each noise floor's top-1 over all seeds' rows >= 0.99 at every
depth (NOISE_TOP1_POOLED_MIN);
and every fault, on its best seed (lowest KL), reads KL mean >= kl_max x m at its worst depth (the depth at
which the gate rejects it). A fault's top-1 may be anything: the KL bar alone already rejects it with margin.

The result is a sealed record ``rounds/calibrations/<id>.json`` chained in ``rounds/calibrations.jsonl`` (a
hash chain of its own, so a calibration never reorders the rounds' ledger). `round run` refuses a target
whose latest record is missing, was made against another definition of the target (bars, weights pins,
geometry, reference pin, the instrument's options) or does not separate the bars, whatever its candidate engine;
`scoreboard verify` checks every record and every receipt's reference to one. The measurement itself is
scoreboard.calibration_run. No printing here.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Mapping

import numpy as np
from pydantic import BaseModel, ConfigDict

from .history import ledger
from .errors import InputError, LockError, NonCompliant
from .fields import changes
from .lockfile import GatePolicy, Lock, Target, atomic_write_text
from .history.receipt import Receipt
from .history.seal import canonical_bytes, check_seal, check_signature, load_private_key, make_seal, sha256_hex
from .instrument import INSTRUMENT, instrument_options, option_problems

CHAIN_NAME = "calibrations.jsonl"
RECORDS_DIR = "calibrations"
# 1.0: the first records (`candidate`, and a definition naming the candidate engine and its options, which were
#      always the instrument's); 1.1: `instrument` (the bundled engine that measured, at the harness's commit)
#      replaces `candidate`, the definition names the instrument instead of a candidate engine, and an optional
#      `engine` section holds a candidate engine's own faults (`<engine>:<fault>` in `faults`) and noise floor
#      (`engine_noise_floor` in each run). A 1.0 record stays valid and is compared through comparable_definition.
FORMAT_VERSION = "1.1"
PRECISION = {"float64": 3, "float32": 2, "float16": 1, "bfloat16": 1}
# Rounding alone may flip at most this share of the gate's argmaxes, pooled over every seed's rows at each depth:
# a workload whose top-1 moves under f16 rounding more often is ill-conditioned (routing near-ties), and its
# gate cannot tell a correct engine from a broken one. Pooled, not per seed: on 32 rows a single near-tie flip
# already reads 0.969, while 20 seeds x 32 rows resolve a 1% rate.
NOISE_TOP1_POOLED_MIN = 0.99


def noise_flips_allowed(seeds: int, rows_per_depth: int) -> int:
    """How many argmax flips of the noise floor one depth may show, pooled over `seeds` x `rows_per_depth` rows,
    and still meet NOISE_TOP1_POOLED_MIN: 6 for 20 seeds of 32 rows, 1 for 6 seeds (where two near-ties fail)."""
    rows = seeds * rows_per_depth
    return int(rows * (1 - NOISE_TOP1_POOLED_MIN) + 1e-9)

# ----------------------------------------------------------------------------------------------
# what a calibration is about: the target's definition

def definition(lock: Lock, target_id: str) -> dict[str, Any]:
    """Everything that changes what the gate compares or where its bars sit: the gate table, the weights pin,
    the geometry, the reference pin, the reference engine, the device and the instrument that measures the bars
    (the bundled engine and its options: scoreboard.instrument). Speed, tiers, metrics, fit, the parallel layout
    and the candidate engine are left out: the bars are the target's, and every candidate relies on them."""
    t = lock.target(target_id)
    dump = t.model_dump(mode="json", by_alias=True)
    if not dump["gate"].get("fault_depths"):  # empty: faults at every depth, as every record before the field
        dump["gate"].pop("fault_depths", None)
    w = lock.weights[t.weights]
    ref = lock.references[t.reference]
    return {
        "target": target_id, "model": t.model, "quant": t.quant, "node": t.node, "device": t.device,
        "reference_engine": t.reference_engine, "gate": dump["gate"], "geometry": dump["geometry"],
        "instrument": {"engine": INSTRUMENT, "options": instrument_options(t)},
        "weights": {"id": t.weights, "repo": w.repo, "revision": w.revision, "spec": w.spec, "seed": w.seed,
                    "quant": w.quant, "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in w.files]},
        "reference": {"id": t.reference, **ref.identity(), "cmake_flags": list(ref.cmake_flags)},
    }


def comparable_definition(recorded: Mapping[str, Any]) -> dict[str, Any]:
    """A record's definition in today's shape. A format 1.0 record named the candidate engine and its options: its
    candidate was then always the instrument (sparkinfer), so they read as the instrument's engine and options."""
    if "instrument" in recorded or "candidate_engine" not in recorded:
        return dict(recorded)
    out = {k: v for k, v in recorded.items() if k not in ("candidate_engine", "candidate_options")}
    out["instrument"] = {"engine": recorded["candidate_engine"], "options": recorded.get("candidate_options") or {}}
    return out


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


# ----------------------------------------------------------------------------------------------
# separation: one pure function over the raw per-seed numbers (the command and `round run` share it)

def _depths(run_arm: list[Mapping[str, Any]]) -> dict[int, Mapping[str, Any]]:
    return {int(d["depth"]): d for d in run_arm}


def summary(record: Mapping[str, Any]) -> dict[str, Any]:
    """Per arm and depth over seeds: worst / mean / best KL mean, worst KL p99, worst / mean top-1; and the
    gate's view of each seed (its worst depth), whose best seed is what a fault's separation rests on."""
    graded = graded_arms(record)
    arms: dict[str, list[list[Mapping[str, Any]]]] = {arm: [] for arm in graded}
    for run in record["runs"]:
        for arm in graded:
            arms[arm].append(run[arm])
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


NOISE_ARMS = ("noise_floor", "engine_noise_floor")  # rounding alone: the instrument's, a candidate engine's own


def graded_arms(record: Mapping[str, Any]) -> list[str]:
    """The arms every run holds besides its faults: correct, the noise floor, and a candidate engine's own noise
    floor when the record measured one."""
    runs = record.get("runs") or [{}]
    return ["correct", "noise_floor"] + (["engine_noise_floor"] if "engine_noise_floor" in runs[0] else [])


def _labels(record: Mapping[str, Any]) -> dict[str, str]:
    """How each graded arm is named in a problem: by the instrument (1.0 records: their candidate) and engine."""
    inst = (record.get("instrument") or record.get("candidate") or {}).get("engine", INSTRUMENT)
    noise = record.get("noise_floor") or {}
    labels = {"correct": f"correct engine (reference vs {inst})",
              "noise_floor": f"noise floor ({inst} {noise.get('precise')} vs {noise.get('coarse')})"}
    if "engine_noise_floor" in graded_arms(record):
        eng = record.get("engine") or {}
        pair = eng.get("precisions") or {}
        labels["engine_noise_floor"] = (f"{eng.get('engine')}'s noise floor ({json.dumps(pair.get('precise'))} vs "
                                        f"{json.dumps(pair.get('coarse'))})")
    return labels


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
    labels = _labels(record)
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
        bar = low if arm in NOISE_ARMS else policy.kl_max
        if worst_mean and worst_mean[0] > bar:
            v, s, d = worst_mean
            what = f"kl_max / margin = {policy.kl_max:g} / {m:g} = {low:.3g}" if arm in NOISE_ARMS \
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
    for arm in (a for a in NOISE_ARMS if a in labels):
        for d, t1 in sorted(pooled_top1(record, arm).items()):
            if t1 < NOISE_TOP1_POOLED_MIN:
                problems.append(f"{labels[arm]}: top-1 over all seeds' rows {t1:.4f} at depth {d} < "
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
            "policy", "seeds", "instrument", "reference", "noise_floor", "faults", "runs", "summary", "separation")
REQUIRED_1_0 = tuple("candidate" if k == "instrument" else k for k in REQUIRED)  # 1.0 named its instrument so


def chain_path(rounds_dir: str | os.PathLike[str]) -> Path:
    return Path(rounds_dir) / CHAIN_NAME


def record_path(rounds_dir: str | os.PathLike[str], calibration_id: str) -> Path:
    return Path(rounds_dir) / RECORDS_DIR / f"{calibration_id}.json"


def record_problems(data: Any) -> list[str]:
    if not isinstance(data, Mapping):
        return ["<root>: a calibration record is a JSON object"]
    required = REQUIRED_1_0 if data.get("format_version") == "1.0" else REQUIRED
    problems = [f"{k}: required key is missing" for k in required if k not in data]
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


def check_calibration(lock: Lock, target_id: str, rounds_dir: str | os.PathLike[str],
                      lock_path: str | os.PathLike[str] = "reference.lock") -> dict[str, Any]:
    """The receipt's ``calibration`` field for a target whose latest calibration was sealed by a key the lock pins
    (or is listed as sealed before the signer pin) and separates the current bars; InputError naming the signer
    problem or the bar (and by how much) otherwise."""
    from .history.trust import Trust

    t = lock.target(target_id)
    out = "" if Path(rounds_dir) == Path("rounds") else f" --out {rounds_dir}"
    hint = f"run `scoreboard gate calibrate {target_id}{out}` (and commit the record it writes)"
    found = latest_calibration(rounds_dir, target_id)
    if found is None:
        raise InputError(f"target {target_id!r} has no calibration in {chain_path(rounds_dir)}: nothing shows that its "
                         "gate bars separate a correct engine from rounding noise and known faults", hint)
    rec, line = found
    standing = Trust.of(lock, lock_path).standing(rec, "calibration")
    if not standing.trusted:
        raise InputError(f"target {target_id!r}: its latest calibration {rec['calibration_id']} is UNTRUSTED "
                         f"({standing.why}); bars are relied on only as a box's pinned key calibrated them",
                         f"on the box, with its pinned key in $SCOREBOARD_SIGNING_KEY: {hint}")
    bad_options = option_problems(target_id, t)
    if bad_options:
        raise LockError(bad_options, hint=f"fix instrument_options in the lock; {hint}")
    now = definition(lock, target_id)
    then = comparable_definition(rec["definition"])
    if definition_sha256(now) != definition_sha256(then):
        changes = definition_changes(then, now)
        recorded = (then.get("instrument") or {}).get("options")
        if t.candidate_engine != INSTRUMENT and any(c.startswith("instrument.options") for c in changes):
            hint = (f"the instrument measured this target with options {json.dumps(recorded, sort_keys=True)}: set "
                    f"targets.{target_id}.instrument_options to them to keep this calibration, or {hint[0].lower()}"
                    f"{hint[1:]}")
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
                    receipts: Mapping[str, Receipt] | None = None,
                    judge: Callable[[Path, dict[str, Any], str], bool] | None = None,
                    ) -> tuple[int, list[tuple[str, str, str]]]:
    """(records checked, problems as (file, field, message)): the chain, every record's bytes, seal and
    signature, orphan records, and every receipt's reference to a calibration. `judge(path, record, "calibration")`
    is asked who sealed each record whose seal holds (it reports an untrusted one itself: `verify._Ctx.judge`)."""
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
        sealed = [(str(path), f, m) for f, m in check_seal(data) + check_signature(data, trusted)]
        problems += sealed
        if not sealed and isinstance(data, dict) and judge is not None:
            judge(path, data, "calibration")
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
            if "extends" in data:
                problems += [(str(path), *_split(p)) for p in extension_problems(rounds, data, named)]
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


# ----------------------------------------------------------------------------------------------
# extending a calibration by more seeds (`gate calibrate --extend`): a calibration too long for one lease of a box
# is measured in parts, each sealed, each part's record holding every earlier seed's runs as they were sealed


def extension_base(lock: Lock, target_id: str, rounds_dir: str | os.PathLike[str], lock_path: str | os.PathLike[str],
                   engines_tree_then: Callable[[str], str | None], engines_tree_now: str,
                   ) -> tuple[dict[str, Any], ChainLine]:
    """The calibration `--extend` adds seeds to: the target's latest record, sealed by a key the lock pins, made
    against the target's current definition, by an instrument whose code (the git tree of engines/ at the record's
    instrument commit, `engines_tree_then(commit)`) is the tree measuring now. InputError naming what differs, before
    anything runs. The latest record is read through the chain and its seal (latest_calibration); rounds/ is the
    harness's own history, which no candidate process writes."""
    from .history.trust import Trust

    fresh = f"calibrate afresh: `scoreboard gate calibrate -t {target_id}` without --extend"
    found = latest_calibration(rounds_dir, target_id)
    if found is None:
        raise InputError(f"--extend: target {target_id!r} has no calibration in {chain_path(rounds_dir)} to extend",
                         fresh)
    rec, line = found
    rid = rec["calibration_id"]
    standing = Trust.of(lock, lock_path).standing(rec, "calibration")
    if not standing.trusted:
        raise InputError(f"--extend: the latest calibration {rid} is UNTRUSTED ({standing.why}): seeds are added only "
                         "to a record a pinned key sealed", fresh)
    if rec.get("format_version") != FORMAT_VERSION:
        raise InputError(f"--extend: {rid} is calibration format {rec.get('format_version')}, this harness writes "
                         f"{FORMAT_VERSION}", fresh)
    then, now = comparable_definition(rec["definition"]), definition(lock, target_id)
    if definition_sha256(then) != definition_sha256(now):
        raise InputError(f"--extend: {rid} was made against a different definition of {target_id!r}:\n  "
                         + "\n  ".join(definition_changes(then, now)[:12]), fresh)
    who = rec.get("instrument") or {}
    commit = str(who.get("commit", ""))
    # a git arm ran a clean export of its commit (its code is that commit's tree whatever the checkout held); a
    # working tree's code is known to no commit. Records before `kind` was recorded: a dirty checkout counts as one
    if who.get("kind", "git" if not who.get("dirty") else "path") != "git":
        raise InputError(f"--extend: {rid} was measured from a working tree ({who.get('label')}): its code is no "
                         "commit's", fresh)
    tree = engines_tree_then(commit) if commit else None
    if tree is None:
        raise InputError(f"--extend: the commit {rid} was measured at ({commit[:12] or 'none recorded'}) is not in this "
                         "repository, so its instrument's code cannot be compared with this one's", fresh)
    if not engines_tree_now or tree != engines_tree_now:
        raise InputError(f"--extend: the engines' code changed since {rid} (engines/ at {commit[:12]} is tree "
                         f"{tree[:12]}, the instrument now {engines_tree_now[:12] or 'a working tree'}): seeds "
                         "measured by different code are not one calibration", fresh)
    return rec, line


# The reference identity's fields that describe one box's build of the pinned source, not the reference: nvcc's
# output is not byte-reproducible (on 2026-12-01 libggml-cuda.so differed between two boxes building the same tree
# with the same flags), so the files' hashes, their digest, and the anchor the round compared them with differ on
# every bare box. The source, flags, toolchain and run flags stay in the comparison.
REBUILT_PER_BOX = ("binaries", "extra.build_files_sha256", "extra.build_anchor")


def part_changes(base: Mapping[str, Any], part: Mapping[str, Any]) -> list[str]:
    """How a new part's record differs from the base in what must be the same across parts: the instrument's
    identity (engine, options, kernels, torch) and options, the noise pair and each noise arm's identity, the
    reference's identity apart from its build's files (REBUILT_PER_BOX: docs/reference-pin.md), every fault's
    identity, the fault list. Each change names the field that differs (a dotted path) and both values.
    [] = the part may join the base."""
    out: list[str] = []

    def cmp(what: str, a: Any, b: Any) -> None:
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            for key in sorted(set(a) | set(b), key=str):
                cmp(f"{what}.{key}", a.get(key), b.get(key))
        elif json.dumps(a, sort_keys=True) != json.dumps(b, sort_keys=True):
            if isinstance(a, list) and isinstance(b, list):  # a flag list: what was added and what went
                was, now = [json.dumps(x, sort_keys=True) for x in a], [json.dumps(x, sort_keys=True) for x in b]
                added, gone = [x for x in now if x not in was], [x for x in was if x not in now]
                said = ([f"added {', '.join(added)[:160]}"] if added else []) + \
                    ([f"removed {', '.join(gone)[:160]}"] if gone else [])
                out.append(f"{what}: " + ("; ".join(said) or "the same items in another order"))
            else:
                out.append(f"{what}: {json.dumps(a, sort_keys=True)[:120]} -> {json.dumps(b, sort_keys=True)[:120]}")

    bi, pi = base.get("instrument") or {}, part.get("instrument") or {}
    cmp("instrument.identity", bi.get("identity"), pi.get("identity"))
    cmp("instrument.options", bi.get("options"), pi.get("options"))
    for key in ("noise_floor", "fault_identities", "faults", "engine"):
        cmp(key, base.get(key), part.get(key))

    def ref(r: Mapping[str, Any]) -> dict[str, Any]:
        ident = json.loads(json.dumps(r.get("identity") or {}))
        for dotted in REBUILT_PER_BOX:
            *parents, leaf = dotted.split(".")
            node = ident
            for name in parents:
                node = node.get(name) if isinstance(node, dict) else None
            if isinstance(node, dict):
                node.pop(leaf, None)
        return {"engine": r.get("engine"), "identity": ident}

    cmp("reference", ref(base.get("reference") or {}), ref(part.get("reference") or {}))
    return out


def join_parts(base: Mapping[str, Any], line: ChainLine, part: Mapping[str, Any]) -> dict[str, Any]:
    """The new part's record (its own seeds' runs, its own instrument and reference as measured now) as one
    calibration with the base: seeds and runs are the base's, exactly as sealed, then the part's; `extends` names
    the base record (its id, file and seal digests, how many seeds it held) and keeps the base's own instrument,
    reference and stage times. The summary is recomputed over every seed; the caller grades the separation."""
    out = json.loads(json.dumps(dict(part)))
    n = len(base["seeds"])
    out["seeds"] = list(base["seeds"]) + list(part["seeds"])
    out["runs"] = json.loads(json.dumps(list(base["runs"]))) + list(out["runs"])
    out["extends"] = {"calibration_id": base["calibration_id"], "record_sha256": line.record_sha256,
                      "seal_sha256": line.seal_sha256, "seeds": n,
                      # every earlier record whose seeds this one holds, oldest first
                      "parts": [*((base.get("extends") or {}).get("parts") or []), base["calibration_id"]],
                      "base_instrument": base.get("instrument"), "base_reference": base.get("reference"),
                      "base_stage_seconds": base.get("stage_seconds")}
    out["summary"] = summary(out)
    return out


def extension_problems(rounds_dir: Path, data: Mapping[str, Any], named: Mapping[str, ChainLine]) -> list[str]:
    """A record that `extends` another: the base must be an earlier line of the chain with the digests the record
    names, and the record's first seeds and runs must be the base's exactly as sealed."""
    ext = data.get("extends")
    if not isinstance(ext, Mapping):
        return ["extends: must be an object"] if ext is not None else []
    bid = str(ext.get("calibration_id", ""))
    line = named.get(bid)
    if line is None:
        return [f"extends.calibration_id: {bid!r} is not on an earlier line of the chain"]
    if (ext.get("record_sha256"), ext.get("seal_sha256")) != (line.record_sha256, line.seal_sha256):
        return [f"extends: the digests named for {bid} are not its chain line's"]
    try:
        base = json.loads(record_path(rounds_dir, bid).read_bytes())
    except (OSError, ValueError) as exc:
        return [f"extends: {bid} cannot be read ({exc})"]
    n = ext.get("seeds")
    if type(n) is not int or n < 1:  # a hand-edited record: reported as a finding, never raised
        return [f"extends.seeds: {n!r} is not a positive whole number of seeds"]
    problems = []
    if n != len(base.get("seeds") or []) or list(data.get("seeds") or [])[:n] != list(base.get("seeds") or []):
        problems.append(f"seeds: the first {n} are not {bid}'s seeds")
    if json.dumps(list(data.get("runs") or [])[:n], sort_keys=True) != json.dumps(base.get("runs"), sort_keys=True):
        problems.append(f"runs: the first {n} are not {bid}'s runs as sealed")
    if data.get("target") != base.get("target") or data.get("definition_sha256") != base.get("definition_sha256"):
        problems.append(f"extends: {bid} calibrates another target or definition")
    return problems
