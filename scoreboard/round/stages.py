"""The round's stages: preflight (pins, weights, config, fit, builds), the gate, interleaved speed."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import environment, registry
from ..engine import Engine, LogitsRequest, Prepared, Workload
from ..errors import EngineError, InputError
from ..gate import GateResult, gate_positions, grade_depth
from .candidate import import_root
from .prompt import Prompt, draw_prompt
from .schedule import balanced_schedule
from .workers import run_worker

if TYPE_CHECKING:
    from .run import Round


@dataclass
class PreflightResult:
    shards: list[Path]
    ref_engine: Engine
    ref_prepared: Prepared
    config: Any
    fit: Any


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
    ref_target = rnd.reference_target()
    rnd.report("step", message=f"preparing reference {t.reference_engine} at its pin (build re-verified)")
    ref_prepared = rnd.pre.ref_engine.prepare(ref_target, rnd.opts.cache_dir,
                                              lambda msg, frac=None: rnd.report("step", message=msg))
    rnd.pre.ref_prepared = ref_prepared
    r["reference"] = {"engine": t.reference_engine, "identity": ref_prepared.identity.as_dict()}
    return rnd.pre


def isolation_record(rnd: "Round") -> dict[str, Any]:
    """environment.isolation: the sandbox the candidate's workers run in (sandbox.check) and where each arm's
    code comes from (a git arm: a clean export of its commit; a path: a development tree)."""
    from .sandbox import check

    rec = check(rnd.opts.isolation)
    arms = {"candidate": rnd.source}
    if rnd.main_source is not None:
        arms["main"] = rnd.main_source
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
        self.decode_metrics = [m for m in t.metrics if m.phase == "decode"]
        need = max([max(t.gate.depths)] + [m.depth + m.n_tokens for m in t.metrics])
        from ..weights.tokenizer import Tokenizer

        tok = Tokenizer.from_gguf(rnd.pre.shards[0])
        self.prompt: Prompt = draw_prompt(tok, need, rnd.seed)
        self.greedy: dict[str, list[int]] = {}

    def workloads(self) -> list[Workload]:
        ids = self.prompt.token_ids
        return [Workload(m.phase, m.depth, m.n_tokens, ids[: m.depth + m.n_tokens]) for m in self.rnd.target.metrics]

    def candidate_call(self, op: str, payload: dict[str, Any], source=None) -> dict[str, Any]:
        rnd = self.rnd
        source = source or rnd.source
        res = run_worker(rnd.target.candidate_engine, import_root(source, rnd.opts.cache_dir),
                         rnd.candidate_target(), rnd.opts.cache_dir, op, payload, rnd.target.speed.timeout_s,
                         workdir=rnd.scratch, env=rnd.device_env(), isolation=rnd.opts.isolation)
        iso = rnd.receipt["environment"].get("isolation")
        if iso is not None and res.isolation and res.isolation.get("binds") and "binds" not in iso:
            from .sandbox import receipt_binds

            iso["binds"] = receipt_binds(res.isolation)
        base = [c for c in res.command if not c.endswith(".json")]  # the launch, without its scratch files
        if base + [f"<{op}>"] not in rnd.receipt["commands"]:
            rnd.receipt["commands"].append(base + [f"<{op}>"])
        if "ranks" in res.body:
            self.check_ranks(res.body["ranks"])
        self.record_peaks(res.body.get("peak_memory") or [])
        return {**res.body, "_wall_ns": res.wall_ns, "_command": base}

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
        from ..distributed import rank_problems

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
        per_depth = {d: gate_positions(d, pol.rows_per_depth) for d in pol.depths}
        positions = sorted({p for ps in per_depth.values() for p in ps})
        geom = rnd.engine_target().geometry
        ids = padded(self.prompt.token_ids[: max(pol.depths)], geom.n_ubatch, geom.n_ctx, self.prompt.token_ids)
        rnd.report("step", message=f"reference logits: {len(positions)} rows at depths {list(pol.depths)}")
        ref = rnd.pre.ref_engine.logits(rnd.pre.ref_prepared, LogitsRequest(ids, tuple(positions), geom))
        if ref.command:
            r["commands"].append(ref.command)
        decode = [w for w in self.workloads() if w.phase == "decode"]
        rnd.report("step", message="candidate logits and its checked greedy decode (fresh worker process)")
        body = self.candidate_call("gate", {"requests": [{"token_ids": list(ids), "positions": positions}],
                                            "workloads": [_wl(w) for w in decode]})
        r["candidate"] = _side(rnd, rnd.source, body["identity"])
        if rnd.main_source is not None:
            r["main"] = _side(rnd, rnd.main_source, {})
        cand = np.load(body["logits"][0]["path"])
        if cand.shape != ref.logits.shape:
            raise EngineError(f"candidate logits have shape {cand.shape}, reference {ref.logits.shape}",
                              "the candidate must return one row per requested position over the full vocabulary")
        row = {p: i for i, p in enumerate(positions)}
        baselines = ratchet_baselines(rnd.opts.rounds_dir, rnd.target_id)
        depths = []
        for d, ps in per_depth.items():
            sel = [row[p] for p in ps]
            depths.append(grade_depth(d, ps, ref.logits[sel], cand[sel], pol, baselines.get(d)))
        result = GateResult(depths)
        gate = result.as_dict()
        gate["prompt"] = self.prompt.describe()
        gate["geometry"] = ref.geometry.as_dict()
        # the checked run: greedy decode through the decode path, then graded against the reference
        rnd.report("step", message="checked greedy decode against the reference (the timed run must reproduce it)")
        greedy = body["greedy"]
        gate["greedy"] = {}
        gate["greedy_check"] = []
        for w, toks in zip(decode, greedy):
            key = f"decode@{w.depth}"
            gate["greedy"][key] = toks
            agree = self.greedy_agreement(w, toks)
            ok = agree >= pol.top1_min
            gate["greedy_check"].append({"metric": key, "top1_vs_reference": agree, "pass": ok})
            if not ok:
                gate["pass"] = False
                gate["reasons"].append(f"{key}: the decode path's greedy tokens agree with the reference's argmax "
                                       f"on only {agree:.3f} of positions < top1_min {pol.top1_min}")
        self.greedy = gate["greedy"]
        r["gate"] = gate

    def greedy_agreement(self, w: Workload, toks: list[int]) -> float:
        """Teacher-force the candidate's greedy tokens through the reference: fraction of argmax matches."""
        rnd = self.rnd
        geom = rnd.engine_target().geometry
        seq = tuple(w.prompt_ids[: w.depth]) + tuple(toks[:-1])
        pos = tuple(range(w.depth - 1, w.depth - 1 + len(toks)))
        seq = padded(seq, geom.n_ubatch, geom.n_ctx, tuple(self.prompt.token_ids))
        ref = rnd.pre.ref_engine.logits(rnd.pre.ref_prepared, LogitsRequest(seq, pos, geom))
        return float(np.mean(np.argmax(ref.logits, axis=-1) == np.asarray(toks)))


SHORT_UBATCH = 64  # llama.cpp takes a less precise KDA path for ubatches under 64 tokens (LLAMACPP.md)


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


def _wl(w: Workload) -> dict[str, Any]:
    return {"phase": w.phase, "depth": w.depth, "n_tokens": w.n_tokens, "prompt_ids": list(w.prompt_ids)}


def ratchet_baselines(rounds_dir: Path, target_id: str) -> dict[int, float]:
    """Per-depth mean KL of main's last sealed, gate-passing round for this target (ratchet basis)."""
    from ..ledger import read_ledger

    lines = read_ledger(rounds_dir)  # a broken chain is NonCompliant: never ratchet against tampered history
    for line in reversed(lines):
        if line.get("kind") != "round" or line.get("target") != target_id:
            continue
        path = Path(rounds_dir) / f"{line['round_id']}.json"
        if not path.exists():
            continue
        rec = json.loads(path.read_text())
        if rec.get("status") != "verdict" or not (rec.get("candidate") or {}).get("is_main"):
            continue
        gate = rec.get("gate") or {}
        if not gate.get("pass"):
            continue
        return {int(d["depth"]): float(d["kl_mean"]) for d in gate.get("depths", [])}
    return {}


class SpeedStage:
    """Warm-up, then randomized balanced blocks; each harness-clocked block is a fresh worker process."""

    def __init__(self, rnd: "Round", gate: GateStage):
        self.rnd, self.gate = rnd, gate
        t = rnd.target
        self.blocks = rnd.opts.blocks or t.speed.blocks
        self.reps = rnd.opts.reps or t.speed.reps
        self.arms = ["reference", "candidate"] + (["main"] if rnd.main_source is not None else [])

    def run(self) -> None:
        rnd, t, r = self.rnd, self.rnd.target, self.rnd.receipt
        if self.blocks < 2:
            raise InputError(f"--blocks {self.blocks}: at least 2 blocks are needed for a paired CI")
        workloads = self.gate.workloads()
        schedule = balanced_schedule(self.arms, self.blocks, rnd.seed)
        metrics = []
        for m, w in zip(t.metrics, workloads):
            slot = t.slot(t.candidate_engine, m)
            s = rnd.lock.slots.get(slot)
            metrics.append({"phase": m.phase, "depth": m.depth, "n_tokens": m.n_tokens, "role": m.role,
                            "slot": slot, "frontier": s.value if s else 0.0,
                            "arms": {a: {"blocks": []} for a in self.arms}, "timed_output_ok": True})
        rnd.report("step", message=f"warm-up: one discarded pass of {', '.join(self.arms)}")
        for arm in self.arms:
            self.run_arm(arm, workloads, reps=1, block=None)
        total = len(schedule) * len(self.arms)
        done = 0
        for b, order in enumerate(schedule):
            for arm in order:
                rnd.report("progress", task="speed blocks", done=done, total=total, message=f"block {b}: {arm}")
                for entry, rec in zip(metrics, self.run_arm(arm, workloads, self.reps, b)):
                    entry["arms"][arm]["blocks"].append(rec)
                done += 1
        rnd.report("progress", task="speed blocks", done=total, total=total, message="done")
        for entry in metrics:
            key = f"decode@{entry['depth']}"
            if entry["phase"] == "decode" and key in self.gate.greedy:
                want = self.gate.greedy[key]
                entry["timed_output_ok"] = all(ids == want for blk in entry["arms"]["candidate"]["blocks"]
                                               for ids in blk["token_ids"])
        r["speed"] = {"schedule": schedule, "metrics": metrics, "blocks": self.blocks, "reps": self.reps,
                      "warmup_reps": t.speed.warmup_reps}

    def run_arm(self, arm: str, workloads: list[Workload], reps: int, block: int | None) -> list[dict[str, Any]]:
        if arm == "reference":
            return [self.reference_block(w, reps, block) for w in workloads]
        source = self.rnd.source if arm == "candidate" else self.rnd.main_source
        body = self.gate.candidate_call("timed", {"workloads": [_wl(w) for w in workloads], "reps": reps,
                                                  "warmup": self.rnd.target.speed.warmup_reps}, source=source)
        wall = int(body["_wall_ns"])
        total = sum(x["ns"] for runs in body["runs"] for x in runs)
        if total > wall:
            raise EngineError(f"{arm} worker reported {total} ns of timed reps inside {wall} ns of wall clock",
                              "the worker's harness clock disagrees with the parent's wall clock")
        out = []
        for runs in body["runs"]:
            out.append({"block": block if block is not None else -1, "samples_ns": [x["ns"] for x in runs],
                        "n_tokens": [x["n_tokens"] for x in runs], "token_ids": [x["token_ids"] for x in runs],
                        "wall_ns": wall, "command": body["_command"],
                        "clock": "harness"})
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
