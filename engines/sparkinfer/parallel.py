"""Expert-parallel sparkinfer over torch.distributed: the shard plan, its ownership check, rank-local weights,
the parallel forward, rank-0 timing around a barrier, and the per-rank fingerprints.

The plan (docs/parallel.md has the why and the arithmetic):

* routed experts — the only sharded tensors: ``blk.N.ffn_{gate,up,down}_exps`` are banded contiguously
  by expert index along their expert axis (ggml ``ne[2]``, numpy axis 0): rank r owns experts
  ``[r*X//W, (r+1)*X//W)``. Each rank loads only its band (the GGUF bytes are sliced before dequantizing).
* everything else is replicated: embeddings, KDA, MLA (its single stored latent KV head and the latent
  cache are never divided by the world size), the dense FFN, the router (so every rank routes every
  token identically), the latent down/up projections and norm, the shared experts, the output head.
* one collective per MoE layer: each rank computes the routed contributions of its own experts for all
  tokens, and one ``all_reduce(SUM)`` of that partial sum ``[T, latent]`` completes it. It sits right
  after the weighted expert sum and before ``ffn_routed_norm``, the first nonlinearity of the sum
  (rms_norm(a + b) != rms_norm(a) + rms_norm(b)); everything after it is replicated and needs no other.

The model subclasses :class:`~engines.sparkinfer.model.K3Model` and overrides only ``_experts``, so every
other line of the forward, and the engine's prefill/decode code paths (engine.SparkInferEngine's
logits/begin/step on a :class:`~engines.sparkinfer.engine.Loaded` handle), are the single-process ones.

Driving it: the harness launches the ranks (torchrun, scoreboard.worker.distributed), in a round and in
the tests and bench scripts alike, and ``SparkInferEngine.prepare`` calls :func:`prepare_rank` when the
target has ``ranks > 1``. The engine has no launcher of its own.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from scoreboard.engine import EngineTarget, Prepared
from scoreboard.errors import EngineError, InputError

from .engine import (
    DTYPES,
    Loaded,
    SparkInferEngine,
    _dtype_name,
    checked_config,
    options,
)
from .faults import Faults, apply_config_faults, parse_faults
from .model import K3Model, K3Weights
from .weights import _BLK, _place, _short, assemble, gguf_tensors, to_f32

Tensor = torch.Tensor

EXPERT_KEYS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # the banded tensors of every MoE layer
_EXPERT_TENSOR = re.compile(r"^blk\.\d+\.(ffn_(?:gate|up|down)_exps)\.weight$")
PLAN_NAME = "expert-parallel: routed experts banded contiguously across ranks; attention (KDA, MLA and its latent " \
            "KV), dense FFN, router, latent projections, shared experts and embeddings replicated"


def is_sharded(name: str) -> bool:
    """True for a routed-expert tensor (banded by the plan); everything else is replicated."""
    return _EXPERT_TENSOR.match(name) is not None


def tensor_nbytes(ggml_shape: Sequence[int], ggml_type: str = "F32") -> int:
    """Bytes of a tensor of ggml shape (ne0 first) and ggml type name, as stored in the GGUF."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]
    except KeyError as exc:
        raise InputError(f"unknown ggml type {ggml_type!r}", "use a ggml type name such as F32, Q8_0, IQ1_S") from exc
    ne0, rest = int(ggml_shape[0]), math.prod(int(d) for d in ggml_shape[1:])
    if ne0 % block:
        raise InputError(f"ne0 {ne0} is not a multiple of the {ggml_type} block size {block}",
                         "the tensor cannot be stored in this type")
    return ne0 // block * size * rest


# ----------------------------------------------------------------------------------------------
# the plan and its ownership check

@dataclass(frozen=True)
class Claim:
    """Rank `rank` holds experts [lo, hi) of `tensor` (along its expert axis, ggml ne[2])."""

    tensor: str
    rank: int
    lo: int
    hi: int


@dataclass(frozen=True)
class ShardPlan:
    """Which rank owns which routed experts: bands[r] = [lo, hi). Not validated here, so that a broken
    plan can be built and refused by :func:`check_ownership` (which names the gap or the overlap)."""

    world: int
    n_expert: int
    bands: tuple[tuple[int, int], ...]
    name: str = PLAN_NAME

    def band(self, rank: int) -> tuple[int, int]:
        if not 0 <= rank < len(self.bands):
            raise EngineError(f"rank {rank} is outside the plan's {len(self.bands)} ranks", "launch world ranks")
        return self.bands[rank]

    def owner(self, expert: int) -> int:
        """The rank owning `expert` (a checked plan has exactly one)."""
        owners = [r for r, (lo, hi) in enumerate(self.bands) if lo <= expert < hi]
        if len(owners) != 1:
            raise EngineError(f"expert {expert} is owned by ranks {owners} (want exactly one)",
                              "build the plan with plan_experts()")
        return owners[0]

    def claims(self, tensor_shapes: dict[str, Sequence[int]]) -> list[Claim]:
        """What the plan assigns: one claim per rank per sharded tensor."""
        return [Claim(name, r, lo, hi) for name in tensor_shapes if is_sharded(name)
                for r, (lo, hi) in enumerate(self.bands)]

    def rank_bytes(self, tensor_shapes: dict[str, Sequence[int]],
                   tensor_types: dict[str, str] | None = None) -> list[dict[str, int]]:
        """Per rank: {"sharded": bytes of its expert bands, "replicated": bytes of every other tensor}."""
        types = tensor_types or {}
        replicated = sum(tensor_nbytes(s, types.get(n, "F32")) for n, s in tensor_shapes.items() if not is_sharded(n))
        out = []
        for lo, hi in self.bands:
            sh = sum(tensor_nbytes(s, types.get(n, "F32")) // int(s[-1]) * (hi - lo)
                     for n, s in tensor_shapes.items() if is_sharded(n))
            out.append({"sharded": sh, "replicated": replicated})
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "world": self.world, "n_expert": self.n_expert, "bands": [list(b) for b in self.bands]}


def plan_experts(n_expert: int, world: int) -> ShardPlan:
    """Balanced contiguous bands: rank r owns [r*X//W, (r+1)*X//W) (sizes differ by at most one)."""
    if world < 1:
        raise InputError(f"world size {world}: need at least one rank", "use 1 or more ranks")
    if world > n_expert:
        raise InputError(f"world size {world} exceeds the {n_expert} routed experts: some rank would own none",
                         f"use at most {n_expert} ranks")
    return ShardPlan(world, n_expert, tuple((r * n_expert // world, (r + 1) * n_expert // world) for r in range(world)))


def _runs(units: list[list[int]], bad: Callable[[list[int]], bool]) -> Iterator[tuple[int, int]]:
    """Maximal [a, b) runs of units whose owner list is `bad` and the same throughout."""
    a = 0
    while a < len(units):
        if not bad(units[a]):
            a += 1
            continue
        b = a + 1
        while b < len(units) and units[b] == units[a]:
            b += 1
        yield a, b
        a = b


def check_claims(claims: Sequence[Claim], tensor_shapes: dict[str, Sequence[int]], world: int,
                 tensor_types: dict[str, str] | None = None) -> dict[str, list[Claim]]:
    """Prove every byte of every sharded tensor is held by exactly one rank; the claims per tensor.

    Raises EngineError naming each offending tensor with the expert range and its byte range (the
    expert axis is outermost, so experts [a, b) are bytes [a*per, b*per)): a gap (no rank: that expert
    would be silently dropped), an overlap (several ranks: it would be counted twice), a claim outside
    the tensor, a rank outside the world, a claim on a tensor that is not sharded or does not exist.
    """
    types = tensor_types or {}
    problems: list[str] = []
    by_tensor: dict[str, list[Claim]] = {n: [] for n in tensor_shapes if is_sharded(n)}
    for c in claims:
        if c.tensor not in by_tensor:
            what = "is not a sharded tensor" if c.tensor in tensor_shapes else "does not exist"
            problems.append(f"{c.tensor}: claimed by rank {c.rank} but {what}")
        elif not 0 <= c.rank < world:
            problems.append(f"{c.tensor}: claim by rank {c.rank} outside the world of {world} ranks")
        elif not 0 <= c.lo <= c.hi:
            problems.append(f"{c.tensor}: rank {c.rank} claims an empty or reversed range [{c.lo}, {c.hi})")
        else:
            by_tensor[c.tensor].append(c)
    if not by_tensor:
        problems.append("no sharded (routed expert) tensor among the given tensors")
    for name, cl in by_tensor.items():
        shape = tensor_shapes[name]
        n = int(shape[-1])
        per = tensor_nbytes(shape, types.get(name, "F32")) // n
        units: list[list[int]] = [[] for _ in range(n)]
        for c in cl:
            if c.hi > n:
                problems.append(f"{name}: rank {c.rank} claims experts {max(c.lo, n)}..{c.hi - 1}, beyond the "
                                f"tensor's {n} experts")
            for e in range(c.lo, min(c.hi, n)):
                units[e].append(c.rank)
        for a, b in _runs(units, lambda owners: not owners):
            problems.append(f"{name}: gap: experts {a}..{b - 1} (bytes {a * per}..{b * per - 1}) are owned by no rank")
        for a, b in _runs(units, lambda owners: len(owners) > 1):
            problems.append(f"{name}: overlap: experts {a}..{b - 1} (bytes {a * per}..{b * per - 1}) are owned by "
                            f"ranks {sorted(units[a])}")
    if problems:
        more = f" (+{len(problems) - 8} more)" if len(problems) > 8 else ""
        raise EngineError("expert ownership check failed: " + "; ".join(problems[:8]) + more,
                          "every routed expert must live on exactly one rank: build the plan with plan_experts()")
    return {n: sorted(cl, key=lambda c: (c.lo, c.rank)) for n, cl in by_tensor.items()}


def check_ownership(plan: ShardPlan, tensor_shapes: dict[str, Sequence[int]],
                    tensor_types: dict[str, str] | None = None) -> dict[str, list[Claim]]:
    """check_claims on what the plan assigns, after checking the plan matches the tensors' expert count."""
    if len(plan.bands) != plan.world:
        raise EngineError(f"plan has {len(plan.bands)} bands for a world of {plan.world} ranks",
                          "one band per rank: build the plan with plan_experts()")
    wrong = sorted({int(s[-1]) for n, s in tensor_shapes.items() if is_sharded(n)} - {plan.n_expert})
    if wrong:
        raise EngineError(f"plan covers {plan.n_expert} experts but the tensors have {wrong}",
                          "build the plan from this model's config (plan_experts(cfg.n_expert, world))")
    return check_claims(plan.claims(tensor_shapes), tensor_shapes, plan.world, tensor_types)


# ----------------------------------------------------------------------------------------------
# pricing the plan (the fit check prices exactly these bytes)

def rank_cache_bytes(cfg: Any, n_ctx: int) -> dict[str, float]:
    """Per rank, replicated attention: the whole MLA latent cache (its single stored KV head, never divided
    by the world size) and one sequence's whole KDA state, on every rank."""
    return {"kv": cfg.mla_cache_bytes_per_token() * n_ctx, "kda_state": cfg.kda_state_bytes_per_seq()}


def plan_fit(lock: Any, target_id: str, plan: ShardPlan, tensor_shapes: dict[str, Sequence[int]],
             tensor_types: dict[str, str] | None = None, *, usable_gib: float | None = None,
             n_ctx: int | None = None, weights_dir: Path | None = None) -> Any:
    """scoreboard.fit's budget for the target with the weights line priced by this plan: the largest
    rank's band plus the replicated tensors (ranks = plan.world). On a CPU target the ranks share the
    host, so each gets host RAM / world unless `usable_gib` says otherwise."""
    from scoreboard.engine import GIB, fit_budget, price_weights, ram_gib

    target = lock.target(target_id)
    if usable_gib is None and target.device == "cpu":
        usable_gib = ram_gib() / plan.world
    rep = fit_budget(lock, target_id, ranks=plan.world, usable_gib=usable_gib, n_ctx=n_ctx, detect=False,
                     weights_dir=weights_dir)
    per = plan.rank_bytes(tensor_shapes, tensor_types)
    worst = max(range(plan.world), key=lambda r: per[r]["sharded"])
    sh, rp = per[worst]["sharded"], per[worst]["replicated"]
    lo, hi = plan.bands[worst]
    how = (f"{plan.name.split(':')[0]} plan over {plan.world} ranks: largest band (rank {worst}, experts {lo}..{hi - 1}) "
           f"{sh / GIB:.4g} GiB + replicated {rp / GIB:.4g} GiB")
    return price_weights(rep, (sh + rp) / GIB, how)


# ----------------------------------------------------------------------------------------------
# rank-local weights

def iter_rank_tensors(shards: Sequence[Path], plan: ShardPlan, rank: int) -> Iterator[tuple[str, np.ndarray, str, Claim | None]]:
    """(name, float32 array in numpy order, ggml type, claim) for every tensor; a routed-expert tensor is
    sliced to this rank's band on the raw GGUF bytes (expert axis = numpy axis 0) before dequantizing."""
    lo, hi = plan.band(rank)
    for path, t, shape in gguf_tensors(shards):
        data, claim = t.data, None
        if is_sharded(t.name):
            if shape[0] != plan.n_expert:
                raise EngineError(f"{path}: {t.name} has {shape[0]} experts, the plan {plan.n_expert}",
                                  "build the plan from this model's config")
            data, shape, claim = data[lo:hi], (hi - lo,) + shape[1:], Claim(t.name, rank, lo, hi)
        yield t.name, to_f32(path, t, data, shape), t.tensor_type.name, claim


def load_rank_weights(cfg: Any, plan: ShardPlan, rank: int, device: str,
                      dtype: torch.dtype) -> tuple[K3Weights, dict[str, str], list[Claim]]:
    """This rank's weights (routed experts: its band only; the rest whole), tensor types, and the claims of
    what it actually holds (for the load check). Same placement and layout as weights.load_weights."""
    expected = set(cfg.tensor_shapes) if cfg.tensor_shapes else None
    layers: list[dict[str, Any]] = [{} for _ in range(cfg.n_layer)]
    glob: dict[str, Any] = {}
    types: dict[str, str] = {}
    held: list[Claim] = []
    for name, arr, ttype, claim in iter_rank_tensors(tuple(cfg.shards), plan, rank):
        types[name] = ttype
        m = _BLK.match(name)
        if m and int(m.group(1)) >= cfg.n_layer:
            raise EngineError(f"tensor {name}: layer {m.group(1)} beyond block_count {cfg.n_layer}",
                              "the shards do not belong to this config; regenerate the weights")
        key = _short(m.group(2) if m else name)
        placed = _place(key, arr, ttype, device, dtype)
        if claim is not None:  # record what is really resident, from the placed tensor's own shape
            held.append(dataclasses.replace(claim, hi=claim.lo + int(placed.w.shape[0])))
        (layers[int(m.group(1))] if m else glob)[key] = placed
    return assemble(cfg, glob, layers, types, expected), types, held


# ----------------------------------------------------------------------------------------------
# the expert-parallel forward

class ExpertParallelK3Model(K3Model):
    """K3Model whose routed experts are this rank's band; one all_reduce(SUM) per MoE layer completes them."""

    def __init__(self, cfg: Any, w: K3Weights, plan: ShardPlan, rank: int, faults: Faults | None = None,
                 group: Any = None):
        super().__init__(cfg, w, faults)
        self.plan, self.rank, self.group = plan, rank, group
        self.band = plan.band(rank)
        self.n_collectives = 0  # all_reduce calls made (one per MoE layer per forward)
        self.moe_branches = False  # the all_reduce stays on the step's one stream (multi-GPU, not yet run branched)

    def _experts(self, lw: dict[str, Any], xin: Tensor, sel: Tensor, wts: Tensor) -> Tensor:
        """xin [T, lat], sel/wts [T, k] (replicated router) -> the full routed sum [T, lat] on every rank."""
        part = self._held_experts(lw, xin, sel, wts, *self.band)  # this rank's band: K3Model's loop
        dist.all_reduce(part, op=dist.ReduceOp.SUM, group=self.group)
        self.n_collectives += 1
        return part


# ----------------------------------------------------------------------------------------------
# one rank's engine (inside an initialized process group)

def prepare_rank(target: EngineTarget, group: Any = None) -> Prepared:
    """Load this rank's share and prove the world's shares tile every expert tensor exactly (load check).

    Every rank gathers every rank's actual holdings and runs the same check, so a bad load fails on all
    ranks at once (none is left waiting in a collective). The handle is the single-process engine's
    Loaded, so SparkInferEngine's logits/begin/step run unchanged on it (eager decode: no CUDA graph).
    """

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    engine = SparkInferEngine()
    ident = engine.describe(target)
    cfg = checked_config(target)
    faults = parse_faults(options(target).faults or None)
    dtype = _dtype_name(target)
    torch.set_num_threads(target.geometry.n_threads or 1)
    plan = plan_experts(cfg.n_expert, world)
    check_ownership(plan, cfg.tensor_shapes, cfg.tensor_types)  # the plan itself
    weights, types, held = load_rank_weights(cfg, plan, rank, target.device, DTYPES[dtype])
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, held, group=group)
    table = check_claims([c for cl in everyone for c in cl], cfg.tensor_shapes, world, types)  # the load
    model = ExpertParallelK3Model(apply_config_faults(cfg, faults), weights, plan, rank, faults, group)
    identity = dataclasses.replace(ident, extra={**ident.extra, "cuda_graph": False, "parallel": {
        "plan": plan.as_dict(), "backend": dist.get_backend(group), "world": world,
        "collectives": "one all_reduce(SUM) of [T, expert_latent_length] f32 per MoE layer"}})
    per = plan.rank_bytes(cfg.tensor_shapes, types)
    handle = Loaded(model, cfg, target.device, dtype, target.geometry, faults, static_decode=False)
    return Prepared(identity=identity, handle=handle, notes={
        "rank": rank, "world": world, "band": list(plan.band(rank)), "bytes": per[rank],
        "ownership": {n: [[c.rank, c.lo, c.hi] for c in cl] for n, cl in table.items()},
        "threads": torch.get_num_threads()})
