"""The ONE derivation of slot names from their axes: the lock's loader, the writer and every reader call this.

It sits at the top level, beside the lock it names, so that loading the lock loads nothing of the history.
"""

from __future__ import annotations

import re

_CLEAN = re.compile(r"[^A-Z0-9]+")


def _axis(value: str) -> str:
    return _CLEAN.sub("_", value.upper()).strip("_")


def quant_axis(quant: str) -> str:
    """`UD-IQ1_S` -> `IQ1S`, `Q8_0` -> `Q80`, `F16` -> `F16`."""
    q = quant.upper()
    if q.startswith("UD-"):
        q = q[3:]
    return re.sub(r"[^A-Z0-9]", "", q)


def ctx_axis(tokens: int) -> str:
    """131072 -> `128K`, 1048576 -> `1M`, 512 -> `512`, 0 -> `0`."""
    if tokens < 0:
        raise ValueError("context must be >= 0")
    if tokens and tokens % (1 << 20) == 0:
        return f"{tokens >> 20}M"
    if tokens and tokens % 1024 == 0:
        return f"{tokens >> 10}K"
    return str(tokens)


def slot_name(model: str, node: str, quant: str, engine: str, phase: str, ctx: int) -> str:
    """`<MODEL>_<NODE>_<QUANT>_<ENGINE>_<PHASE>_<CTX>`, e.g. KIMI_K3_H200X8_IQ1S_LLAMACPP_DECODE_128K.

    ctx is the depth for decode and the prompt length for prefill.
    """
    if phase not in ("decode", "prefill"):
        raise ValueError(f"phase must be decode or prefill, not {phase!r}")
    return "_".join([_axis(model), _axis(node), quant_axis(quant), _axis(engine), phase.upper(), ctx_axis(ctx)])
