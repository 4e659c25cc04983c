"""The round's stages: preflight (pins, weights, config, fit, builds), the gate, interleaved speed.

Each stage gets what it needs as arguments (the round's fixed `RoundContext`, the preflight's result, the
arms) and returns the typed receipt section it produced (GateRec, SpeedRec, ...); `Round` (round/run.py) records
the sections and assembles them into a `Receipt`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from pydantic import ValidationError

from .. import environment, registry
from ..engine import LogitsRequest
from ..errors import EngineError, InputError
from ..gate import GateResult, gate_positions, grade_depth, log_softmax64, top1_ok
from ..history.held import History
from ..history.receipt import Arm as ArmRec
from ..history.receipt import (Block, FitRec, FrontierArmRec, GateRec, HandshakeRec, OutputCheck, ReferenceSide,
                               SpeedMetric, SpeedRec, WeightsRec, distinct_outputs, validation_messages)
from .arms import Arm, reference_arm
from .candidate import CandidateSource
from .clock import SessionPlan, run_session
from .context import RoundContext, RoundLog, Targets
from .prompt import Prompt, draw_prompt
from .reveal import Variants, metric_variants
from .schedule import balanced_schedule
from ..worker.protocol import CheckedRun, GateOp, LogitsRows, TimedOp, WorkerResult


@dataclass(frozen=True)
class Preflight:
    """What preflight established before any candidate code ran."""

    shards: tuple[Path, ...]
    config: Any  # models.k3 config
    fit: Any  # fit.FitCheck
    ceiling: dict[str, Any] | None  # scoreboard.ceiling: the decode-rate bound, or None
    targets: Targets
    reference: Arm  # prepared: built and re-verified at its pin


def decode_ceiling_of(ctx: RoundContext, shards: tuple[Path, ...], config: Any) -> dict[str, Any] | None:
    """The decode-rate ceiling from the weights just re-hashed (before any candidate code ran, so the
    candidate could not have touched the tensor sizes it is computed from) and the node class."""
    from ..ceiling import decode_ceiling

    t = ctx.target
    bw = ctx.lock.nodes[t.node].memory_bandwidth_gbs
    if bw is None:
        return None
    devices = t.parallel.ranks if t.device == "cuda" else 1
    return decode_ceiling(list(shards), config, bw, devices).as_dict()


def fingerprint(ctx: RoundContext) -> dict[str, Any]:
    """environment: the box's fingerprint and how the target's ranks are laid out on it."""
    t = ctx.target
    fp = environment.fingerprint()
    par = t.parallel
    fp["parallel"] = {"ranks": par.ranks, "backend": par.backend_for(t.device),
                      "launcher": "torchrun --standalone" if par.ranks > 1 else "one process",
                      "reference_split_mode": par.reference_split_mode,
                      "visible_devices": ctx.device_env().get("CUDA_VISIBLE_DEVICES", "")}
    return fp


def check_node(ctx: RoundContext, fp: Mapping[str, Any]) -> None:
    """Refuse a box that is not of the target's node class (unless the round allows a mismatch)."""
    refuse_other_node(ctx.lock, ctx.target_id, fp, ctx.allow_node_mismatch)


def refuse_other_node(lock: Any, target_id: str, fp: Mapping[str, Any] | None = None, allow: bool = False) -> None:
    """InputError naming every field in which this box (`fp`, default: its fingerprint now) is not of the target's
    node class. The round asks before any receipt exists (run.check_inputs: a target typed for another box is an
    input error, nothing is written; no candidate process has run, so the box's fingerprint is the box's) and
    again in preflight, where the fingerprint it records is checked."""
    t = lock.target(target_id)
    bad = environment.node_mismatches(dict(fp if fp is not None else environment.fingerprint()), lock.nodes[t.node])
    if bad and not allow:
        raise InputError(f"this box is not of node class {t.node!r} that target {target_id!r} is measured on:\n  "
                         + "\n  ".join(bad), f"run `scoreboard env --target {target_id}` and use a matching box")


def check_reference_source(spec: str | None) -> None:
    """`--reference-source` (None: $SCOREBOARD_REFERENCE_SOURCE) parsed before anything runs, also when the build
    is cached and the source is never fetched: a typo is refused, not ignored until the next rebuild."""
    try:
        from engines.llamacpp.source import SOURCE_ENV, ReferenceSource
    except ImportError:  # the reference plugin is not installed here: its transport is not ours to read
        return
    import os

    if spec is None and not os.environ.get(SOURCE_ENV, "").strip():
        return
    try:
        ReferenceSource.parse(spec)
    except InputError as exc:
        where = "--reference-source" if spec is not None else f"${SOURCE_ENV}"
        raise InputError(f"{where}: {exc.message}", exc.hint) from None


def weights(ctx: RoundContext) -> tuple[tuple[Path, ...], WeightsRec]:
    """Every shard re-hashed against the lock (generated weights are generated first if absent)."""
    from ..weights.verify import ensure_generated, verify_weights, weights_dir

    t = ctx.target
    w = ctx.lock.weights[t.weights]
    ctx.report("step", message=f"verifying {len(w.files)} weight shard(s) of {t.weights}")
    if w.repo == "generated":
        shards = ensure_generated(ctx.lock, t.weights, ctx.cache_dir)
    else:
        shards = verify_weights(ctx.lock, t.weights, weights_dir(t.weights, ctx.cache_dir)).paths
    rec = WeightsRec.model_validate({"id": t.weights, "fully_pinned": w.fully_pinned,
                                     "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in w.files]})
    return tuple(shards), rec


def model_and_fit(ctx: RoundContext, shards: tuple[Path, ...]) -> tuple[Any, Any, FitRec]:
    """The model config from the first shard, and the fit check's prediction (refuses what cannot fit)."""
    from ..fit import check_fit, fit_budget
    from ..models.k3 import load_k3_config

    ctx.report("step", message="model config checks")
    config = load_k3_config(shards[0])
    fit = check_fit(fit_budget(ctx.lock, ctx.target_id, weights_dir=shards[0].parent))
    ctx.report("step", message=f"fit: {fit.summary()}")
    rec = FitRec(ranks=fit.ranks, need_gib_per_rank=round(fit.need_gib, 4), usable_gib=fit.usable_gib,
                 lines={x.item: round(x.gib, 4) for x in fit.lines})
    return config, fit, rec


def prepare_reference(ctx: RoundContext, log: RoundLog, targets: Targets) -> tuple[Arm, ReferenceSide]:
    """The reference engine prepared at its pin (its build re-verified), as the round's reference arm."""
    t = ctx.target
    engine = registry.load(t.reference_engine)
    ctx.report("step", message=f"preparing reference {t.reference_engine} at its pin (build re-verified)")
    def progress(msg: str, frac: float | None = None) -> None:
        ctx.report("step", message=msg)

    prepared = engine.prepare(targets.reference, ctx.cache_dir, progress)
    return reference_arm(ctx, log, engine, prepared), ReferenceSide(engine=t.reference_engine,
                                                                     identity=prepared.identity.as_dict())


def check_reference_anchor(ctx: RoundContext, identity: dict[str, Any]) -> None:
    """A built reference: its files against the latest sealed receipt for its build key."""
    if (identity.get("extra") or {}).get("build_key"):
        from .evidence import check_reference_build

        ctx.report("step", message="reference build files against the latest sealed receipt for its build key")
        check_reference_build(identity, ctx.rounds_dir, renew=ctx.renew_reference_anchor)


def isolation_record(isolation: str, sources: Mapping[str, CandidateSource]) -> dict[str, Any]:
    """environment.isolation: the sandbox the candidate's workers run in (sandbox.check; refuses a missing or
    broken sandbox before any engine runs) and where each arm's code comes from (a git arm: a clean export of
    its commit; a path: a development tree)."""
    from .sandbox import check

    rec = check(isolation)
    rec["arms"] = {name: {"kind": s.kind, "commit": s.commit, "engines_tree": s.engines_tree,
                          "source": "git archive export" if s.kind == "git" else "development tree"}
                   for name, s in sources.items()}
    return rec


class GateStage:
    """Logits from both engines at every gate depth (incl. the scored depth), graded in float64."""

    def __init__(self, ctx: RoundContext, pre: Preflight, candidate: Arm, log: RoundLog):
        self.ctx, self.pre, self.candidate, self.log = ctx, pre, candidate, log
        self.reference = pre.reference
        t = ctx.target
        self.geometry = pre.targets.geometry
        from ..weights.tokenizer import Tokenizer

        tok = self.tokenizer = Tokenizer.from_gguf(pre.shards[0])
        self.need = max([max(t.gate.depths)] + [m.depth + m.n_tokens for m in t.metrics])
        self.prompt: Prompt = self.draw(ctx.seed)
        # V secret variants per metric: every timed launch reveals each once (warm-up reps included)
        self.n_variants = t.speed.warmup_reps + (ctx.reps or t.speed.reps)
        try:
            self.variants: list[Variants] = [
                metric_variants(tok, self.prompt.token_ids, m.phase, m.depth, m.n_tokens, self.n_variants, ctx.seed,
                                t.speed.reveal_bits)
                for m in t.metrics]
        except ValueError as exc:
            raise InputError(f"targets.{ctx.target_id}.metrics: {exc}",
                             "a decode metric's depth must hold its revealed tokens (speed.reveal_bits of secret)"
                             ) from None
        self.checked: dict[str, list[list[int]]] = {}  # metric -> the checked output of each variant
        self.checked_lp: dict[str, list[list[float]]] = {}  # metric -> the checked output's log-probs per variant
        # (metric, variant) -> the reference's logits at the variant's generated positions (teacher-forced)
        self.ref_rows: dict[tuple[str, int], np.ndarray] = {}
        self.ref_next: dict[str, list[int]] = {}  # prefill metric -> the reference's next token per variant
        self.graded: dict[tuple[str, int, tuple[int, ...]], bool] = {}  # (metric, variant, output) -> vs reference

    def draw(self, seed: int) -> Prompt:
        """The gate's prompt for a seed: the round draws one; a calibration draws one per seed."""
        return draw_prompt(self.tokenizer, self.need, seed)

    def rows(self, prompt: Prompt,
             depths: Sequence[int] = ()) -> tuple[dict[int, list[int]], list[int], tuple[int, ...]]:
        """(gate positions per depth, every position sorted, the token ids both engines get) for a prompt: at every
        gate depth, or at `depths` (a calibration's fault rows) on the prompt's prefix through the deepest of them."""
        pol = self.ctx.target.gate
        depths = tuple(depths) or pol.depths
        per_depth = {d: gate_positions(d, pol.rows_per_depth) for d in depths}
        positions = sorted({p for ps in per_depth.values() for p in ps})
        geom = self.geometry
        ids = padded(prompt.token_ids[: max(depths)], geom.n_ubatch, geom.n_ctx, prompt.token_ids)
        return per_depth, positions, ids

    def grade(self, per_depth: dict[int, list[int]], positions: list[int], ref: np.ndarray, cand: np.ndarray,
              baselines: dict[int, float] | None = None) -> GateResult:
        """Every gate depth's rows graded against the bars (and the ratchet, when baselines are given)."""
        if cand.shape != ref.shape:
            raise EngineError(f"candidate logits have shape {cand.shape}, reference {ref.shape}",
                              "the candidate must return one row per requested position over the full vocabulary")
        row = {p: i for i, p in enumerate(positions)}
        pol = self.ctx.target.gate
        depths = []
        for d, ps in per_depth.items():
            sel = [row[p] for p in ps]
            depths.append(grade_depth(d, ps, ref[sel], cand[sel], pol, (baselines or {}).get(d)))
        return GateResult(depths)

    def collect(self) -> tuple[Any, WorkerResult]:
        """The reference's logits at the gate rows, then one candidate worker: its logits at the same rows and
        its checked output for every secret variant of every metric."""
        pol = self.ctx.target.gate
        _per_depth, positions, ids = self.rows(self.prompt)
        self.ctx.report("step", message=f"reference logits: {len(positions)} rows at depths {list(pol.depths)}")
        ref = self.reference.logits(LogitsRequest(ids, tuple(positions), self.geometry))
        if ref.command:
            self.log.command(ref.command, once=False)
        self.ctx.report("step", message=f"candidate logits and its checked outputs for {self.n_variants} secret "
                                        "variants per metric (fresh worker process)")
        res = self.candidate.worker().call(gate_op(ids, positions, self.variants)).result
        return ref, res

    def judge(self, ref: Any, res: WorkerResult, baselines: dict[int, float],
              ratchet_round: str | None) -> GateRec:
        """The gate section: every depth graded (bars and ratchet), then each variant's checked output."""
        pol = self.ctx.target.gate
        per_depth, positions, _ids = self.rows(self.prompt)
        if not res.logits:  # the protocol's check_result already refuses this; a type guard here
            raise EngineError("the gate worker returned no logits file")
        cand = np.load(res.logits[0].path)
        result = self.grade(per_depth, positions, ref.logits, cand, baselines)
        # the checked outputs, one per secret variant, graded against the reference; every timed rep must
        # reproduce its variant's
        self.ctx.report("step", message="checked outputs against the reference (each timed rep must reproduce "
                                        "its variant's)")
        outputs = res.checked
        if not isinstance(outputs, list) or len(outputs) != len(self.variants):
            raise EngineError("the gate worker returned no checked outputs for the metrics' variants")
        checked: dict[str, Any] = {}
        greedy_check: list[dict[str, Any]] = []
        prefill_check: list[dict[str, Any]] = []
        failed: list[str] = []
        path_files = res.checked_logits or [[None] * len(v.reveals) for v in self.variants]
        path_lps = res.checked_logprobs or [[None] * len(v.reveals) for v in self.variants]
        decode_path: list[dict[str, Any]] = []
        total = sum(len(v.reveals) for v in self.variants)  # one reference pass per variant: the gate's long part
        done = 0
        for var, outs, lps, files in zip(self.variants, outputs, path_lps, path_files):
            self.ctx.report("progress", task="checked outputs", done=done, total=total, message=var.key)
            done += len(var.reveals)
            w = var.workload
            if len(outs) != len(var.reveals) or any(len(o) != w.output_len for o in outs):
                raise EngineError(f"{var.key}: the checked run returned {[len(o) for o in outs]} ids per variant, "
                                  f"the contract wants {w.output_len} for each of {len(var.reveals)}",
                                  "decode returns n_tokens ids, prefill one (the next token)")
            self.checked[var.key] = [list(map(int, o)) for o in outs]
            if w.phase == "decode":
                rows, why = self.judge_decode(var, outs, pol)
                greedy_check += rows
            else:
                rows, why = self.judge_prefill(var, outs, pol)
                prefill_check += rows
            failed += why
            path, why = self.judge_path(var, outs, lps, files)
            failed += why
            if path is not None:
                decode_path.append(path)
            checked[var.key] = {**var.describe(), "outputs": self.checked[var.key],
                                "logprobs": self.checked_lp.get(var.key)}
        self.ctx.report("progress", task="checked outputs", done=total, total=total, message="done")
        d = result.as_dict()
        return GateRec.model_validate({
            "depths": d["depths"], "worst": d["worst"], "pass": d["pass"] and not failed, "flagged": d["flagged"],
            "reasons": d["reasons"] + failed, "prompt": self.prompt.describe(), "ratchet_round": ratchet_round,
            "geometry": ref.geometry.as_dict(), "checked": checked, "greedy_check": greedy_check,
            "prefill_check": prefill_check, "decode_path": decode_path,
            # variants whose outputs coincide could be answered by a replay
            "checked_distinct": {k: len({tuple(o) for o in outs}) for k, outs in self.checked.items()}})

    def judge_path(self, var: Variants, outs: list[list[int]], lps: list[list[float] | None],
                   files: list[Any]) -> tuple[dict[str, Any] | None, list[str]]:
        """The checked run's own step: its log-probs must be its logits rows' (what timed reps are held to), and a
        decode metric's rows are graded against the reference's teacher-forced rows at the same positions, at the
        metric's depth: the one-token step the timed decode runs is judged, not only the prefill's logits.
        Returns (the decode path's graded depth or None, failure reasons)."""
        pol = self.ctx.target.gate
        key = var.key
        if any(x is None for x in lps) or any(f is None for f in files):
            return None, [f"{key}: the checked run's step() returned no log-probs or keeps no logits rows "
                          "(step_logits): the engine contract 3 asks for both, so the timed path cannot be judged"]
        rows_all = []
        for v, (o, lp, f) in enumerate(zip(outs, lps, files)):
            rows = np.load(f.path)
            if rows.ndim != 2 or rows.shape[0] != len(o):
                return None, [f"{key} variant {v}: step_logits gave shape {rows.shape}, the contract wants "
                              f"[{len(o)}, vocab]"]
            own = log_softmax64(rows)[np.arange(len(o)), np.asarray(o)]
            dev = float(np.max(np.abs(own - np.asarray(lp, dtype=np.float64))))
            if not np.all(np.argmax(rows, axis=-1) == np.asarray(o)) or dev > self.ctx.target.speed.logprob_tol:
                return None, [f"{key} variant {v}: the log-probs or ids step() returned are not its own logits "
                              f"rows' (log-prob deviation {dev:.3g} > logprob_tol {self.ctx.target.speed.logprob_tol}, or an id is "
                              "not its row's argmax)"]
            rows_all.append(rows)
        self.checked_lp[key] = [list(map(float, lp)) for lp in lps if lp is not None]
        if var.workload.phase != "decode":
            return None, []
        ref = np.concatenate([self.ref_rows[(key, v)] for v in range(len(outs))], 0)
        cand = np.concatenate(rows_all, 0)
        d0 = var.workload.depth
        positions = [d0 - 1 + i for _ in outs for i in range(len(outs[0]))]
        # at most PATH_ROWS_PER_DEPTH x rows_per_depth rows, evenly spread over every variant's steps (a full
        # vocabulary's float64 KL over all V x n_tokens rows can take gigabytes)
        keep = np.unique(np.linspace(0, len(positions) - 1, min(len(positions),
                                                                 PATH_ROWS_PER_DEPTH * pol.rows_per_depth)).round()
                         .astype(int))
        graded = grade_depth(d0, [positions[i] for i in keep], ref[keep], cand[keep], pol).as_dict()
        graded.pop("positions", None)  # every variant's generated positions: named by the metric instead
        graded["metric"] = key
        return graded, [f"decode path {r}" for r in graded.get("reasons", [])]

    def judge_decode(self, var: Variants, outs: list[list[int]], pol: Any) -> tuple[list[dict[str, Any]], list[str]]:
        """Each decode variant's greedy tokens teacher-forced through the reference: (rows, failure reasons)."""
        rows, failed = [], []
        agreements = self.greedy_agreements(var, outs)
        for v, o in enumerate(outs):
            agree = agreements[v]
            ok = top1_ok(agree, pol)
            self.graded[(var.key, v, tuple(o))] = ok
            rows.append({"metric": var.key, "variant": v, "top1_vs_reference": agree, "pass": ok})
            if not ok:
                failed.append(f"{var.key} variant {v}: the decode path's greedy tokens agree with the reference's "
                              f"argmax on only {agree:.3f} of positions < top1_min {pol.top1_min}")
        return rows, failed

    def judge_prefill(self, var: Variants, outs: list[list[int]], pol: Any) -> tuple[list[dict[str, Any]], list[str]]:
        """Each prefill variant's next token against the reference's: (rows, failure reasons)."""
        self.ref_next[var.key] = [self.reference_next(var, v) for v in range(len(var.reveals))]
        hits = [o[0] == want for o, want in zip(outs, self.ref_next[var.key])]
        rows = []
        for v, (o, hit) in enumerate(zip(outs, hits)):
            self.graded[(var.key, v, tuple(o))] = hit
            rows.append({"metric": var.key, "variant": v, "token": o[0], "reference_token": self.ref_next[var.key][v],
                         "pass": hit})
        frac = float(np.mean(hits))
        if top1_ok(frac, pol):
            return rows, []
        return rows, [f"{var.key}: the prefill path's next token matches the reference's argmax on {frac:.3f} of "
                      f"variants < top1_min {pol.top1_min}"]

    def teacher_forced(self, var: Variants, v: int, toks: list[int]) -> LogitsRequest:
        """The reference request that teacher-forces variant v's tokens: rows at every generated position."""
        geom = self.geometry
        depth = var.workload.depth
        seq = var.full_prompt(v) + tuple(toks[:-1])
        pos = tuple(range(depth - 1, depth - 1 + len(toks)))
        return LogitsRequest(padded(seq, geom.n_ubatch, geom.n_ctx, tuple(self.prompt.token_ids)), pos, geom)

    def greedy_agreements(self, var: Variants, outs: list[list[int]]) -> list[float]:
        """Every variant's checked tokens teacher-forced through the reference in one request set (the variants
        share the prompt up to depth - K: the reference decodes it once where it can): the fraction of argmax
        matches per variant; the reference's rows are kept for the decode path's grading."""
        refs = self.reference.logits_many([self.teacher_forced(var, v, o) for v, o in enumerate(outs)])
        out = []
        for v, (o, ref) in enumerate(zip(outs, refs)):
            if list(o) == self.checked.get(var.key, [None] * (v + 1))[v]:
                self.ref_rows[(var.key, v)] = np.asarray(ref.logits, dtype=np.float32)
            out.append(float(np.mean(np.argmax(ref.logits, axis=-1) == np.asarray(o))))
        return out

    def greedy_agreement(self, var: Variants, v: int, toks: list[int]) -> float:
        """Teacher-force variant v's greedy tokens through the reference: fraction of argmax matches."""
        ref = self.reference.logits(self.teacher_forced(var, v, toks))
        return float(np.mean(np.argmax(ref.logits, axis=-1) == np.asarray(toks)))

    def reference_next(self, var: Variants, v: int) -> int:
        """The reference's greedy next token after prefill variant v's whole prompt."""
        geom = self.geometry
        seq = var.full_prompt(v)
        last = len(seq) - 1
        seq = padded(seq, geom.n_ubatch, geom.n_ctx, tuple(self.prompt.token_ids))
        ref = self.reference.logits(LogitsRequest(seq, (last,), geom))
        return int(np.argmax(ref.logits[0]))

    def grade_output(self, var: Variants, v: int, out: list[int]) -> bool:
        """An arm's output for variant v graded against the reference (cached per output): decode by
        teacher-forced top-1 agreement >= top1_min, prefill by equality with the reference's next token."""
        key = (var.key, v, tuple(out))
        if key not in self.graded:
            if var.workload.phase == "decode":
                self.graded[key] = top1_ok(self.greedy_agreement(var, v, out), self.ctx.target.gate)
            else:
                self.graded[key] = out[0] == self.ref_next[var.key][v]
        return self.graded[key]


PATH_ROWS_PER_DEPTH = 4  # the decode path's graded rows per decode metric, in units of gate.rows_per_depth
SHORT_UBATCH = 64  # llama.cpp takes a less precise KDA path for ubatches under 64 tokens


def padded(ids: tuple[int, ...], n_ubatch: int, n_ctx: int, filler: tuple[int, ...]) -> tuple[int, ...]:
    """`ids` extended with filler tokens so that no ubatch is shorter than SHORT_UBATCH tokens.

    Causal attention: rows at positions < len(ids) do not depend on the tokens after them, only on the
    path the engine takes; both engines get the same padded sequence, graded rows are unchanged.
    """
    tail = len(ids) % n_ubatch
    if tail == 0 or tail >= SHORT_UBATCH:
        return ids
    want = min(len(ids) - tail + n_ubatch, n_ctx)
    if want - len(ids) + tail < SHORT_UBATCH:
        return ids
    fill = (filler * (1 + (want - len(ids)) // max(len(filler), 1)))[: want - len(ids)]
    return ids + tuple(fill)


def gate_op(ids: tuple[int, ...], positions: list[int], variants: list[Variants]) -> GateOp:
    """The gate's worker request: logits at every gate row, and each metric's secret variants run untimed."""
    return GateOp(requests=(LogitsRows.of(ids, positions),),
                  checked=tuple(CheckedRun.of(v.workload, v.reveals) for v in variants))


def implausible_arm(ceiling: dict[str, Any] | None, entry: SpeedMetric, arm: str) -> str | None:
    """Why an arm's fastest timed rep of this metric is above the physical ceiling (None: it is not)."""
    from ..ceiling import implausible

    samples = [x for b in entry.arms[arm].blocks for x in b.samples_ns]
    return implausible(ceiling, entry.phase, entry.n_tokens, samples, entry.depth)


def block_rec(rec: Mapping[str, Any], arm: str, metric: str) -> Block:
    """One block's record as the receipt's typed model (EngineError naming what is malformed)."""
    try:
        return Block.model_validate(rec)
    except ValidationError as exc:
        where = f"speed {metric} arm {arm} block {rec.get('block')}"
        raise EngineError(f"{where}: " + "; ".join(validation_messages(exc)),
                          "every timed rep needs a positive duration and token count") from None


class SpeedStage:
    """Warm-up, then randomized balanced blocks over the arms; each harness-clocked block is a fresh worker
    process timed by the parent's clock around the reveal handshake, the reference's a block of its tool."""

    def __init__(self, ctx: RoundContext, pre: Preflight, arms: list[Arm], gate: GateStage, history: History):
        # arms: the reference, the candidate, and a PR round's "main" or a main round's "frontier" (its
        # re-measured frontier commit, from the history verified at preflight): every arm but the reference
        # is built, launched, timed and checked exactly like the candidate
        self.ctx, self.pre, self.gate, self.history = ctx, pre, gate, history
        self.arms = arms
        t = ctx.target
        self.blocks = ctx.blocks or t.speed.blocks
        self.reps = ctx.reps or t.speed.reps

    @property
    def names(self) -> list[str]:
        return [a.name for a in self.arms]

    def arm(self, name: str) -> Arm:
        return next(a for a in self.arms if a.name == name)

    def measure(self) -> SpeedRec:
        """The speed section: every arm's blocks of every metric, in the balanced schedule's order."""
        ctx, t = self.ctx, self.ctx.target
        if self.blocks < 2:
            raise InputError(f"--blocks {self.blocks}: at least 2 blocks are needed for a paired CI")
        variants = self.gate.variants
        schedule = balanced_schedule(self.names, self.blocks, ctx.seed)
        ctx.report("step", message=f"handshake cost: the harness's null engine, {self.gate.n_variants} reps")
        handshake = self.null_handshake()
        ctx.report("step", message=f"warm-up: one discarded pass of {', '.join(self.names)}")
        for arm in self.arms:
            arm.blocks(variants, 1, None)
        runs: list[dict[str, list[Block]]] = [{a: [] for a in self.names} for _ in t.metrics]  # metric -> arm
        total = len(schedule) * len(self.arms)
        done = 0
        for b, order in enumerate(schedule):
            for name in order:
                ctx.report("progress", task="speed blocks", done=done, total=total, message=f"block {b}: {name}")
                for per_arm, var, rec in zip(runs, variants, self.arm(name).blocks(variants, self.reps, b)):
                    per_arm[name].append(block_rec(rec, name, var.key))
                done += 1
        ctx.report("progress", task="speed blocks", done=total, total=total, message="done")
        extra: dict[str, Any] = {}
        fs = self.history.scored_frontier
        frontier = next((a for a in self.arms if a.name == "frontier"), None)
        if frontier is not None and frontier.source is not None and fs is not None:
            extra["frontier_arm"] = FrontierArmRec(commit=frontier.source.commit, slot=fs.slot, slot_value=fs.value,
                                                   round_id=fs.round_id)
        return SpeedRec(schedule=schedule, metrics=[self.metric_rec(m, per_arm) for m, per_arm in zip(t.metrics, runs)],
                        blocks=self.blocks, reps=self.reps, warmup_reps=t.speed.warmup_reps, clock="parent-handshake",
                        n_variants=self.gate.n_variants, handshake=handshake, ceiling=self.pre.ceiling, **extra)

    def metric_rec(self, m: Any, per_arm: dict[str, list[Block]]) -> SpeedMetric:
        """One metric's entry: its slot, the frontier read at preflight, the reference's baseline slot, every
        arm's blocks (outputs unchecked)."""
        t = self.ctx.target
        slot = t.slot(t.candidate_engine, m)
        s = self.history.frontier_slot(slot)  # verified at preflight against the ledger and its receipt
        # the lock as loaded when the round started, before any candidate process ran; the drift rule it feeds
        # (scoreboard.tiers) can only withhold a tier, never grant one
        base = self.ctx.lock.slots.get(t.slot(t.reference_engine, m))
        return SpeedMetric(phase=m.phase, depth=m.depth, n_tokens=m.n_tokens, role=m.role, slot=slot,
                           frontier=s.value if s else 0.0, baseline=base.value if base else 0.0,
                           arms={a: ArmRec(blocks=bs) for a, bs in per_arm.items()}, timed_output_ok=True)

    def check(self, speed: SpeedRec) -> SpeedRec:
        """The measured section with its checks recorded: the timed outputs (check_outputs) and every
        candidate-side arm's fastest reps against the physical ceiling."""
        metrics = []
        for entry, var in zip(speed.metrics, self.gate.variants):
            arms, timed_ok, dev = self.check_outputs(entry, var)
            reasons = []
            for arm in self.arms:
                if arm.is_reference:
                    continue
                why = implausible_arm(self.pre.ceiling, entry, arm.name)
                if why:
                    arms[arm.name] = arms[arm.name].model_copy(update={"implausible": why})
                    reasons.append(f"{arm.name}: {why}")
            metrics.append(entry.model_copy(update={"arms": arms, "timed_output_ok": timed_ok,
                                                    "timed_logprob_dev": dev, "plausible": not reasons}))
        return speed.model_copy(update={"metrics": metrics})

    def check_outputs(self, entry: SpeedMetric, var: Variants) -> tuple[dict[str, ArmRec], bool, float | None]:
        """(the metric's arms with their output checks, whether the candidate's timed outputs equal the gate's
        checked output of each rep's variant, the largest deviation of a timed rep's log-probs from the checked
        run's). The candidate's timed reps must reproduce both the checked ids and, within speed.logprob_tol nats,
        the checked log-probs: a path taken only when timed (an expert dropped, a cache reused) moves the log-probs
        even where the greedy ids agree. Another harness-clocked arm (main, frontier: other commits, not graded by
        this round's gate) must give one output per variant in every block, and that output must pass the
        reference the way the gate grades the candidate's (teacher-forced top-1 for decode, the reference's next
        token for prefill; an output equal to the candidate's already-graded one is not graded again)."""
        want = self.gate.checked[var.key]
        arms = dict(entry.arms)
        timed_ok = entry.timed_output_ok
        dev: float | None = None
        for arm in self.arms:
            if arm.is_reference:
                continue
            blocks = entry.arms[arm.name].blocks
            if arm.name == "candidate":
                timed_ok = all(ids == want[v] for b in blocks for v, ids in zip(b.variants or [], b.token_ids or []))
                dev = self.logprob_deviation(blocks, var)
                timed_ok = timed_ok and dev is not None and dev <= self.ctx.target.speed.logprob_tol
                continue
            arms[arm.name] = arms[arm.name].model_copy(update={"output_check": self.output_check(blocks, var, want)})
        return arms, timed_ok, dev

    def logprob_deviation(self, blocks: list[Block], var: Variants) -> float | None:
        """The largest |timed - checked| log-prob over every timed rep of the candidate (None: a rep, or the
        checked run, carried none: nothing to hold the timed path to, which fails the check)."""
        want = self.gate.checked_lp.get(var.key)
        if not want:
            return None
        worst = 0.0
        for b in blocks:
            for v, lps in zip(b.variants or [], b.logprobs or [None] * len(b.samples_ns)):
                if lps is None or len(lps) != len(want[v]):
                    return None
                worst = max(worst, float(np.max(np.abs(np.asarray(lps) - np.asarray(want[v])))))
        return worst

    def output_check(self, blocks: list[Block], var: Variants, want: list[list[int]]) -> OutputCheck:
        """A same-round arm's timed outputs, each distinct one graded against the reference. Outputs that vary
        across blocks while each passes are a note (that commit is not deterministic on this box: it still
        did the workload correctly every time); any output that fails the reference fails the check."""
        seen = distinct_outputs(blocks)
        notes = [f"variant {v} gave {len(outs)} different outputs across blocks"
                 for v, outs in sorted(seen.items()) if len(outs) > 1]
        reasons = []
        graded = 0
        for v, outs in sorted(seen.items()):
            for k, out in enumerate(outs):
                graded += list(out) != want[v]
                if not self.gate.grade_output(var, v, list(out)):
                    which = f" (output {k + 1} of {len(outs)})" if len(outs) > 1 else ""
                    reasons.append(f"variant {v}{which}: the timed output fails the reference check")
        return OutputCheck(ok=not reasons, reasons=reasons, graded_by_reference=graded, notes=notes)

    def null_handshake(self) -> HandshakeRec:
        """The harness's null engine through the same launch and handshake: what a rep costs with no work."""
        from ..worker.nullengine import NAME, expected_output

        var = next((v for v in self.gate.variants if v.workload.phase == "decode"), self.gate.variants[0])
        n = self.gate.n_variants
        plan = SessionPlan([var.workload], [[(v, var.reveals[v]) for v in range(n)]], warmup=0)
        empty = Path(self.ctx.cache_dir) / "import-shims" / "null"  # no candidate code on its import path
        (empty / "engines").mkdir(parents=True, exist_ok=True)
        run = self.arm("candidate").worker().call(TimedOp.of([var.workload], [n]),
                                                  session=lambda ch: run_session(ch, plan), root=empty,
                                                  harness_engine="null")
        reps = run.session[0]
        bad = [x.variant for x in reps if x.token_ids != expected_output(var.workload, var.reveals[x.variant])]
        if bad:
            raise EngineError(f"the harness's null engine answered variants {bad} wrongly", "report this harness bug")
        ns = sorted(x.ns for x in reps)
        mid = len(ns) // 2
        return HandshakeRec(engine=NAME, metric=var.key, reps=len(ns), round_trip_ns=[x.ns for x in reps],
                            median_ns=int(ns[mid]) if len(ns) % 2 else int((ns[mid - 1] + ns[mid]) // 2),
                            max_ns=int(ns[-1]), wall_ns=run.wall_ns)
