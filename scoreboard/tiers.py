"""The verdict: one deterministic function from gate result + speed evidence + lock policy to a label.

Order (thresholds come from the lock's TierPolicy, never from code):
  1. correctness failed (gate, or timed outputs differ from the checked run) -> REJECT, no speed numbers;
  2. a guard failed -> REJECT, `speed_label` still says what the speed would have earned;
  3. no frontier basis (<= 0) -> BASELINE;
  4. CI of the gain wider than `max_ci_width` -> inconclusive (with the blocks to add);
  5. CI upper bound < -guard_tolerance -> regression: the scored metric is significantly worse than its basis
     by more than the tolerance a guard is allowed (the guard rule, applied to the scored metric);
  6. CI lower bound > 0 and point gain >= the smallest bucket -> highest bucket <= gain; else none.

gain = delta / frontier, delta = value - frontier (higher is better) or frontier - value (lower is
better). Basis: main measured in the same round when the candidate is a PR ("main-same-round", paired
blocks); the frontier's commit re-measured in the same round when the candidate is main
("frontier-same-round", paired blocks: a slower or faster box moves both arms alike); the frontier slot
(a constant) only for receipts without such an arm ("frontier-slot": older main receipts, or main not
measured).
Zero-variance samples (an arm whose reps repeat to the nanosecond, or whose block values are all
identical) are no measurement a real clock gives: the metric is flagged and not scored; a flagged
scored metric makes the verdict inconclusive, a flagged guard is not judged.
Drift: against the frontier slot (a constant from the box as it was) nothing in the round cancels the box's
state, so when the round's reference arm lands further than speed.reference_drift_max from the reference's
baseline slot as the round read it at its start (speed.metrics[].baseline), that metric is flagged too: a
loaded box is inconclusive, never a regression or a gain. Same-round bases are paired and need no such rule.
Guard rule: a guard fails when the upper CI bound of its performance ratio (candidate/basis, inverted
for lower-is-better) is below 1 - guard_tolerance, i.e. gain_ci high < -guard_tolerance: significantly
worse than the tolerance, not merely noisy.
Thresholds are inclusive; comparisons carry a 1e-12 slack so decimal inputs such as 98.80 x 1.02 =
100.776 land on the bucket they name despite binary float rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence, TypeVar

from pydantic import BaseModel, ValidationError

from .drift import drift_problem
from .errors import InputError
from .gate import bar_reasons
from .history.receipt import Arm as ArmRec
from .history.receipt import (VERDICT_BASES, VERDICT_LABELS, GateRec, Receipt, SpeedMetric, SpeedRec, Verdict,
                              distinct_outputs, receipt_target, refuse_unknown_format, validation_messages)
from .lockfile import GatePolicy, Lock, Metric, Target, TierPolicy
from .stats import ArmStats, RatioCI, arm_stats, block_value, ci_vs_constant, geometric_mean, paired_ratio_ci, \
    suggest_blocks

LABELS = VERDICT_LABELS  # the receipt's list: one set of labels for the verdict and its record
BUCKETS = ("XS", "S", "M", "L", "XL")
BASES = VERDICT_BASES
_EPS = 1e-12  # slack on fractional gains: float rounding only, far below any real threshold
_Section = TypeVar("_Section", bound=BaseModel)


@dataclass(frozen=True)
class Evidence:
    """One metric's speed evidence: the candidate's value against its basis."""

    name: str  # e.g. "decode 128 tok @ depth 131072"
    role: str  # "scored" | "guard"
    higher_is_better: bool
    value: float  # tok/s, candidate
    basis: str  # one of BASES
    frontier: float  # tok/s of the basis; 0 when basis == "none"
    ratio: RatioCI | None  # candidate/basis; None when there is no basis or for a claim
    unit: str = "tok/s"
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def gain(self) -> float | None:
        if self.frontier <= 0:
            return None
        if self.ratio is not None:
            r = self.ratio.point
        else:
            r = self.value / self.frontier
        return r - 1.0 if self.higher_is_better else 1.0 - r

    @property
    def gain_ci(self) -> tuple[float, float] | None:
        if self.ratio is None or self.frontier <= 0:
            return None
        lo, hi = self.ratio.low, self.ratio.high
        return (lo - 1.0, hi - 1.0) if self.higher_is_better else (1.0 - hi, 1.0 - lo)

    @property
    def n_blocks(self) -> int:
        """Paired blocks behind the interval (0: a single number, no interval)."""
        return self.ratio.n_blocks if self.ratio is not None else 0


def metric_name(m: Metric) -> str:
    return f"{m.phase} {m.n_tokens} tok @ depth {m.depth}"


def evidence(metric: Metric, candidate_blocks: Sequence[float], policy: TierPolicy, seed: int,
             main_blocks: Sequence[float] | None = None, frontier_slot: float = 0.0,
             notes: Sequence[str] = (), paired_basis: str = "main-same-round") -> Evidence:
    """Build a metric's evidence from block values (tok/s): paired vs `main_blocks` (the same-round arm
    named by `paired_basis`) if given, else vs the slot."""
    value = geometric_mean(candidate_blocks)
    conf, resamples = policy.confidence, policy.bootstrap_resamples
    name = metric_name(metric)
    if main_blocks is not None:
        ratio = paired_ratio_ci(candidate_blocks, main_blocks, confidence=conf, resamples=resamples, seed=seed)
        return Evidence(name, metric.role, metric.higher_is_better, value, paired_basis,
                        geometric_mean(main_blocks), ratio, metric.unit, tuple(notes))
    if frontier_slot > 0:
        ratio = ci_vs_constant(candidate_blocks, frontier_slot, confidence=conf, resamples=resamples, seed=seed)
        return Evidence(name, metric.role, metric.higher_is_better, value, "frontier-slot", float(frontier_slot),
                        ratio, metric.unit, tuple(notes))
    return Evidence(name, metric.role, metric.higher_is_better, value, "none", 0.0, None, metric.unit, tuple(notes))


# ----------------------------------------------------------------------------------------------
# the one decision function

def _pct(x: float) -> str:
    return f"{x * 100:+.2f}%"


def _bucket(gain: float, buckets: Mapping[str, float]) -> str | None:
    best = None
    for name in BUCKETS:
        if name in buckets and gain >= buckets[name] - _EPS:
            best = name
    return best


def _speed(ev: Evidence, policy: TierPolicy) -> tuple[str, list[str]]:
    """The label the speed alone earns, with its reasons."""
    g = ev.gain  # None exactly when the frontier is 0
    if ev.basis == "none" or g is None:
        return "BASELINE", [f"{ev.name}: no frontier yet (slot is 0): this value becomes the first basis"]
    ci = ev.gain_ci
    lo, hi = ci if ci is not None else (g, g)
    if ev.ratio is not None and ev.ratio.n_blocks < policy.min_blocks:
        return "inconclusive", [f"{ev.name}: {ev.ratio.n_blocks} paired blocks < min_blocks {policy.min_blocks}: "
                                f"too few to estimate the noise; rerun with --blocks {policy.min_blocks} or more"]
    if ci is not None and hi - lo > policy.max_ci_width + _EPS:
        n = ev.n_blocks
        total = suggest_blocks(n, hi - lo, policy.max_ci_width)
        return "inconclusive", [f"{ev.name}: CI width {(hi - lo) * 100:.2f} points > max_ci_width "
                                f"{policy.max_ci_width * 100:.2f}; rerun with about {total} blocks "
                                f"(add {total - n}) or on a quieter box"]
    tol = policy.guard_tolerance
    if ci is not None and hi < -tol - _EPS:
        return "regression", [f"{ev.name} regressed: {ev.value:.4g} vs {ev.frontier:.4g} {ev.unit} ({ev.basis}), "
                              f"gain {_pct(g)} with CI [{_pct(lo)}, {_pct(hi)}] entirely below -{tol * 100:.2f}% "
                              "(guard_tolerance)"]
    if not policy.buckets:
        return "none", ["tier policy has no buckets"]
    smallest_name = min(policy.buckets, key=policy.buckets.__getitem__)
    smallest = policy.buckets[smallest_name]
    if lo <= _EPS:
        what = "the CI lower bound" if ci is not None else "the claimed gain"
        return "none", [f"{ev.name}: {what} {_pct(lo)} is not above 0 (not significant)"]
    if g < smallest - _EPS:
        return "none", [f"{ev.name}: gain {_pct(g)} is below the smallest bucket {smallest_name} "
                        f"({smallest * 100:.2f}%)"]
    b = _bucket(g, policy.buckets) or smallest_name  # g reached the smallest bucket, so _bucket found one
    return b, [f"{ev.name}: gain {_pct(g)} reaches {b} (>= {policy.buckets[b] * 100:.2f}%)"]


def _guard_failures(guards: Sequence[Evidence], policy: TierPolicy) -> tuple[list[str], list[str]]:
    """(failures, notes) for the guard metrics."""
    fails: list[str] = []
    notes: list[str] = []
    tol = policy.guard_tolerance
    for g in guards:
        ci, gain = g.gain_ci, g.gain
        if ci is None or gain is None:
            notes.append(f"guard {g.name}: no basis yet, cannot regress")
            continue
        if g.ratio is not None and g.ratio.n_blocks < policy.min_blocks:
            notes.append(f"guard {g.name}: {g.ratio.n_blocks} blocks < min_blocks {policy.min_blocks}, not judged")
            continue
        if ci[1] < -tol - _EPS:
            fails.append(f"guard {g.name} regressed: {g.value:.4g} vs {g.frontier:.4g} {g.unit} ({g.basis}), "
                         f"gain {_pct(gain)} with CI [{_pct(ci[0])}, {_pct(ci[1])}] entirely below "
                         f"-{tol * 100:.2f}% (guard_tolerance)")
        else:
            notes.append(f"guard {g.name}: ok, gain {_pct(gain)} CI [{_pct(ci[0])}, {_pct(ci[1])}]")
    return fails, notes


def decide(gate_ok: bool, gate_reasons: Sequence[str], scored: Evidence | None, guards: Sequence[Evidence],
           policy: TierPolicy, *, claim: bool = False, notes: Sequence[str] = (),
           guards_convict: bool = True, flags: Sequence[str] = (), unsound: Sequence[str] = (),
           drift: Sequence[str] = ()) -> Verdict:
    """Inputs + policy -> Verdict. Deterministic: no clock, no randomness beyond the evidence's seeded CIs.

    `flags`: why metrics are not scored (zero-variance samples); `unsound`: why a metric's comparison arm is no
    sound basis (its outputs failed the reference, or its reps beat the ceiling); `drift`: why the pinned slot
    is no basis on this box (the reference drifted from its baseline). Any of them makes the speed label
    inconclusive (a BASELINE too: a flagged number never becomes a basis); a guard failure among the
    guards passed in (the caller leaves flagged guards out) still REJECTs."""
    if not gate_ok:
        reasons = tuple(gate_reasons) or ("correctness gate failed",)
        shown = "; ".join(reasons[:3]) + (f"; and {len(reasons) - 3} more" if len(reasons) > 3 else "")
        text = ("REJECT: the candidate failed the correctness check before any speed number could count ("
                + shown + "). No speed numbers are reported; speed is never scored for a wrong answer.")
        return Verdict(label="REJECT", basis="none", reasons=list(reasons), explanation=text, claim=claim)
    if scored is None:
        raise InputError("no scored metric evidence", "the receipt's speed section must measure the scored metric")
    speed_label, speed_reasons = _speed(scored, policy)
    not_scored = [*flags, *unsound, *drift]
    if not_scored:
        speed_label = "inconclusive"
        speed_reasons = [f"not scored: {f}" for f in not_scored] + [f"(unflagged, the speed would read: {r})"
                                                                   for r in speed_reasons]
    fails, guard_notes = _guard_failures(guards, policy)
    if fails and not guards_convict:
        # main against its own pinned frontier: a regression on main or a slower box. Flag it; never
        # REJECT main for speed (a raise-only frontier would dead-lock every later round)
        guard_notes = [f"warning: {f}; if real, lower it deliberately: `scoreboard frontier lower --reason ...`"
                       for f in fails] + guard_notes
        fails = []
    label = "REJECT" if fails else speed_label
    reasons = tuple(fails + speed_reasons + guard_notes + list(scored.notes) + list(notes))
    return Verdict(label=label, gain=scored.gain, gain_ci=scored.gain_ci, basis=scored.basis,
                   frontier=scored.frontier if scored.basis != "none" else None, value=scored.value,
                   speed_label=speed_label, reasons=list(reasons),
                   explanation=_explain(label, speed_label, scored, policy, fails, claim, flags, unsound, drift),
                   claim=claim, flags=not_scored)


# One estimator, one name, wherever a number is shown (round show, tier, the report, the explanation):
# an arm's value is the geometric mean over blocks of each block's median rep throughput.
ESTIMATOR = "geomean of block medians"
POOLED_MEDIAN = "median of all reps"  # descriptive only; never scored

_BASIS_WORDS = {"main-same-round": "main measured in the same round on the same box",
                "frontier-same-round": "the frontier's commit re-measured in the same round on the same box",
                "frontier-slot": "the pinned frontier slot", "none": "no basis"}


def _explain(label: str, speed_label: str, ev: Evidence, policy: TierPolicy, fails: list[str], claim: bool,
             zero: Sequence[str] = (), unsound: Sequence[str] = (), drift: Sequence[str] = ()) -> str:
    flagged = bool(zero or unsound or drift)
    kind = "claimed, not measured: " if claim else ""
    head = f"{label}: {kind}the candidate's {ev.name} is {ev.value:.4g} {ev.unit}"
    if not claim and ev.basis != "none":
        head += f" ({ESTIMATOR})"  # the same estimator as the speed table's value column and the basis
    if ev.basis == "none":
        body = (f"{head}, and there is no frontier yet" + (
            "." if flagged else ", so it is the BASELINE the next rounds are scored against."))
    else:
        g, ci = ev.gain or 0.0, ev.gain_ci  # a basis other than "none" has a frontier > 0, so a gain
        body = (f"{head} against {ev.frontier:.4g} {ev.unit} from {_BASIS_WORDS[ev.basis]}"
                + (" (same estimator)" if ev.basis == "main-same-round" and not claim else "")
                + f", a gain of {_pct(g)}")
        if ci is not None:
            body += (f" ({policy.confidence * 100:.0f}% CI {_pct(ci[0])} to {_pct(ci[1])} over "
                     f"{ev.n_blocks} blocks)")
        else:
            body += " (a single number, no confidence interval)"
        body += "."
        if flagged:
            pass  # said below
        elif speed_label == "inconclusive":
            body += (f" The interval is wider than the policy's {policy.max_ci_width * 100:.2f} points, so the run "
                     "is too noisy to call: inconclusive, not a guess.")
        elif speed_label == "regression":
            body += (f" The whole interval lies below -{policy.guard_tolerance * 100:.2f}% (guard_tolerance): that is "
                     "a regression, not noise. It moves no slot, and the round exits 2.")
        elif speed_label == "none":
            body += (" That is not a significant gain: it needs the whole interval above zero and at least "
                     f"{min(policy.buckets.values()) * 100:.2f}%." if policy.buckets else " No buckets are set.")
        else:
            body += f" That reaches tier {speed_label} (threshold {policy.buckets[speed_label] * 100:.2f}%)."
    if zero:
        body += (" Some samples have zero variance (reps identical to the nanosecond, or identical block "
                 "values), which no real clock produces: those metrics are flagged and not scored, so the "
                 "verdict is inconclusive.")
    if unsound:
        body += (f" The arm it is compared with is no sound basis ({'; '.join(unsound[:2])}): that metric is not "
                 "scored, so the verdict is inconclusive. The candidate is not at fault; run the round again, and "
                 "if it repeats, see docs/receipt-format.md (verdict.flags).")
    if drift:
        body += (f" Its basis is the pinned frontier slot, a constant measured on the box as it was, and this round's "
                 f"reference was not ({'; '.join(drift[:2])}): nothing in the round cancels that, so the gain against "
                 "the slot is not scored and the verdict is inconclusive. Re-run on a quiet box; if the slot's commit "
                 "cannot be re-measured here, re-base it from a sealed main receipt: `scoreboard frontier rebase`.")
    if fails:
        body += (f" But a guard failed ({'; '.join(fails)}), so the verdict is REJECT; the speed alone would have "
                 f"earned {speed_label}.")
    if claim:
        body += " This is a claim: it was not measured in a sealed round and moves nothing."
    return body


# ----------------------------------------------------------------------------------------------
# from a receipt

@dataclass(frozen=True)
class Scoring:
    """The sections of a receipt the verdict is computed from, parsed by their receipt models."""

    gate: GateRec | None
    speed: SpeedRec | None
    seed: Any  # an int in every valid receipt; checked when the speed is scored
    is_main: bool  # the candidate is main: its same-round basis is the frontier arm, and guards only warn


def _section(model: type[_Section], data: Any, name: str) -> _Section | None:
    if data is None:
        return None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = validation_messages(exc, name)
        raise InputError(f"receipt {name}: {len(problems)} problem(s)\n" + "\n".join(f"  {p}" for p in problems),
                         "see docs/receipt-format.md") from None


def scoring(receipt: Receipt | Mapping[str, Any]) -> Scoring:
    """What the verdict reads from `receipt`. A Mapping is a receipt still being assembled (the round
    scores it before its verdict section exists) or a partial one: only the sections read are parsed,
    each by its receipt model, so a bad field is named with its path."""
    if isinstance(receipt, Receipt):
        if receipt.aborted is not None:
            _refuse_aborted(receipt.round_id, receipt.aborted.stage, receipt.aborted.reason)
        return Scoring(receipt.gate, receipt.speed, receipt.seed, receipt.candidate.is_main)
    rid = receipt.get("round_id", "?")
    refuse_unknown_format(receipt, f"receipt {rid}")
    if receipt.get("status") == "aborted":
        ab = receipt.get("aborted") or {}
        _refuse_aborted(rid, ab.get("stage", "?"), ab.get("reason", ""))
    return Scoring(_section(GateRec, receipt.get("gate"), "gate"), _section(SpeedRec, receipt.get("speed"), "speed"),
                   receipt.get("seed", _MISSING), bool((receipt.get("candidate") or {}).get("is_main", False)))


_MISSING = object()


def _refuse_aborted(rid: str, stage: str, reason: str) -> None:
    raise InputError(f"receipt {rid} aborted at stage {stage}: {reason}; an aborted round has no verdict",
                     "re-run the round")


def _depth_field(d: Mapping[str, Any], key: str, depth: Any) -> Any:
    if key not in d:
        raise InputError(f"receipt gate.depths[{depth}].{key}: required field is missing",
                         "the receipt is incomplete; re-run the round")
    return d[key]


def gate_check(gate: GateRec | None, policy: GatePolicy) -> tuple[bool, list[str], bool]:
    """(ok, reasons, flagged) re-derived from the gate statistics and the policy's bars, plus recorded `pass`."""
    if gate is None:
        return False, ["gate: no gate statistics (the gate did not run or failed to complete)"], False
    reasons: list[str] = []
    depths: dict[Any, dict[str, Any]] = {d.get("depth"): d for d in gate.depths}
    for want in policy.depths:
        if want not in depths:
            reasons.append(f"gate: depth {want} was not graded (a partial suite is never scored)")
    flagged = False
    for depth, d in sorted(depths.items(), key=lambda kv: (kv[0] is None, kv[0])):
        at = f"gate depth {depth}"
        kl, p99, top1 = (_depth_field(d, k, depth) for k in ("kl_mean", "kl_p99", "top1"))
        if d.get("rows", 0) < policy.rows_per_depth:
            reasons.append(f"{at}: {d.get('rows', 0)} rows < rows_per_depth {policy.rows_per_depth}")
        reasons += bar_reasons(depth, kl, p99, top1, d.get("ratchet_baseline"), policy)
        if d.get("pass") is False and not any(r.startswith(f"{at}:") for r in reasons):
            # recorded as failed for a reason the bars above don't re-derive: honour it
            reasons.extend(f"{at}: {r}" for r in d.get("reasons", []) or ["recorded as failed"])
        flagged = flagged or kl > policy.kl_prefer
    if gate.pass_ is not True and not reasons:
        reasons.extend(gate.reasons or ["gate: recorded as failed"])
    return not reasons, list(dict.fromkeys(reasons)), flagged


def _blocks(arm: ArmRec) -> dict[int, tuple[list[int], list[int]]]:
    return {b.block: (list(b.samples_ns), list(b.n_tokens)) for b in arm.blocks}


def _block_values(arm: ArmRec, path: str, order: Sequence[int] | None = None) -> list[float]:
    blocks = _blocks(arm)
    keys = sorted(blocks) if order is None else list(order)
    missing = [k for k in keys if k not in blocks]
    if missing or (order is not None and set(blocks) != set(order)):
        raise InputError(f"receipt {path}: blocks {sorted(blocks)} are not paired with the candidate's "
                         f"{sorted(keys)}", "paired arms must share block indices")
    try:
        return [block_value(*blocks[k]) for k in keys]
    except ValueError as exc:
        raise InputError(f"receipt {path}: {exc}") from None


def _find_metric(speed: SpeedRec, m: Metric) -> tuple[int, SpeedMetric]:
    for i, e in enumerate(speed.metrics):
        if (e.phase, e.depth, e.n_tokens) == (m.phase, m.depth, m.n_tokens):
            return i, e
    raise InputError(f"receipt speed.metrics: no entry for the {m.role} metric {metric_name(m)}",
                     "the round must measure every metric of the target")


def _wanted_tokens(checked: Mapping[str, Any] | None, greedy: Any, variant: Any) -> Any:
    """The tokens a timed rep of `variant` must reproduce: its variant's checked outputs, or (receipts
    before per-variant reveals) the one checked greedy decode."""
    if checked is None:
        return greedy
    outs = checked.get("outputs") or []
    ok = isinstance(variant, int) and not isinstance(variant, bool) and 0 <= variant < len(outs)
    return outs[variant] if ok else None


def _timed_output_problems(s: Scoring, entry: SpeedMetric, m: Metric) -> tuple[list[str], list[str], list[str]]:
    """(the candidate's problems, why the metric has no sound basis, notes) for one metric's timed outputs.

    The candidate's timed reps must have produced what its checked (gate) run produced for their variant
    (MLPerf TEST01), and no candidate rep may beat the physical ceiling recorded with the samples: a failure
    is the candidate's, a REJECT. Another harness-clocked arm (a main round's frontier commit, a PR round's
    main) is not the party measured: the candidate cannot touch its tree or its sandbox. Its outputs failing
    the reference, or its reps beating the ceiling, leave the metric without a sound basis (flagged, not
    scored: the verdict is inconclusive), never a REJECT of the candidate. Its outputs varying across blocks
    while every one passes the reference is a note about that commit (a run-dependent sum order, say): the
    arm did the workload correctly each time, so its clock is a measurement. Re-derived from the raw outputs,
    never from the recorded flags alone, except the reference's grade of another arm's outputs (that needs
    the reference, so it is read from the arm's output check)."""
    from .ceiling import implausible

    problems: list[str] = []
    basis: list[str] = []
    notes: list[str] = []
    name = metric_name(m)
    if entry.timed_output_ok is False:
        problems.append(f"{name}: timed outputs differ from the checked run (timed_output_ok false)")
    key = f"{m.phase}@{m.depth}"
    checked = ((s.gate.checked if s.gate else None) or {}).get(key)
    greedy = ((s.gate.greedy if s.gate else None) or {}).get(key)
    for b in entry.arms["candidate"].blocks:
        if problems:
            break
        for r, ids in enumerate(b.token_ids or []):
            v = b.variants[r] if b.variants is not None and r < len(b.variants) else None
            want = _wanted_tokens(checked, greedy, v)
            if (checked is not None or greedy is not None) and (want is None or list(ids) != list(want)):
                problems.append(f"{name}: block {b.block} rep {r} produced tokens that differ from the checked "
                                "run of its variant")
                break
    ceiling = s.speed.ceiling if s.speed else None
    for arm, data in entry.arms.items():
        if arm == "reference":
            continue
        samples = [x for b in data.blocks for x in b.samples_ns]
        why = implausible(ceiling, m.phase, m.n_tokens, samples, m.depth)
        if arm == "candidate":
            if why:
                problems.append(f"{name}: {arm} arm: {why}; the metric is not scored")
            continue
        check = data.output_check
        if check is not None and check.ok is False:
            basis.append(f"{name}: the {arm} arm's timed outputs failed their check: "
                         + "; ".join(map(str, check.reasons or ["recorded as failed"]))
                         + f"; the {arm} arm is no sound basis (a fault of its commit, not the candidate's)")
        if why:
            basis.append(f"{name}: {arm} arm: {why}; it is no sound basis")
        varied = _varied_outputs(data)
        if varied and not (check is not None and check.ok is False):
            notes.append(f"{name}: the {arm} arm's outputs varied across blocks ({varied}), each passing the "
                         f"reference: that commit is not deterministic on this box; its clock still counts")
    return problems, basis, notes


def _varied_outputs(arm: ArmRec) -> str:
    """`variant 1: 2 outputs` for every variant whose timed reps gave more than one output ('' if none)."""
    return ", ".join(f"variant {v}: {len(o)} outputs" for v, o in sorted(distinct_outputs(arm.blocks).items())
                     if len(o) > 1)


def verdict_from_receipt(receipt: Receipt | Mapping[str, Any], target: Target | None = None) -> Verdict:
    """Recompute the verdict from a receipt's raw data; never reads its `verdict` section.

    `target` None: the policy recorded in the receipt (`lock_target`); pass the current lock's target to
    re-score under today's policy. The bootstrap is seeded with the receipt's `seed`.
    """
    s = scoring(receipt)
    return verdict_from_scoring(s, target or receipt_target(receipt))


def verdict_from_scoring(s: Scoring, target: Target) -> Verdict:
    """The verdict of a receipt's parsed sections under `target`'s policy."""
    ok, reasons, flagged = gate_check(s.gate, target.gate)
    if not ok:
        return decide(False, reasons, None, (), target.tiers)
    if s.speed is None:
        raise InputError("receipt speed: null although the gate passed", "re-run the round")
    if s.seed is _MISSING:
        raise InputError("receipt seed: required field is missing", "the receipt is incomplete; re-run the round")
    if not isinstance(s.seed, int) or isinstance(s.seed, bool):
        raise InputError(f"receipt seed: must be an integer, got {s.seed!r}")
    notes = [f"gate passed but flagged: KL mean above kl_prefer {target.gate.kl_prefer:g}"] if flagged else []
    correctness: list[str] = []
    flags: list[str] = []
    unsound: list[str] = []
    drift: list[str] = []
    evs: dict[str, list[Evidence]] = {"scored": [], "guard": []}
    for m in target.metrics:
        i, entry = _find_metric(s.speed, m)
        path = f"speed.metrics[{i}]"
        cand_arm = entry.arms["candidate"]
        cand = _block_values(cand_arm, f"{path}.arms.candidate")
        order = sorted(_blocks(cand_arm))
        cand_problems, no_basis, out_notes = _timed_output_problems(s, entry, m)
        correctness += cand_problems
        notes += out_notes
        zero = zero_variance(entry.arms, metric_name(m))
        unsound += no_basis
        # the same-round basis: a PR's main, a main round's re-measured frontier commit
        paired = "main" if not s.is_main else "frontier"
        main_blocks, ev_notes = None, []
        slot = 0.0
        if entry.arms.get(paired):
            main_blocks = _block_values(entry.arms[paired], f"{path}.arms.{paired}", order)
        else:
            if not s.is_main:
                ev_notes.append(f"{metric_name(m)}: main was not measured in this round; scored against the pinned "
                                "slot, which may be stale")
            if entry.frontier is None:
                raise InputError(f"receipt {path}.frontier: required field is missing",
                                 "the receipt is incomplete; re-run the round")
            if entry.frontier < 0:
                raise InputError(f"receipt {path}.frontier: must be a number >= 0 tok/s, got {entry.frontier!r}")
            slot = float(entry.frontier)
            moved = _slot_drift(entry, target, m)
            if moved and slot > 0:
                drift.append(f"{metric_name(m)}: {moved}")
                if m.role == "guard":
                    continue  # a guard against a constant the box no longer matches is not judged
        try:
            ev = evidence(m, cand, target.tiers, s.seed, main_blocks, slot, ev_notes,
                          paired_basis=f"{paired}-same-round")
        except ValueError as exc:
            raise InputError(f"receipt {path}: {exc}") from None
        flags += zero
        if (zero or no_basis) and m.role == "guard":
            continue  # a flagged guard is not judged (its numbers, or its basis, are no measurement)
        evs[m.role].append(ev)
    if correctness:
        return decide(False, correctness, None, (), target.tiers)
    scored_drift = [d for d in drift if d.startswith(metric_name(target.scored) + ":")]
    notes += [f"not judged: {d}" for d in drift if d not in scored_drift]
    return decide(True, [], evs["scored"][0], evs["guard"], target.tiers, notes=notes,
                  guards_convict=not s.is_main, flags=flags, unsound=unsound, drift=scored_drift)


def _slot_drift(entry: SpeedMetric, target: Target, m: Metric) -> str | None:
    """Why the reference arm of `entry` is too far from the baseline the round recorded at its start (None
    when it is not, or when the receipt predates the record)."""
    if entry.baseline is None:
        return None
    return drift_problem(entry, float(entry.baseline), target.speed.reference_drift_max,
                         target.slot(target.reference_engine, m))


def zero_variance(arms: Mapping[str, ArmRec], name: str) -> list[str]:
    """Why a metric's samples are no measurement, per arm: every timed rep of the arm the same number of
    nanoseconds (>= 2 reps), all reps of one block identical (>= 2 reps in it), or every block value
    identical (>= 2 blocks: a zero-width CI). A real clock around real work never repeats to the
    nanosecond; a fixed, self-reported or replayed time does."""
    out = []
    for arm in sorted(arms):
        blocks = _blocks(arms[arm])
        reps = [ns for ns_list, _ in blocks.values() for ns in ns_list]
        same_block = [k for k, (ns_list, _) in sorted(blocks.items()) if len(ns_list) >= 2 and len(set(ns_list)) == 1]
        try:
            values = [block_value(*blocks[k]) for k in sorted(blocks)]
        except ValueError:
            values = []
        if len(reps) >= 2 and len(set(reps)) == 1:
            out.append(f"{name}: arm {arm}: all {len(reps)} timed reps took exactly {reps[0]} ns (zero variance)")
        elif same_block:
            out.append(f"{name}: arm {arm}: every rep of block {same_block[0]} took the same "
                       f"{blocks[same_block[0]][0][0]} ns (zero variance)")
        elif len(values) >= 2 and len(set(values)) == 1:
            out.append(f"{name}: arm {arm}: all {len(values)} block values are identical ({values[0]:.6g} tok/s): "
                       "a zero-width interval, not a measurement")
    return out


def score_claim(value: float, lock: Lock, target: str, metric: str = "scored") -> Verdict:
    """Label a claimed number (a PR description, an unsealed run) against the frontier slot. Moves nothing."""
    t = lock.target(target)
    m = select_metric(t, metric)
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InputError(f"--claim {value!r}: must be a positive number of {m.unit}")
    slot_name = t.slot(t.candidate_engine, m)
    slot = lock.slots.get(slot_name)
    frontier = slot.value if slot is not None else 0.0
    basis = "frontier-slot" if frontier > 0 else "none"
    ev = Evidence(metric_name(m), m.role, m.higher_is_better, float(value), basis, float(frontier), None, m.unit,
                  (f"claimed, not measured: basis {slot_name} = {frontier:g} {m.unit}",))
    return decide(True, [], ev, (), t.tiers, claim=True)


def select_metric(t: Target, metric: str) -> Metric:
    """`scored`, a slot name, or `phase@depth` (e.g. `prefill@0`)."""
    if metric == "scored":
        return t.scored
    for m in t.metrics:
        if metric in (t.slot(t.candidate_engine, m), f"{m.phase}@{m.depth}"):
            return m
    names = ["scored"] + [f"{m.phase}@{m.depth}" for m in t.metrics]
    raise InputError(f"--metric {metric!r}: not a metric of this target", f"use one of {', '.join(names)}")


# ----------------------------------------------------------------------------------------------
# descriptive summary (median, MAD, CV, ratio CIs per arm) for display and for the receipt

@dataclass(frozen=True)
class MetricSummary:
    name: str
    role: str
    arms: dict[str, ArmStats]  # arm -> stats
    vs_reference: RatioCI | None  # candidate/reference over paired blocks


def summarize_speed(receipt: Receipt | Mapping[str, Any], target: Target) -> list[MetricSummary]:
    """Per metric: each arm's median/MAD/CV/n and the candidate/reference ratio with its CI. A Mapping
    (a partial receipt) has its ``speed`` section parsed first."""
    if isinstance(receipt, Receipt):
        speed, seed = receipt.speed, receipt.seed
    else:
        speed, seed = _section(SpeedRec, receipt.get("speed") or None, "speed"), int(receipt.get("seed", 0))
    if not speed:
        return []
    out = []
    for m in target.metrics:
        i, entry = _find_metric(speed, m)
        arms: dict[str, ArmStats] = {}
        for arm, data in sorted(entry.arms.items()):
            blocks = _blocks(data)
            try:
                arms[arm] = arm_stats([blocks[k] for k in sorted(blocks)])
            except ValueError as exc:
                raise InputError(f"receipt speed.metrics[{i}].arms.{arm}: {exc}") from None
        vs_ref = None
        if "candidate" in arms and "reference" in arms and \
                len(arms["candidate"].block_values) == len(arms["reference"].block_values) >= 2:
            vs_ref = paired_ratio_ci(arms["candidate"].block_values, arms["reference"].block_values,
                                     target.tiers.confidence, target.tiers.bootstrap_resamples, seed)
        out.append(MetricSummary(metric_name(m), m.role, arms, vs_ref))
    return out
