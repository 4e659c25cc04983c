"""llamacpp's typed options: what ``EngineTarget.options`` may carry, and what the engine reads.

Torch-free and engine-free on purpose: the lock loader imports this module (through
``scoreboard.registry.options_models``) to validate a target's ``candidate_options``.

Two models:

* :class:`LockOptions` — what a target may pin in reference.lock: nothing. The reference's settings come from
  the target's own fields (``reference``, ``parallel.reference_split_mode``), never from free options.
* :class:`Options` — what the engine reads, set by the round (``reference_id``, ``split_mode``,
  ``visible_devices``, ``reference_source``) or by tests and bench scripts (the rest).

Unknown keys and mistyped values are refused with their path (``options.<name>``), all at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator

SPLIT_MODES = ("none", "layer", "row")  # llama.cpp's -sm
FLASH_ATTN = (1, 0, -1)  # llama.cpp's -fa: on, off, auto


class LockOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Options(LockOptions):
    reference_id: str = "<id>"  # the lock's reference id, for error paths
    cache_dir: Path | None = None  # describe only (prepare gets its own); None: the harness's cache rule
    flash_attn: int = 1
    n_gpu_layers: int | None = None  # None: 99 on cuda, 0 on cpu
    split_mode: str = "layer"  # over the visible GPUs: the lock's parallel.reference_split_mode
    visible_devices: str = ""  # CUDA_VISIBLE_DEVICES for the tool runs (the round: the candidate's GPUs)
    timeout_s: float | None = None  # per tool run
    pip_args: tuple[str, ...] | None = None  # for the sdist download; None: $SCOREBOARD_PIP_ARGS
    reference_source: str | None = None  # a transport for the pinned source; None: $SCOREBOARD_REFERENCE_SOURCE

    @field_validator("flash_attn", "split_mode")
    @classmethod
    def _one_of(cls, v: Any, info: ValidationInfo) -> Any:
        allowed, words = {"flash_attn": (FLASH_ATTN, "1, 0 or -1"),
                          "split_mode": (SPLIT_MODES, "none, layer or row")}[info.field_name or ""]
        if v not in allowed:
            raise ValueError(f"must be {words}, not {v!r}")
        return v


HINTS = {"split_mode": "set parallel.reference_split_mode in the target"}


def parse(options: dict[str, Any] | None, where: str = "options") -> Options:
    """The engine-side parse of ``EngineTarget.options``; InputError naming every bad option by its path."""
    from scoreboard.errors import InputError

    try:
        return Options.model_validate(dict(options or {}))
    except ValidationError as exc:
        lines, hints = [], []
        for err in exc.errors():
            name = ".".join(str(p) for p in err["loc"])
            if err["type"] == "value_error":  # our own checks: "<path> must be ..., not <value>"
                lines.append(f"{where}.{name} {err['msg'].removeprefix('Value error, ')}")
            else:
                lines.append(f"{where}.{name}: {err['msg']} (got {err.get('input')!r})")
            hints.append(HINTS.get(name, ""))
        hint = next((h for h in hints if h), f"llamacpp options: {', '.join(Options.model_fields)}")
        raise InputError("; ".join(lines), hint) from None
