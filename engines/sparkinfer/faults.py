"""Named fault switches: known silent inference bugs the gate's own tests inject into sparkinfer.

Each fault reproduces a bug that loads cleanly and emits fluent-looking, finite logits (the
bugs a glance at the output misses). They exist only so the gate can prove it refuses them; a round never enables one
unless the target's options say so, and the engine identity records every fault that is on.

Enable through ``EngineTarget.options["faults"]`` (a sequence of the names below).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from scoreboard.errors import InputError

# name -> what the engine does wrong
FAULTS: dict[str, str] = {
    "full_attn_0_indexed": "the 1-indexed full_attn_layers read 0-indexed: every layer runs the attention "
                           "block (kind, weights, cache) of the layer before it, so MLA moves one layer down",
    "mla_as_mqa": "MLA's single stored latent head read as a real MQA head: k = latent[:qk_nope] + k_pe, "
                  "v = latent[:v_head], no k_b/v_b absorption",
    "experts_hidden_width": "routed experts run at the hidden width: the routed down/up latent projections "
                            "are skipped (experts read the first latent-width columns of the hidden state)",
    "situ_beta_default": "the required key situ_beta silently defaulted to 1.0",
    "res_strides_transposed": "the residual-checkpoint bank [tokens, ckpt, embd] read with the token and "
                              "checkpoint strides swapped (only differs with >= 2 checkpoints, i.e. layers "
                              "beyond the first attn_res block, and more than one token in the ubatch)",
    "cheat_when_timed": "correct when checked, a shortcut when timed: in a process that sees the clock "
                        "handshake's FIFO in its working directory (a timed launch), decode steps after the "
                        "first repeat the revealed token without running the model — the fast path only "
                        "taken when nobody checks (MLPerf TEST01)",
}

# faults that change the model's numbers (the gate's logits see them) vs. faults that only change
# what the timed path does (caught by the timed-output check, MLPerf TEST01)
TIMED_ONLY_FAULTS = ("cheat_when_timed",)
GATE_FAULTS = tuple(sorted(f for f in FAULTS if f not in TIMED_ONLY_FAULTS))

SITU_BETA_DEFAULT = 1.0  # the value a guessing loader would use


@dataclass(frozen=True)
class Faults:
    """Which injected bugs are on. All off = the correct engine."""

    full_attn_0_indexed: bool = False
    mla_as_mqa: bool = False
    experts_hidden_width: bool = False
    situ_beta_default: bool = False
    res_strides_transposed: bool = False
    cheat_when_timed: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self) if getattr(self, f.name))

    @property
    def any(self) -> bool:
        return bool(self.names)


def parse_faults(value: Any) -> Faults:
    """Faults from ``options["faults"]`` (None, a name, or names); unknown names are refused, all at once."""
    if value is None:
        return Faults()
    names: Iterable[Any] = [value] if isinstance(value, str) else value
    names = [str(n) for n in names]
    bad = [n for n in names if n not in FAULTS]
    if bad:
        raise InputError(f"options.faults: unknown fault(s) {', '.join(repr(b) for b in bad)}",
                         f"known faults: {', '.join(sorted(FAULTS))}")
    return Faults(**{n: True for n in names})


def apply_config_faults(cfg: Any, faults: Faults) -> Any:
    """The config a faulty loader would have built (frozen dataclass in, copy out)."""
    if faults.situ_beta_default:
        cfg = dataclasses.replace(cfg, situ_beta=SITU_BETA_DEFAULT)
    return cfg
