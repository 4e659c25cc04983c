"""Per-rank memory budget of a target: weights under the sharding plan + KV + KDA state + scratch vs usable memory.

Pricing (the shapes from Kimi K3's public config):
- weights per rank = sharded / ranks + replicated (the lock's fit plan); without a plan, every weight on
  every rank (a single-process host, or a pure replica).
- KV cache at the target's context (geometry n_ctx: what the engine allocates), MLA latent layout as
  llama.cpp's is_mla() stores it — K only, one latent "head": layers x (kv_lora + rope) x 2 B (f16) per
  token, replicated on every rank (attention is replicated).
- KDA recurrent state per sequence, f32: KDA layers x (head_dim^2 x heads + 3 x (conv-1) x heads x head_dim) x 4 B.
- scratch: the plan's flat reserve for compute buffers.
Offload is excluded by policy: a configuration that does not fit in device memory is refused, with numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .errors import InputError

GIB = float(1 << 30)


@dataclass(frozen=True)
class ArchNumbers:
    """What the fit check needs of an architecture (published numbers for the flagship, else from the GGUF header)."""

    name: str
    n_mla_layers: int
    n_kda_layers: int
    kv_lora_rank: int
    rope_dim: int
    n_head: int
    kda_head_dim: int
    ssm_conv_kernel: int

    def kv_bytes_per_token(self, bytes_per_elem: float = 2.0) -> float:
        return self.n_mla_layers * (self.kv_lora_rank + self.rope_dim) * bytes_per_elem

    def kda_state_bytes(self, n_seq: int = 1) -> float:
        d_inner = self.n_head * self.kda_head_dim
        per_layer = self.kda_head_dim ** 2 * self.n_head + 3 * (self.ssm_conv_kernel - 1) * d_inner
        return n_seq * self.n_kda_layers * per_layer * 4.0


# Kimi K3 (its public config): 93 layers = 24 MLA + 69 KDA; kv_lora 512, rope 64; KDA 96 heads x 128, conv kernel 4.
KIMI_K3 = ArchNumbers("kimi-k3", n_mla_layers=24, n_kda_layers=69, kv_lora_rank=512, rope_dim=64, n_head=96,
                      kda_head_dim=128, ssm_conv_kernel=4)
ARCHITECTURES = {"kimi-k3": KIMI_K3}
PUBLISHED_GIB = {"UD-IQ1_S": 553.0, "UD-Q2_K_XL": 802.0}  # unsloth/Kimi-K3-GGUF published sizes


def arch_from_config(cfg) -> ArchNumbers:
    """ArchNumbers of a K3Config read from a GGUF header (generated targets)."""
    return ArchNumbers(f"kimi-k3 ({cfg.n_layer} layers)", len(cfg.mla_layers), len(cfg.kda_layers), cfg.kv_lora_rank,
                       cfg.rope_dim, cfg.n_head, cfg.kda_head_dim, cfg.ssm_conv_kernel)


@dataclass(frozen=True)
class FitLine:
    item: str
    gib: float  # per rank
    detail: str


@dataclass
class FitReport:
    target: str
    ranks: int
    n_ctx: int
    usable_gib: float  # per device (rank)
    usable_source: str
    lines: list[FitLine] = field(default_factory=list)
    device_kind: str = "GPU"

    @property
    def need_gib(self) -> float:
        return sum(x.gib for x in self.lines)

    @property
    def headroom_gib(self) -> float:
        return self.usable_gib - self.need_gib

    @property
    def fits(self) -> bool:
        return self.ranks > 0 and self.need_gib <= self.usable_gib

    def as_dict(self) -> dict:
        return {"target": self.target, "ranks": self.ranks, "n_ctx": self.n_ctx, "usable_gib": self.usable_gib,
                "usable_source": self.usable_source, "need_gib": self.need_gib, "fits": self.fits,
                "lines": [{"item": x.item, "gib": x.gib, "detail": x.detail} for x in self.lines]}

    def summary(self) -> str:
        parts = ", ".join(f"{x.item} {x.gib:.2f}" for x in self.lines)
        return (f"{self.target}: needs {self.need_gib:.2f} GiB per rank ({parts}) on {self.ranks} rank(s) at "
                f"n_ctx {self.n_ctx}; usable {self.usable_gib:.2f} GiB per {self.device_kind.lower()} "
                f"({self.usable_source})")


def _weights_gib(lock, target_id: str, target, ranks: int) -> tuple[float, str]:
    """(GiB per rank, how) for the target's weights under its plan."""
    fit = target.fit
    if fit is not None and (fit.sharded_gib or fit.replicated_gib):
        per = fit.sharded_gib / ranks + fit.replicated_gib
        return per, f"{fit.sharded_gib:g} GiB sharded / {ranks} + {fit.replicated_gib:g} GiB replicated"
    w = lock.weights[target.weights]
    if all(f.size > 0 for f in w.files):
        total = sum(f.size for f in w.files) / GIB
        how = f"{len(w.files)} pinned shard(s), all on every rank"
    elif target.quant in PUBLISHED_GIB:
        total = PUBLISHED_GIB[target.quant]
        how = f"published {target.quant} size, all on every rank"
    else:
        raise InputError(f"targets.{target_id}: cannot size the weights (shards not pinned, quant "
                         f"{target.quant!r} has no published size, no fit plan)",
                         "pin the shard sizes, or give the target a fit plan (sharded_gib/replicated_gib)")
    return total, how


def _arch(lock, target_id: str, target, weights_dir: Path | None) -> ArchNumbers:
    w = lock.weights[target.weights]
    if w.repo == "generated":
        from .weights.presets import get_spec

        return arch_from_config(get_spec(w.spec).config())
    if weights_dir is not None:
        from .models.k3 import load_k3_config

        return arch_from_config(load_k3_config(weights_dir / w.files[0].path))
    if target.model in ARCHITECTURES:
        return ARCHITECTURES[target.model]
    raise InputError(f"targets.{target_id}.model: no architecture numbers for {target.model!r}",
                     f"known: {', '.join(ARCHITECTURES)}; or pass --dir with the weights to read their header")


def detect_usable(node, device: str, node_id: str = "") -> tuple[int, float, str]:
    """(ranks, usable GiB per rank, source): from the devices present, else the node class."""
    from .environment import gpus, ram_gib

    if device == "cpu":
        ram = ram_gib()
        return 1, ram, "host RAM, /proc/meminfo" if ram else "unknown"
    found = gpus()
    devs = [d for d in found.get("devices", []) if d.get("memory_mib")]
    if devs:
        return len(devs), min(d["memory_mib"] for d in devs) / 1024.0, f"nvidia-smi memory.total, {len(devs)} device(s)"
    return node.gpu_count, node.gpu_memory_gib, f"node class {node_id or '?'} (no GPU visible)"


def fit_budget(lock, target_id: str, *, n_ctx: int | None = None, ranks: int | None = None,
               usable_gib: float | None = None, detect: bool = True, weights_dir: Path | None = None) -> FitReport:
    """The per-rank budget table of a target (overrides for what-if plans: ctx, ranks, usable memory)."""
    target = lock.target(target_id)
    node = lock.nodes[target.node]
    if detect:
        d_ranks, d_usable, source = detect_usable(node, target.device, target.node)
    elif target.device == "cpu":
        d_ranks, d_usable, source = 1, 0.0, "not detected"
    else:
        d_ranks, d_usable, source = node.gpu_count, node.gpu_memory_gib, f"node class {target.node}"
    if ranks is None and target.parallel.ranks > 1:  # the lock's own plan: that many processes
        ranks = target.parallel.ranks
        if target.device == "cpu" and d_usable:  # cpu ranks share the host's RAM
            d_usable, source = d_usable / ranks, f"{source}, shared by {ranks} ranks"
    ranks = d_ranks if ranks is None else ranks
    if usable_gib is not None:
        d_usable, source = usable_gib, "given"
    ctx = n_ctx or target.geometry["n_ctx"]
    if ranks <= 0:
        raise InputError(f"{target_id}: no {target.device.upper()} rank to place the model on (ranks = {ranks})",
                         "run on the target's node class, or pass --ranks / --usable-gib for a what-if plan")
    arch = _arch(lock, target_id, target, weights_dir)
    w_gib, w_how = _weights_gib(lock, target_id, target, ranks)
    kv = arch.kv_bytes_per_token()
    rep = FitReport(target_id, ranks, ctx, d_usable, source, device_kind="host" if target.device == "cpu" else "GPU")
    rep.lines.append(FitLine("weights", w_gib, w_how))
    rep.lines.append(FitLine("KV cache", ctx * kv / GIB,
                             f"MLA latent: {arch.n_mla_layers} layers x ({arch.kv_lora_rank} + {arch.rope_dim}) x 2 B "
                             f"= {kv:,.0f} B/token x {ctx:,} tokens"))
    rep.lines.append(FitLine("KDA state", arch.kda_state_bytes() / GIB,
                             f"{arch.n_kda_layers} layers x ({arch.kda_head_dim}^2 x {arch.n_head} + 3 x "
                             f"{arch.ssm_conv_kernel - 1} x {arch.n_head * arch.kda_head_dim}) x 4 B, 1 sequence"))
    scratch = target.fit.scratch_gib if target.fit is not None else 0.0
    rep.lines.append(FitLine("scratch", scratch, "compute buffers, flat reserve (lock fit.scratch_gib)"))
    return rep


def price_weights(rep: FitReport, gib: float, how: str) -> FitReport:
    """The same budget with its weights line priced by a concrete plan (e.g. an engine's shard plan: the
    largest rank's share + the replicated weights), instead of the lock's sharded/replicated totals."""
    lines = [FitLine("weights", gib, how) if x.item == "weights" else x for x in rep.lines]
    return FitReport(rep.target, rep.ranks, rep.n_ctx, rep.usable_gib, rep.usable_source, lines, rep.device_kind)


def check_fit(rep: FitReport) -> FitReport:
    """Refuse (InputError, with the numbers) a configuration that does not fit or would offload."""
    if rep.usable_gib <= 0:
        raise InputError(f"{rep.target}: usable memory per rank is unknown ({rep.usable_source})",
                         "run on the target's node, or pass --usable-gib")
    if not rep.fits:
        raise InputError(f"{rep.summary()}: does not fit by {-rep.headroom_gib:.2f} GiB per rank. Offload is "
                         "excluded (a partially offloaded configuration is not comparable)",
                         "use a smaller quant, a shorter context (--ctx), or a node with more ranks/memory")
    return rep
