"""The round's stages: preflight (pins, weights, config, fit, builds), the gate, interleaved speed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import environment, registry
from ..engine import Engine, LogitsRequest, Prepared, Workload
from ..errors import EngineError, InputError
from ..gate import GateResult, gate_positions, grade_depth
from .clock import SessionPlan, run_session
from .candidate import import_root
from .prompt import Prompt, draw_prompt
from .reveal import Variants, block_order, metric_variants
from .schedule import balanced_schedule
from .launch import WorkerRun, run_worker
from ..worker.protocol import CheckedRun, GateOp, LogitsRows, TimedOp, WorkerOp

if TYPE_CHECKING:
    from .run import Round


@dataclass
class PreflightResult:
    shards: list[Path]
    ref_engine: Engine
    ref_prepared: Prepared
    config: Any
    fit: Any
    ceiling: dict[str, Any] | None = None  # scoreboard.ceiling: the decode-rate bound, or None


def _ceiling(rnd: "Round", shards: list[Path], config: Any) -> dict[str, Any] | None:
    """The decode-rate ceiling from the weights just re-hashed (before any candidate code ran, so the
    candidate could not have touched the tensor sizes it is computed from) and the node class."""
    from ..ceiling import decode_ceiling

    t = rnd.target
    bw = rnd.lock.nodes[t.node].memory_bandwidth_gbs
    if bw is None:
        return None
    devices = t.parallel.ranks if t.device == "cuda" else 1
    return decode_ceiling(shards, config, bw, devices).as_dict()


def preflight(rnd: "Round") -> PreflightResult:
    """Refuse rather than run something else: node class, weights, model config, fit, reference build."""
    from ..fit import check_fit, fit_budget
    from ..models.k3 import load_k3_config

    t, lock, r = rnd.target, rnd.lock, rnd.receipt
    fp = environment.fingerprint()
    par = t.parallel
    fp["parallel"] = {"ranks": par.ranks, "backend": par.backend_for(t.device),
                      "launcher": "torchrun --standalone" if par.ranks > 1 else "one process",
                      "reference_split_mode": par.reference_split_mode,
                      "visible_devices": rnd.device_env().get("CUDA_VISIBLE_DEVICES", "")}
    r["environment"] = fp
    fp["isolation"] = isolation_record(rnd)  # refuses a missing/broken sandbox before any engine runs
    bad = environment.node_mismatches(fp, lock.nodes[t.node])
    if bad and not rnd.opts.allow_node_mismatch:
        raise InputError(f"this box is not of node class {t.node!r} that target {rnd.target_id!r} is measured on:\n  "
                         + "\n  ".join(bad), f"run `scoreboard env --target {rnd.target_id}` and use a matching box")
    weights = lock.weights[t.weights]
    rnd.report("step", message=f"verifying {len(weights.files)} weight shard(s) of {t.weights}")
    shards = _weights(rnd, t.weights)
    r["weights"] = {"id": t.weights, "fully_pinned": weights.fully_pinned,
                    "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in weights.files]}
    rnd.report("step", message="model config checks")
    config = load_k3_config(shards[0])
    fit = check_fit(fit_budget(lock, rnd.target_id, weights_dir=shards[0].parent))
    rnd.report("step", message=f"fit: {fit.summary()}")
    fp["fit"] = {"ranks": fit.ranks, "need_gib_per_rank": round(fit.need_gib, 4), "usable_gib": fit.usable_gib,
                 "lines": {x.item: round(x.gib, 4) for x in fit.lines}}
    rnd.pre = PreflightResult(shards, registry.load(t.reference_engine), None, config, fit)  # type: ignore[arg-type]
    rnd.pre.ceiling = _ceiling(rnd, shards, config)
    ref_target = rnd.reference_target()
    rnd.report("step", message=f"preparing reference {t.reference_engine} at its pin (build re-verified)")
    ref_prepared = rnd.pre.ref_engine.prepare(ref_target, rnd.opts.cache_dir,
                                              lambda msg, frac=None: rnd.report("step", message=msg))
    rnd.pre.ref_prepared = ref_prepared
    identity = ref_prepared.identity.as_dict()
    r["reference"] = {"engine": t.reference_engine, "identity": identity}
    if (identity.get("extra") or {}).get("build_key"):  # a built reference: its files against sealed history
        from .evidence import check_reference_build

        rnd.report("step", message="reference build files against the latest sealed receipt for its build key")
        check_reference_build(identity, rnd.opts.rounds_dir, renew=rnd.opts.renew_reference_anchor)
    return rnd.pre


def isolation_record(rnd: "Round") -> dict[str, Any]:
    """environment.isolation: the sandbox the candidate's workers run in (sandbox.check) and where each arm's
    code comes from (a git arm: a clean export of its commit; a path: a development tree)."""
    from .sandbox import check

    rec = check(rnd.opts.isolation)
    arms = {"candidate": rnd.source}
    if rnd.main_source is not None:
        arms["main"] = rnd.main_source
    if rnd.frontier_source is not None:
        arms["frontier"] = rnd.frontier_source
    rec["arms"] = {name: {"kind": s.kind, "commit": s.commit, "engines_tree": s.engines_tree,
                          "source": "git archive export" if s.kind == "git" else "development tree"}
                   for name, s in arms.items()}
    return rec


def _weights(rnd: "Round", weights_id: str) -> list[Path]:
    """Every shard re-hashed against the lock (generated weights are generated first if absent)."""
    from ..weights.verify import ensure_generated, verify_weights, weights_dir

    w = rnd.lock.weights[weights_id]
    cache = rnd.opts.cache_dir
    if w.repo == "generated":
        return ensure_generated(rnd.lock, weights_id, cache)
    return verify_weights(rnd.lock, weights_id, weights_dir(weights_id, cache)).paths


def _side(rnd: "Round", source, identity: dict[str, Any]) -> dict[str, Any]:
    return {"engine": rnd.target.candidate_engine, "label": source.label, "commit": source.commit,
            "dirty": source.dirty, "is_main": source.is_main, "identity": identity}


class GateStage:
    """Logits from both engines at every gate depth (incl. the scored depth), graded in float64."""

    def __init__(self, rnd: "Round"):
        self.rnd = rnd
        t = rnd.target
        need = max([max(t.gate.depths)] + [m.depth + m.n_tokens for m in t.metrics])
        from ..weights.tokenizer import Tokenizer

        tok = self.tokenizer = Tokenizer.from_gguf(rnd.pre.shards[0])
        self.need = need
        self.prompt: Prompt = self.draw(rnd.seed)
        # V secret variants per metric: every timed launch reveals each once (warm-up reps included)
        self.n_variants = t.speed.warmup_reps + (rnd.opts.reps or t.speed.reps)
        try:
            self.variants: list[Variants] = [
                metric_variants(tok, self.prompt.token_ids, m.phase, m.depth, m.n_tokens, self.n_variants, rnd.seed)
                for m in t.metrics]
        except ValueError as exc:
            raise InputError(f"targets.{rnd.target_id}.metrics: {exc}",
                             "decode metrics need depth >= 1 (the token at depth-1 is revealed when the clock starts)"
                             ) from None
        self.checked: dict[str, list[list[int]]] = {}  # metric -> the checked output of each variant
        self.ref_next: dict[str, list[int]] = {}  # prefill metric -> the reference's next token per variant
        self.graded: dict[tuple[str, int, tuple[int, ...]], bool] = {}  # (metric, variant, output) -> vs reference

    def draw(self, seed: int) -> Prompt:
        """The gate's prompt for a seed: the round draws one; a calibration draws one per seed."""
        return draw_prompt(self.tokenizer, self.need, seed)

    def rows(self, prompt: Prompt) -> tuple[dict[int, list[int]], list[int], tuple[int, ...]]:
        """(gate positions per depth, every position sorted, the token ids both engines get) for a prompt."""
        pol = self.rnd.target.gate
        per_depth = {d: gate_positions(d, pol.rows_per_depth) for d in pol.depths}
        positions = sorted({p for ps in per_depth.values() for p in ps})
        geom = self.rnd.engine_target().geometry
        ids = padded(prompt.token_ids[: max(pol.depths)], geom.n_ubatch, geom.n_ctx, prompt.token_ids)
        return per_depth, positions, ids

    def grade(self, per_depth: dict[int, list[int]], positions: list[int], ref: np.ndarray, cand: np.ndarray,
              baselines: dict[int, float] | None = None) -> GateResult:
        """Every gate depth's rows graded against the bars (and the ratchet, when baselines are given)."""
        if cand.shape != ref.shape:
            raise EngineError(f"candidate logits have shape {cand.shape}, reference {ref.shape}",
                              "the candidate must return one row per requested position over the full vocabulary")
        row = {p: i for i, p in enumerate(positions)}
        pol = self.rnd.target.gate
        depths = []
        for d, ps in per_depth.items():
            sel = [row[p] for p in ps]
            depths.append(grade_depth(d, ps, ref[sel], cand[sel], pol, (baselines or {}).get(d)))
        return GateResult(depths)

    def candidate_call(self, op: WorkerOp, source=None, session=None, root: Path | None = None, target=None,
                       timeout_s: float | None = None, harness_engine: str | None = None) -> WorkerRun:
        """One fresh worker of the candidate engine (`target`: the candidate's, unless a calibration
        asks for a variant of it: another precision, an injected fault, several prompts in one launch)."""
        rnd = self.rnd
        source = source or rnd.source
        res = run_worker(rnd.target.candidate_engine, root or import_root(source, rnd.opts.cache_dir),
                         target or rnd.candidate_target(), rnd.opts.cache_dir, op,
                         timeout_s or rnd.target.speed.timeout_s, workdir=rnd.scratch, env=rnd.device_env(),
                         session=session, isolation=rnd.opts.isolation, harness_engine=harness_engine)
        iso = rnd.receipt["environment"].get("isolation")
        if iso is not None and res.isolation and res.isolation.get("binds") and "binds" not in iso:
            from .sandbox import receipt_binds

            iso["binds"] = receipt_binds(res.isolation)
        base = res.base_command
        if base + [f"<{op.kind}>"] not in rnd.receipt["commands"]:
            rnd.receipt["commands"].append(base + [f"<{op.kind}>"])
        if res.result.ranks is not None:
            self.check_ranks(res.result.ranks)
        self.record_peaks([p.as_dict() for p in res.result.peak_memory])
        return res

    def record_peaks(self, peaks: list[dict[str, Any]]) -> None:
        """environment.peak_memory: per rank, the largest peak any candidate launch reached, next to the
        fit check's prediction (environment.fit) — measured against predicted, every round."""
        env = self.rnd.receipt["environment"]
        have = {p["rank"]: p for p in env.get("peak_memory", [])}
        for p in peaks:
            old = have.get(p["rank"])
            if old is None:
                have[p["rank"]] = dict(p)
                continue
            for key in ("host_rss_gib", "device_gib"):
                if p.get(key) is not None and (old.get(key) is None or p[key] > old[key]):
                    old[key] = p[key]
        env["peak_memory"] = [have[k] for k in sorted(have)]

    def check_ranks(self, fps: list[dict[str, Any]]) -> None:
        """Every rank's fingerprint: recorded (first launch), checked against the node class (every launch)."""
        from ..worker.distributed import rank_problems

        rnd, t = self.rnd, self.rnd.target
        node = rnd.lock.nodes[t.node]
        bad = rank_problems(fps, t.parallel.ranks, t.device, node.gpu_model)
        for fp in fps:
            bad += [f"rank {fp['rank']['rank']}: {p}" for p in environment.node_mismatches(fp, node)]
        if bad and not rnd.opts.allow_node_mismatch:
            raise InputError(f"the candidate's {t.parallel.ranks} ranks are not a {t.node!r} world:\n  "
                             + "\n  ".join(bad), f"run `scoreboard env --target {rnd.target_id}` and use a matching box")
        env = rnd.receipt["environment"]
        if "ranks" not in env:
            env["ranks"] = fps
            env["rank_problems"] = bad

    def run(self) -> None:
        rnd, t, r = self.rnd, self.rnd.target, self.rnd.receipt
        pol = t.gate
        per_depth, positions, ids = self.rows(self.prompt)
        geom = rnd.engine_target().geometry
        rnd.report("step", message=f"reference logits: {len(positions)} rows at depths {list(pol.depths)}")
        ref = rnd.pre.ref_engine.logits(rnd.pre.ref_prepared, LogitsRequest(ids, tuple(positions), geom))
        if ref.command:
            r["commands"].append(ref.command)
        rnd.report("step", message=f"candidate logits and its checked outputs for {self.n_variants} secret "
                                   "variants per metric (fresh worker process)")
        res = self.candidate_call(gate_op(ids, positions, self.variants)).result
        r["candidate"] = _side(rnd, rnd.source, res.identity)
        if rnd.main_source is not None:
            r["main"] = _side(rnd, rnd.main_source, {})
        cand = np.load(res.logits[0].path)
        # the ratchet basis was read and seal-checked at preflight, before this candidate's process ran
        # (which may have hidden or rewritten rounds/ since): never re-read here
        baselines = rnd.history.ratchet_baselines()
        result = self.grade(per_depth, positions, ref.logits, cand, baselines)
        gate = result.as_dict()
        gate["prompt"] = self.prompt.describe()
        gate["ratchet_round"] = rnd.history.ratchet.round_id if rnd.history.ratchet else None
        gate["geometry"] = ref.geometry.as_dict()
        # the checked outputs, one per secret variant, graded against the reference; every timed rep must
        # reproduce its variant's
        rnd.report("step", message="checked outputs against the reference (each timed rep must reproduce its variant's)")
        outputs = res.checked
        if not isinstance(outputs, list) or len(outputs) != len(self.variants):
            raise EngineError("the gate worker returned no checked outputs for the metrics' variants")
        gate["checked"], gate["greedy_check"], gate["prefill_check"] = {}, [], []
        for var, outs in zip(self.variants, outputs):
            w = var.workload
            if len(outs) != len(var.reveals) or any(len(o) != w.output_len for o in outs):
                raise EngineError(f"{var.key}: the checked run returned {[len(o) for o in outs]} ids per variant, "
                                  f"the contract wants {w.output_len} for each of {len(var.reveals)}",
                                  "decode returns n_tokens ids, prefill one (the next token)")
            self.checked[var.key] = [list(map(int, o)) for o in outs]
            gate["checked"][var.key] = {**var.describe(), "outputs": self.checked[var.key]}
            if w.phase == "decode":
                agrees = [self.greedy_agreement(var, v, o) for v, o in enumerate(outs)]
                for v, (o, agree) in enumerate(zip(outs, agrees)):
                    ok = agree >= pol.top1_min
                    self.graded[(var.key, v, tuple(o))] = ok
                    gate["greedy_check"].append({"metric": var.key, "variant": v, "top1_vs_reference": agree,
                                                 "pass": ok})
                    if not ok:
                        gate["pass"] = False
                        gate["reasons"].append(f"{var.key} variant {v}: the decode path's greedy tokens agree with "
                                               f"the reference's argmax on only {agree:.3f} of positions < top1_min "
                                               f"{pol.top1_min}")
            else:
                self.ref_next[var.key] = [self.reference_next(var, v) for v in range(len(var.reveals))]
                hits = [o[0] == want for o, want in zip(outs, self.ref_next[var.key])]
                for v, (o, hit) in enumerate(zip(outs, hits)):
                    self.graded[(var.key, v, tuple(o))] = hit
                    gate["prefill_check"].append({"metric": var.key, "variant": v, "token": o[0],
                                                  "reference_token": self.ref_next[var.key][v], "pass": hit})
                frac = float(np.mean(hits))
                if frac < pol.top1_min:
                    gate["pass"] = False
                    gate["reasons"].append(f"{var.key}: the prefill path's next token matches the reference's argmax "
                                           f"on {frac:.3f} of variants < top1_min {pol.top1_min}")
        distinct = {k: len({tuple(o) for o in outs}) for k, outs in self.checked.items()}
        gate["checked_distinct"] = distinct  # variants whose outputs coincide could be answered by a replay
        r["gate"] = gate

    def greedy_agreement(self, var: Variants, v: int, toks: list[int]) -> float:
        """Teacher-force variant v's greedy tokens through the reference: fraction of argmax matches."""
        rnd = self.rnd
        geom = rnd.engine_target().geometry
        depth = var.workload.depth
        seq = var.full_prompt(v) + tuple(toks[:-1])
        pos = tuple(range(depth - 1, depth - 1 + len(toks)))
        seq = padded(seq, geom.n_ubatch, geom.n_ctx, tuple(self.prompt.token_ids))
        ref = rnd.pre.ref_engine.logits(rnd.pre.ref_prepared, LogitsRequest(seq, pos, geom))
        return float(np.mean(np.argmax(ref.logits, axis=-1) == np.asarray(toks)))

    def reference_next(self, var: Variants, v: int) -> int:
        """The reference's greedy next token after prefill variant v's whole prompt."""
        rnd = self.rnd
        geom = rnd.engine_target().geometry
        seq = var.full_prompt(v)
        last = len(seq) - 1
        seq = padded(seq, geom.n_ubatch, geom.n_ctx, tuple(self.prompt.token_ids))
        ref = rnd.pre.ref_engine.logits(rnd.pre.ref_prepared, LogitsRequest(seq, (last,), geom))
        return int(np.argmax(ref.logits[0]))

    def grade_output(self, var: Variants, v: int, out: list[int]) -> bool:
        """An arm's output for variant v graded against the reference (cached per output): decode by
        teacher-forced top-1 agreement >= top1_min, prefill by equality with the reference's next token."""
        key = (var.key, v, tuple(out))
        if key not in self.graded:
            if var.workload.phase == "decode":
                self.graded[key] = self.greedy_agreement(var, v, out) >= self.rnd.target.gate.top1_min
            else:
                self.graded[key] = out[0] == self.ref_next[var.key][v]
        return self.graded[key]


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


def implausible_arm(ceiling: dict[str, Any] | None, entry: dict[str, Any], arm: str) -> str | None:
    """Why an arm's fastest timed rep of this metric is above the physical ceiling (None: it is not)."""
    from ..ceiling import implausible

    samples = [x for b in entry["arms"][arm]["blocks"] for x in b.get("samples_ns", [])]
    return implausible(ceiling, entry["phase"], int(entry["n_tokens"]), samples)


class SpeedStage:
    """Warm-up, then randomized balanced blocks; each harness-clocked block is a fresh worker process timed
    by the parent's clock around the reveal handshake."""

    def __init__(self, rnd: "Round", gate: GateStage):
        self.rnd, self.gate = rnd, gate
        t = rnd.target
        self.blocks = rnd.opts.blocks or t.speed.blocks
        self.reps = rnd.opts.reps or t.speed.reps
        # "main": a PR round's main; "frontier": a main round's re-measured frontier commit (from the
        # history verified at preflight). Both are built and run exactly like the candidate.
        self.sources = {"candidate": rnd.source, "main": rnd.main_source, "frontier": rnd.frontier_source}
        self.arms = ["reference", "candidate"] + [a for a in ("main", "frontier") if self.sources[a] is not None]

    def arm_source(self, arm: str):
        """The source tree a harness-clocked arm runs: the candidate's, or the round's `<arm>_source`
        ("main", "frontier"): every such arm is launched, timed and checked the same way."""
        return self.rnd.source if arm == "candidate" else getattr(self.rnd, f"{arm}_source")

    def run(self) -> None:
        rnd, t, r = self.rnd, self.rnd.target, self.rnd.receipt
        if self.blocks < 2:
            raise InputError(f"--blocks {self.blocks}: at least 2 blocks are needed for a paired CI")
        variants = self.gate.variants
        schedule = balanced_schedule(self.arms, self.blocks, rnd.seed)
        metrics = []
        for m, var in zip(t.metrics, variants):
            slot = t.slot(t.candidate_engine, m)
            s = rnd.history.frontier_slot(slot)  # verified at preflight against the ledger and its receipt
            metrics.append({"phase": m.phase, "depth": m.depth, "n_tokens": m.n_tokens, "role": m.role,
                            "slot": slot, "frontier": s.value if s else 0.0,
                            "arms": {a: {"blocks": []} for a in self.arms}, "timed_output_ok": True})
        ceiling = rnd.pre.ceiling
        speed = {"schedule": schedule, "metrics": metrics, "blocks": self.blocks, "reps": self.reps,
                 "warmup_reps": t.speed.warmup_reps, "clock": "parent-handshake", "n_variants": self.gate.n_variants,
                 "handshake": None, "ceiling": ceiling}
        rnd.report("step", message=f"handshake cost: the harness's null engine, {self.gate.n_variants} reps")
        speed["handshake"] = self.null_handshake()
        rnd.report("step", message=f"warm-up: one discarded pass of {', '.join(self.arms)}")
        for arm in self.arms:
            self.run_arm(arm, variants, reps=1, block=None)
        total = len(schedule) * len(self.arms)
        done = 0
        for b, order in enumerate(schedule):
            for arm in order:
                rnd.report("progress", task="speed blocks", done=done, total=total, message=f"block {b}: {arm}")
                for entry, rec in zip(metrics, self.run_arm(arm, variants, self.reps, b)):
                    entry["arms"][arm]["blocks"].append(rec)
                done += 1
        rnd.report("progress", task="speed blocks", done=total, total=total, message="done")
        r["speed"] = speed  # measured: recorded before any check below can fail
        fs = rnd.history.scored_frontier
        if rnd.frontier_source is not None and fs is not None:
            r["speed"]["frontier_arm"] = {"commit": rnd.frontier_source.commit, "slot": fs.slot,
                                          "slot_value": fs.value, "round_id": fs.round_id}
        self.check_outputs(metrics, variants)
        for entry in metrics:
            reasons = []
            for arm in self.arms:
                if arm == "reference":
                    continue
                why = implausible_arm(ceiling, entry, arm)
                if why:
                    entry["arms"][arm]["implausible"] = why
                    reasons.append(f"{arm}: {why}")
            entry["plausible"] = not reasons

    def check_outputs(self, metrics: list[dict[str, Any]], variants: list[Variants]) -> None:
        """The candidate's timed outputs must equal the gate's checked output of each rep's variant. Another
        harness-clocked arm (main, frontier: other commits, not graded by this round's gate) must give one
        output per variant in every block, and that output must pass the reference the way the gate grades
        the candidate's (teacher-forced top-1 for decode, the reference's next token for prefill; an output
        equal to the candidate's already-graded one is not graded again)."""
        for entry, var in zip(metrics, variants):
            want = self.gate.checked[var.key]
            for arm in self.arms:
                if arm == "reference":
                    continue
                blocks = entry["arms"][arm]["blocks"]
                if arm == "candidate":
                    entry["timed_output_ok"] = all(ids == want[v] for b in blocks
                                                   for v, ids in zip(b["variants"], b["token_ids"]))
                    continue
                seen: dict[int, set[tuple[int, ...]]] = {}
                for b in blocks:
                    for v, ids in zip(b["variants"], b["token_ids"]):
                        seen.setdefault(v, set()).add(tuple(ids))
                reasons = [f"variant {v} gave {len(outs)} different outputs across blocks"
                           for v, outs in sorted(seen.items()) if len(outs) > 1]
                graded = 0
                for v, outs in sorted(seen.items()):
                    if len(outs) != 1:
                        continue
                    out = list(next(iter(outs)))
                    graded += out != want[v]
                    if not self.gate.grade_output(var, v, out):
                        reasons.append(f"variant {v}: the timed output fails the reference check")
                entry["arms"][arm]["output_check"] = {"ok": not reasons, "reasons": reasons,
                                                      "graded_by_reference": graded}

    def null_handshake(self) -> dict[str, Any]:
        """The harness's null engine through the same launch and handshake: what a rep costs with no work."""
        from ..worker.nullengine import NAME, expected_output

        rnd = self.rnd
        var = next((v for v in self.gate.variants if v.workload.phase == "decode"), self.gate.variants[0])
        n = self.gate.n_variants
        plan = SessionPlan([var.workload], [[(v, var.reveals[v]) for v in range(n)]], warmup=0)
        empty = Path(rnd.opts.cache_dir) / "import-shims" / "null"  # no candidate code on its import path
        (empty / "engines").mkdir(parents=True, exist_ok=True)
        run = self.gate.candidate_call(TimedOp.of([var.workload], [n]), session=lambda ch: run_session(ch, plan),
                                       root=empty, harness_engine="null")
        reps = run.session[0]
        bad = [x.variant for x in reps if x.token_ids != expected_output(var.workload, var.reveals[x.variant])]
        if bad:
            raise EngineError(f"the harness's null engine answered variants {bad} wrongly", "report this harness bug")
        ns = sorted(x.ns for x in reps)
        return {"engine": NAME, "metric": var.key, "reps": len(ns), "round_trip_ns": [x.ns for x in reps],
                "median_ns": int(ns[len(ns) // 2]) if len(ns) % 2 else int((ns[len(ns) // 2 - 1] + ns[len(ns) // 2]) // 2),
                "max_ns": int(ns[-1]), "wall_ns": run.wall_ns}

    def run_arm(self, arm: str, variants: list[Variants], reps: int, block: int | None) -> list[dict[str, Any]]:
        if arm == "reference":
            return [self.reference_block(v.workload, reps, block) for v in variants]
        rnd = self.rnd
        warmup = rnd.target.speed.warmup_reps
        n = warmup + reps
        orders = [block_order(rnd.seed, arm, block, v.key, len(v.reveals), n) for v in variants]
        plan = SessionPlan([v.workload for v in variants],
                           [[(i, v.reveals[i]) for i in order] for v, order in zip(variants, orders)], warmup)
        run = self.gate.candidate_call(TimedOp.of([v.workload for v in variants], [n] * len(variants)),
                                       source=self.arm_source(arm), session=lambda ch: run_session(ch, plan))
        wall = int(run.wall_ns)
        runs = run.session
        total = sum(x.ns for reps_ in runs for x in reps_)
        if total > wall:  # both readings are the parent's: only a harness bug could break this
            raise EngineError(f"{arm}: {total} ns of timed reps inside {wall} ns of launch wall clock",
                              "report this harness bug")
        out = []
        for var, reps_ in zip(variants, runs):
            out.append({"block": block if block is not None else -1, "samples_ns": [x.ns for x in reps_],
                        "n_tokens": [var.workload.n_tokens for _ in reps_], "token_ids": [x.token_ids for x in reps_],
                        "variants": [x.variant for x in reps_], "worker_ns": [x.worker_ns for x in reps_],
                        "wall_ns": wall, "command": run.base_command, "clock": "harness"})
        return out

    def reference_block(self, w: Workload, reps: int, block: int | None) -> dict[str, Any]:
        import time

        rnd = self.rnd
        t0 = time.perf_counter_ns()
        out = rnd.pre.ref_engine.timed(rnd.pre.ref_prepared, w, reps)
        wall = time.perf_counter_ns() - t0
        total = sum(x.ns for x in out)
        if total > wall:
            raise EngineError(f"reference reported {total} ns of reps inside {wall} ns of wall clock",
                              "the reference tool's self-report exceeds the harness's wall-clock bound")
        if out and out[0].command and out[0].command not in rnd.receipt["commands"]:
            rnd.receipt["commands"].append(out[0].command)
        return {"block": block if block is not None else -1, "samples_ns": [x.ns for x in out],
                "n_tokens": [x.n_tokens for x in out], "wall_ns": wall, "command": out[0].command if out else [],
                "clock": "reference-tool"}
