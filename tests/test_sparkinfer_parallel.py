"""Expert-parallel sparkinfer: the shard plan and its ownership check, rank-local loading, the fit priced
by the plan, and real gloo runs (2 and 4 CPU ranks, launched by the harness's torchrun path) against the
single-process engine and (slow) the pinned llama.cpp. The launcher's teardown is tests/test_parallel_round.py's.

Tolerance (every parallel run vs the single-process engine, both float32 on 1 thread per process):
max |logit diff| <= REL_TOL x max |logit| and per-row KL <= KL_TOL. Only the order of the routed-expert
sum differs (each rank sums its own experts, then all_reduce sums the ranks). Measured: k3-mini (top-2)
is bitwise identical with 2 and 4 ranks (at most two non-zero terms per token: any order is exact);
k3-mini-smooth (top-8, all experts) differs by <= 8.6e-6 relative (8.9e-5 abs), KL <= 2.2e-10 on the gate
prompt (1.2e-5 / 8.3e-10 seen on a 256-token prompt).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

import torch

from engines.sparkinfer.engine import SparkInferEngine, greedy_decode
from engines.sparkinfer.parallel import (
    Claim,
    ShardPlan,
    check_claims,
    check_ownership,
    is_sharded,
    load_rank_weights,
    plan_experts,
    plan_fit,
    rank_cache_bytes,
)
from engines.sparkinfer.weights import load_weights
from scoreboard.engine import EngineTarget, Geometry, LogitsRequest, Workload
from scoreboard.errors import EngineError, InputError
from scoreboard.fit import GIB, check_fit, fit_budget
from scoreboard.gate import gate_positions, grade_depth, kl_rows
from scoreboard.lockfile import load_lock
from scoreboard.models.k3 import K3Config, expected_tensors, load_k3_config
from scoreboard.round.prompt import draw_prompt
from scoreboard.weights.generate import generate
from scoreboard.weights.tokenizer import Tokenizer
from sparkinfer_ranks import ParallelJob, run_ranks

REPO = Path(__file__).resolve().parent.parent
TARGET = "k3-mini-cpu"
GEOM = Geometry(n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=1)  # the target's, 1 thread per process
REL_TOL = 1e-4  # max |diff| / max |logit|  (measured 0 on k3-mini, 1.2e-5 on k3-mini-smooth)
KL_TOL = 1e-8  # nats per row             (measured 0 on k3-mini, 8.3e-10 on k3-mini-smooth)
DECODE = (200, 6)  # greedy: depth, tokens
TIMED = (128, 8, 2, 1)  # timed decode: depth, tokens, reps, warmup
EXPERT_BYTES = 128 * 128 * 4  # one k3-mini expert of one tensor: [128, 128] f32


def target(shards) -> EngineTarget:
    return EngineTarget(TARGET, shards[0], tuple(shards), "cpu", GEOM)


@pytest.fixture(scope="module")
def lock():
    return load_lock(REPO / "reference.lock")


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[Path]:
    return generate("k3-mini", tmp_path_factory.mktemp("k3mini"))


@pytest.fixture(scope="module")
def cfg(shards):
    return load_k3_config(shards[0])


def k3_config() -> K3Config:
    """The flagship's shapes (K3's config): 93 layers (24 MLA), 7168 hidden, 896 experts x 3072 at latent 3584."""
    mla = set(range(3, 93, 4)) | {92}  # 24 MLA layers; which ones does not matter for sizes
    return K3Config(
        n_layer=93, n_embd=7168, n_vocab=163840, n_head=96, head_count_kv=tuple(int(i in mla) for i in range(93)),
        rms_norm_eps=1e-5, q_lora_rank=1536, kv_lora_rank=512, rope_dim=64, key_length_mla=192, value_length_mla=128,
        key_length=576, value_length=512, kda_head_dim=128, ssm_conv_kernel=4, kda_gate_lower_bound=-5.0,
        n_layer_dense_lead=1, dense_ff=33792, n_expert=896, n_expert_used=16, n_expert_shared=2, expert_ff=3072,
        expert_latent_length=3584, expert_weights_scale=1.0, expert_weights_norm=True, expert_gating_func=2,
        situ_beta=4.0, situ_linear_beta=25.0, attn_res_block_size=12)


# -- the plan ----------------------------------------------------------------------------------------

def test_bands_are_contiguous_balanced_and_cover_every_expert():
    assert plan_experts(8, 2).bands == ((0, 4), (4, 8))
    assert plan_experts(8, 4).bands == ((0, 2), (2, 4), (4, 6), (6, 8))
    assert plan_experts(8, 3).bands == ((0, 2), (2, 5), (5, 8))
    k3 = plan_experts(896, 8)
    assert all(hi - lo == 112 for lo, hi in k3.bands) and k3.owner(0) == 0 and k3.owner(895) == 7
    assert [k3.owner(e) for e in (111, 112, 447, 448)] == [0, 1, 3, 4]
    with pytest.raises(InputError, match="exceeds the 8 routed experts"):
        plan_experts(8, 9)
    with pytest.raises(InputError, match="at least one rank"):
        plan_experts(8, 0)


def test_only_routed_expert_tensors_are_sharded(cfg):
    sharded = sorted(n for n in cfg.tensor_shapes if is_sharded(n))
    assert len(sharded) == 3 * len(cfg.moe_layers) == 15
    assert all(n.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")) for n in sharded)
    # the router, its bias, the latent projections and the shared experts stay whole on every rank
    assert not any(is_sharded(f"blk.1.{k}") for k in ("ffn_gate_inp.weight", "exp_probs_b.bias",
                                                        "ffn_routed_down.weight", "ffn_gate_shexp.weight"))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_a_built_plan_owns_every_byte_exactly_once(cfg, world):
    table = check_ownership(plan_experts(8, world), cfg.tensor_shapes, cfg.tensor_types)
    assert len(table) == 15
    for claims in table.values():
        assert [c.rank for c in claims] == list(range(world))
        assert claims[0].lo == 0 and claims[-1].hi == 8
        assert all(a.hi == b.lo for a, b in itertools.pairwise(claims))


def test_a_gapped_plan_is_refused_naming_the_tensor_and_the_range(cfg):
    gapped = ShardPlan(2, 8, ((0, 3), (4, 8)))
    with pytest.raises(EngineError) as exc:
        check_ownership(gapped, cfg.tensor_shapes, cfg.tensor_types)
    msg = exc.value.message
    assert (f"blk.1.ffn_gate_exps.weight: gap: experts 3..3 (bytes {3 * EXPERT_BYTES}..{4 * EXPERT_BYTES - 1}) "
            "are owned by no rank") in msg
    assert "(+7 more)" in msg  # 15 tensors, each with the same gap; the first 8 are spelled out
    assert "plan_experts" in exc.value.hint


def test_an_overlapping_plan_is_refused_naming_both_ranks(cfg):
    with pytest.raises(EngineError) as exc:
        check_ownership(ShardPlan(2, 8, ((0, 5), (4, 8))), cfg.tensor_shapes)
    assert (f"blk.1.ffn_gate_exps.weight: overlap: experts 4..4 (bytes {4 * EXPERT_BYTES}..{5 * EXPERT_BYTES - 1}) "
            "are owned by ranks [0, 1]") in exc.value.message
    with pytest.raises(EngineError, match=r"overlap: experts 0\.\.7 .* ranks \[0, 1\]"):
        check_ownership(ShardPlan(2, 8, ((0, 8), (0, 8))), cfg.tensor_shapes)


def test_malformed_plans_and_claims_are_refused(cfg):
    shapes = cfg.tensor_shapes
    with pytest.raises(EngineError, match="claims experts 8..8, beyond the tensor's 8 experts"):
        check_ownership(ShardPlan(2, 8, ((0, 4), (4, 9))), shapes)
    with pytest.raises(EngineError, match=r"plan covers 6 experts but the tensors have \[8\]"):
        check_ownership(plan_experts(6, 2), shapes)
    with pytest.raises(EngineError, match="plan has 1 bands for a world of 2 ranks"):
        check_ownership(ShardPlan(2, 8, ((0, 8),)), shapes)
    good = plan_experts(8, 2).claims(shapes)
    with pytest.raises(EngineError, match="blk.1.ffn_gate_inp.weight: claimed by rank 0 but is not a sharded tensor"):
        check_claims(good + [Claim("blk.1.ffn_gate_inp.weight", 0, 0, 8)], shapes, 2)
    with pytest.raises(EngineError, match="claim by rank 2 outside the world of 2 ranks"):
        check_claims(good + [Claim("blk.1.ffn_up_exps.weight", 2, 0, 1)], shapes, 2)
    with pytest.raises(EngineError, match="no sharded"):
        check_claims([], {"output.weight": (256, 512)}, 1)


def test_the_flagship_plan_in_bytes_and_its_unsplit_latent_cache():
    """K3 on 8 ranks: 112 experts each; byte ranges in IQ1_S blocks; MLA's one latent head stays whole."""
    k3 = k3_config()
    shapes = {n: s[0] for n, s in expected_tensors(k3).items()}
    types = {n: "IQ1_S" for n in shapes if is_sharded(n)}  # 256 weights -> 50 bytes
    plan = plan_experts(k3.n_expert, 8)
    table = check_ownership(plan, shapes, types)
    assert len(table) == 3 * 92
    per_expert = 3584 // 256 * 50 * 3072  # one expert of ffn_gate_exps: [3072, 3584] IQ1_S = 2,150,400 B
    bad = dict(types)
    with pytest.raises(EngineError, match=rf"gap: experts 112..223 \(bytes {112 * per_expert}..{224 * per_expert - 1}\)"):
        check_ownership(ShardPlan(8, 896, plan.bands[:1] + ((224, 224),) + plan.bands[2:]), shapes, bad)
    per = plan.rank_bytes(shapes, types)
    total_experts = 92 * 3 * 896 * per_expert
    assert sum(r["sharded"] for r in per) == total_experts and len({r["sharded"] for r in per}) == 1
    assert round(total_experts / GIB, 1) == 495.3  # all IQ1_S (1.5625 bits/weight); UD-IQ1_S mixes types: 531 GiB
    cache = rank_cache_bytes(k3, 1_048_576)
    assert cache["kv"] == 24 * 576 * 2 * 1_048_576 == 27 * GIB  # 27 GiB on EVERY rank, not 27/8
    assert round(cache["kda_state"] / GIB, 2) == 0.43


# -- the fit check uses the same plan ---------------------------------------------------------------

def test_fit_prices_the_largest_rank_of_the_plan(lock, cfg):
    plan = plan_experts(cfg.n_expert, 2)
    rep = plan_fit(lock, TARGET, plan, cfg.tensor_shapes, cfg.tensor_types, usable_gib=4.0)
    base = fit_budget(lock, TARGET, ranks=2, usable_gib=4.0, detect=False)
    weights = next(x for x in rep.lines if x.item == "weights")
    per = plan.rank_bytes(cfg.tensor_shapes, cfg.tensor_types)[0]
    assert per == {"sharded": 15 * 4 * EXPERT_BYTES, "replicated": 13_243_072}
    assert weights.gib == (per["sharded"] + per["replicated"]) / GIB
    assert "largest band (rank 0, experts 0..3)" in weights.detail and "over 2 ranks" in weights.detail
    # the other lines are fit_budget's own: the KV line is the whole latent cache on each rank
    assert [(x.item, x.gib) for x in rep.lines[1:]] == [(x.item, x.gib) for x in base.lines[1:]]
    assert rep.ranks == 2 and check_fit(rep).fits
    # one process holds every weight: a 2-rank plan needs less per rank than the whole model
    assert weights.gib < next(x for x in base.lines if x.item == "weights").gib
    with pytest.raises(InputError, match="does not fit"):
        check_fit(plan_fit(lock, TARGET, plan, cfg.tensor_shapes, cfg.tensor_types, usable_gib=0.5))


# -- rank-local loading and the load check ----------------------------------------------------------

def test_a_rank_loads_only_its_band_and_the_load_check_sees_what_is_resident(cfg):
    plan = plan_experts(cfg.n_expert, 2)
    full, _ = load_weights(cfg, tuple(cfg.shards), "cpu", torch.float32)
    held = {}
    for rank in (0, 1):
        w, types, claims = load_rank_weights(cfg, plan, rank, "cpu", torch.float32)
        lo, hi = plan.band(rank)
        for il in cfg.moe_layers:
            for k in ("exps_in", "ffn_down_exps"):  # exps_in: each expert's gate|up rows stacked
                assert w.layers[il][k].w.shape[0] == hi - lo
                assert torch.equal(w.layers[il][k].w, full.layers[il][k].w[lo:hi])
        assert torch.equal(w.layers[1]["ffn_gate_inp"].w, full.layers[1]["ffn_gate_inp"].w)  # router: whole
        held[rank] = claims
    assert check_claims(held[0] + held[1], cfg.tensor_shapes, 2, types)
    with pytest.raises(EngineError, match=r"gap: experts 4..7 \(bytes 262144..524287\)"):
        check_claims(held[0], cfg.tensor_shapes, 2, types)  # rank 1 never loaded: its experts would be dropped
    with pytest.raises(EngineError, match=r"overlap: experts 0..3 .* ranks \[0, 1\]"):
        check_claims(held[0] + [dataclasses.replace(c, rank=1) for c in held[0]] + held[1], cfg.tensor_shapes, 2)


# -- real parallel runs vs the single-process engine ------------------------------------------------

def _gate_ids(shards) -> tuple[tuple[int, ...], dict[int, list[int]], tuple[int, ...]]:
    """The gate's prompt (as the sparkinfer gate test draws it), its rows per depth, all positions."""
    pol = load_lock(REPO / "reference.lock").targets[TARGET].gate
    ids = draw_prompt(Tokenizer.from_gguf(shards[0]), max(pol.depths), seed=11).token_ids
    per = {d: gate_positions(d, pol.rows_per_depth) for d in pol.depths}
    return ids, per, tuple(sorted({p for ps in per.values() for p in ps}))


class Runs:
    """Parallel runs on demand (one launch per model and world), and the single-process baseline."""

    def __init__(self, shards, smooth_dir: Path):
        self.shards = {"k3-mini": shards}
        self.smooth_dir = smooth_dir
        self.cache: dict = {}

    def model(self, name: str):
        if name not in self.shards:
            self.shards[name] = generate(name, self.smooth_dir)
        return self.shards[name]

    def job(self, name: str) -> ParallelJob:
        sh = self.model(name)
        ids, _, pos = _gate_ids(sh)
        d, n, reps, warm = TIMED
        return ParallelJob(target(sh), logits=(ids, pos), greedy=(ids, *DECODE),
                           timed=(*Workload.split("decode", d, n, ids), reps, warm))

    def single(self, name: str) -> dict:
        key = (name, 1)
        if key not in self.cache:
            job = self.job(name)
            engine = SparkInferEngine()
            prep = engine.prepare(job.target, Path("unused"))
            ids, pos = job.logits
            self.cache[key] = {"logits": engine.logits(prep, LogitsRequest(ids, pos, GEOM)).logits,
                               "greedy": greedy_decode(prep, *job.greedy),
                               "timed": greedy_decode(prep, ids, TIMED[0], TIMED[1])}
        return self.cache[key]

    def parallel(self, name: str, world: int) -> dict:
        key = (name, world)
        if key not in self.cache:
            t0 = time.monotonic()
            self.cache[key] = run_ranks(self.job(name), world, timeout_s=600)
            self.cache[key]["wall_s"] = time.monotonic() - t0
        return self.cache[key]


@pytest.fixture(scope="module")
def runs(shards, tmp_path_factory) -> Runs:
    return Runs(shards, tmp_path_factory.mktemp("smooth"))


def _check_parallel(runs: Runs, name: str, world: int, cfg) -> dict:
    par, one = runs.parallel(name, world), runs.single(name)
    diff = np.abs(par["logits"] - one["logits"])
    rel = float(diff.max() / np.abs(one["logits"]).max())
    kl = kl_rows(one["logits"], par["logits"])
    assert par["logits"].shape == (96, 512) and par["logits"].dtype == np.float32
    assert rel <= REL_TOL and float(kl.max()) <= KL_TOL, (rel, float(kl.max()))
    assert (par["logits"].argmax(-1) == one["logits"].argmax(-1)).all()
    assert par["greedy"] == one["greedy"] and len(par["greedy"]) == DECODE[1]
    # one all_reduce per MoE layer per forward: the 1024 tokens are one prefill call (calls of at least 2048
    # tokens, engine.prefill_chunk); the decode = 1 prefill + 6 steps
    n_moe = len(cfg.moe_layers)
    assert par["logits_collectives"] == n_moe and par["greedy_collectives"] == (1 + DECODE[1]) * n_moe
    # timed on rank 0 around barriers: raw ns and tokens, the same greedy ids as the single process
    assert len(par["reps"]) == TIMED[2]
    for rep in par["reps"]:
        assert rep.clock == "harness" and rep.ns > 0 and rep.n_tokens == TIMED[1] and rep.token_ids == one["timed"]
    # every rank's fingerprint, in rank order, from distinct processes of this box
    fps = par["fingerprints"]
    assert [fp["rank"]["rank"] for fp in fps] == list(range(world)) and len({fp["rank"]["pid"] for fp in fps}) == world
    assert all(fp["cpu"] == fps[0]["cpu"] and fp["rank"]["backend"] == "gloo" and fp["rank"]["torch_threads"] == 1
               for fp in fps)
    # the load check ran on what every rank holds; the ranks' bands tile the experts
    assert [r["band"] for r in par["ranks"]] == [list(b) for b in plan_experts(8, world).bands]
    assert par["identity"]["extra"]["parallel"]["world"] == world
    assert all(len(v) == world for v in par["notes"]["ownership"].values())
    return {"max_abs": float(diff.max()), "rel": rel, "kl_max": float(kl.max()), "kl_mean": float(kl.mean()),
            "tok_s": [TIMED[1] / (r.ns / 1e9) for r in par["reps"]]}


def test_two_gloo_ranks_match_the_single_process_engine(runs, cfg):
    _check_parallel(runs, "k3-mini", 2, cfg)


@pytest.mark.slow
def test_four_gloo_ranks_match_the_single_process_engine(runs, cfg):
    _check_parallel(runs, "k3-mini", 4, cfg)


@pytest.mark.slow
def test_reduction_order_stays_within_tolerance_when_every_expert_is_active(runs, cfg):
    """k3-mini-smooth routes to all 8 experts: the ranks' partial sums really reassociate the expert sum."""
    got = _check_parallel(runs, "k3-mini-smooth", 2, cfg)
    assert 0 < got["max_abs"]  # a real reassociation (k3-mini's top-2 is exact), still within the tolerance


# -- the gate against llama.cpp ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference_logits(lock, shards):
    """llama.cpp's logits at the k3-mini-cpu gate rows: the registry's engine, the lock's reference pin."""
    from scoreboard import registry
    from scoreboard.weights.verify import default_cache

    tg = lock.targets[TARGET]
    ref_target = dataclasses.replace(target(shards), reference=lock.references[tg.reference],
                                     options={"reference_id": tg.reference})
    engine = registry.load(tg.reference_engine)
    prep = engine.prepare(ref_target, default_cache())
    ids, _, pos = _gate_ids(shards)
    return engine.logits(prep, LogitsRequest(ids, pos, GEOM)).logits


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_parallel_engine_passes_the_gate_against_llamacpp(runs, lock, shards, reference_logits, world):
    pol = lock.targets[TARGET].gate
    _, per, pos = _gate_ids(shards)
    row = {p: i for i, p in enumerate(pos)}
    cand, single = runs.parallel("k3-mini", world)["logits"], runs.single("k3-mini")["logits"]
    for d in pol.depths:
        idx = [row[p] for p in per[d]]
        got = grade_depth(d, per[d], reference_logits[idx], cand[idx], pol)
        assert got.passed and got.top1 == 1.0, got.reasons
        assert got.kl_mean < pol.kl_max / 1000 and got.kl_p99 < pol.kl_p99_max / 1000
        base = grade_depth(d, per[d], reference_logits[idx], single[idx], pol)
        assert math.isclose(got.kl_mean, base.kl_mean, rel_tol=1e-3, abs_tol=1e-12)  # parallel adds nothing


def test_k3_slice_plan_prices_the_real_widths_per_rank():
    """The k3-slice preset (K3's real per-layer widths, 2 MoE layers of 896 experts) over 1/2/4/8 ranks:
    the plan tiles every expert, and each rank holds 896/W experts. With IQ1_S experts (256 weights in
    50 B), one expert's gate/up/down tensor is 3584 x 3072 / 256 x 50 = 2,150,400 B. These per-rank
    figures are the fit check's prediction for the 8x H200 run."""
    from scoreboard.weights.presets import get_spec

    spec = get_spec("k3-slice")
    spec.validate()
    shapes = {n: v[0] for n, v in expected_tensors(spec.config()).items()}
    types = {n: "IQ1_S" if is_sharded(n) else ("Q8_0" if len(s) >= 2 and s[0] % 32 == 0 else "F32")
             for n, s in shapes.items()}
    per_expert = 3584 * 3072 // 256 * 50
    assert sum(is_sharded(n) for n in shapes) == 6  # gate, up, down in each of the 2 MoE layers
    for world in (1, 2, 4, 8):
        plan = plan_experts(896, world)
        check_ownership(plan, shapes, types)
        per = plan.rank_bytes(shapes, types)
        assert all(p["sharded"] == 896 // world * 6 * per_expert for p in per)
        assert len({p["replicated"] for p in per}) == 1
    assert per[0]["sharded"] == 1_445_068_800  # 1.35 GiB of experts per rank at 8 ranks
