"""sparkinfer's typed options: what a target in reference.lock may set, and what the engine reads.

Torch-free on purpose: the lock loader imports this module (through ``scoreboard.registry.options_models``)
to validate ``targets.<id>.candidate_options`` without loading torch.

Two models:

* :class:`LockOptions` — the options a target pins (they change what is measured: dtype, CUDA graphs).
* :class:`Options` — LockOptions plus ``faults``, the named bugs that tests and calibration inject through
  ``RoundOptions.candidate_options``. Faults are never part of a target: a lock that sets them is refused.

Both refuse unknown keys and mistyped values (strict: ``cuda_graph = "yes"`` or ``dtype = 16`` are errors).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")


class LockOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    # weights and matmuls; norms, softmaxes, router and recurrent state stay float32
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = "float32"
    # decode through a captured CUDA graph; None = the engine default (true on cuda); true on cpu is refused
    cuda_graph: bool | None = None


class Options(LockOptions):
    faults: tuple[str, ...] = Field(default=(), strict=False)  # a list from JSON/TOML is accepted

    @field_validator("faults", mode="before")
    @classmethod
    def _faults(cls, v: Any) -> Any:
        if v is None:
            return ()
        if isinstance(v, str):
            return (v,)
        return v

    @field_validator("faults")
    @classmethod
    def _known(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        from .faults import FAULTS  # torch-free

        bad = [n for n in v if n not in FAULTS]
        if bad:
            raise ValueError(f"unknown fault(s) {bad}; known: {sorted(FAULTS)}")
        return v


def parse(options: dict[str, Any] | None, where: str = "options") -> Options:
    """The engine-side parse of ``EngineTarget.options``: unknown or mistyped options are refused here too
    (the harness validated them against this engine's models already; a candidate's own engine checks again)."""
    from scoreboard.errors import EngineError

    try:
        return Options.model_validate(dict(options or {}))
    except ValidationError as exc:
        err = exc.errors()[0]
        name = ".".join(str(p) for p in err["loc"])
        raise EngineError(f"{where}.{name}: {err['msg']} (got {err.get('input')!r})",
                          f"sparkinfer options: {', '.join(Options.model_fields)}") from None
