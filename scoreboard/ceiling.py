"""The physical ceiling on a decode rate: memory bandwidth over the bytes one token must read.

Decoding one token reads, at least once, every weight the token's forward pass touches: each non-expert
tensor whole (attention, norms, router, shared experts, the output head), one row of the token embedding,
and of each layer's routed experts only the ``expert_used_count`` of ``expert_count`` the router picks.
The bytes come from the verified GGUF's own tensor sizes (their stored quantization), the expert counts
from the checked model config. A rate above ``bandwidth x devices / bytes`` cannot have been computed on
that box: the round records it and the metric is not scored.

At depth d the token also attends over d cached rows of every MLA layer (the latent row: kv_lora + rope
values), so the bound adds d x those rows' bytes, counted at one byte per value (a cache kept below the f16
both engines use today, if it passed the gate, must not be called impossible). The recurrent state is left out
(a lower bound on bytes) and the node class's bandwidth is set generously (an upper bound), so an honest engine
is never near it. ``kv_bytes_per_row_f16`` is the same rows at f16, what the diagnosis's bandwidth ceiling at
depth uses (weights plus the f16 rows read, docs/diagnosis.md).

Prefill has no bound here: a batch of n prompt tokens shares each weight read, so bytes give no useful
limit, and a compute bound would need a FLOP figure per node class this lock does not carry.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

EXPERT_MARK = "_exps."  # routed experts' stacked tensors: ffn_{gate,up,down}_exps.weight


@dataclass(frozen=True)
class Ceiling:
    memory_bandwidth_gbs: float  # per device, from the node class
    devices: int  # devices the candidate's ranks use (1 on a cpu host)
    decode_bytes_per_token: int
    detail: dict[str, int]
    kv_values_per_row: int = 0  # MLA layers x (kv_lora + rope): the values one cached position holds

    @property
    def decode_max_tok_s(self) -> float:
        return self.memory_bandwidth_gbs * 1e9 * self.devices / self.decode_bytes_per_token

    def as_dict(self) -> dict[str, Any]:
        return {"memory_bandwidth_gbs": self.memory_bandwidth_gbs, "devices": self.devices,
                "decode_bytes_per_token": self.decode_bytes_per_token,
                "decode_max_tok_s": round(self.decode_max_tok_s, 3), "bytes": dict(self.detail),
                "kv_floor_bytes_per_row": self.kv_values_per_row, "kv_bytes_per_row_f16": 2 * self.kv_values_per_row,
                "prefill": "no bound"}


def decode_bytes(shards: tuple[Path, ...] | list[Path], cfg: Any) -> tuple[int, dict[str, int]]:
    """(minimum bytes one decode token reads, the parts) from the shards' tensor sizes."""
    from gguf import GGUFReader

    dense = embd = experts = 0
    for p in shards:
        for t in GGUFReader(str(p)).tensors:
            n = int(t.n_bytes)
            if t.name == "token_embd.weight":
                embd += n
            elif EXPERT_MARK in t.name:
                experts += n
            else:
                dense += n
    n_expert = int(getattr(cfg, "n_expert", 0) or 0)
    used = int(getattr(cfg, "n_expert_used", 0) or 0)
    routed = experts * used // n_expert if n_expert else experts
    row = embd // max(int(cfg.n_vocab), 1)
    total = dense + row + routed
    return total, {"non_expert": dense, "embedding_row": row, "routed_experts_used": routed,
                   "routed_experts_all": experts}


def kv_values_per_row(cfg: Any) -> int:
    """Values one cached position holds over every MLA layer: MLA layers x (kv_lora + rope)."""
    mla = len(getattr(cfg, "mla_layers", ()) or ())
    return mla * (int(getattr(cfg, "kv_lora_rank", 0) or 0) + int(getattr(cfg, "rope_dim", 0) or 0))


def decode_ceiling(shards, cfg, bandwidth_gbs: float, devices: int) -> Ceiling:
    total, detail = decode_bytes(shards, cfg)
    return Ceiling(float(bandwidth_gbs), max(int(devices), 1), total, detail, kv_values_per_row(cfg))


def max_tok_s_at(ceiling: dict[str, Any], depth: int, f16_kv: bool = False) -> float:
    """The decode-rate bound at `depth` cached rows: bandwidth x devices / (weights + depth x a row's bytes, at
    one byte per value, or at f16 with `f16_kv`). 0 when the ceiling holds no bandwidth."""
    bw = float(ceiling.get("memory_bandwidth_gbs") or 0) * 1e9 * int(ceiling.get("devices") or 1)
    row = int(ceiling.get("kv_bytes_per_row_f16" if f16_kv else "kv_floor_bytes_per_row") or 0)
    # the recorded depth-0 bound is the receipt's own figure (it is what older receipts were judged by): the
    # cache rows' time is added to its time per token; without it, the weights' bytes over the bandwidth
    base = float(ceiling.get("decode_max_tok_s") or 0)
    weights = int(ceiling.get("decode_bytes_per_token") or 0)
    per_token = 1.0 / base if base > 0 else (weights / bw if bw > 0 else 0.0)
    if per_token <= 0:
        return 0.0
    rows = max(int(depth), 0) * row / bw if bw > 0 else 0.0
    return 1.0 / (per_token + rows)


def implausible(ceiling: dict[str, Any] | None, phase: str, n_tokens: int, samples_ns: list[int],
                depth: int = 0) -> str | None:
    """Why a rep's rate is above the recorded ceiling at its depth (None when every rep is below it)."""
    if not ceiling or phase != "decode":
        return None
    cap = max_tok_s_at(ceiling, depth)
    if cap <= 0:
        return None
    fastest = min((int(x) for x in samples_ns), default=0)
    if fastest <= 0:
        return None
    rate = n_tokens / (fastest / 1e9)
    if rate > cap:
        kv = int(ceiling.get("kv_floor_bytes_per_row") or 0) * max(int(depth), 0)
        return (f"a timed rep decoded at {rate:,.0f} tok/s, above the physical ceiling {cap:,.0f} tok/s "
                f"({ceiling.get('memory_bandwidth_gbs')} GB/s x {ceiling.get('devices')} device(s) / "
                f"({ceiling.get('decode_bytes_per_token'):,} B of weights + {kv:,} B of cache rows at depth "
                f"{depth}) per token)")
    return None
