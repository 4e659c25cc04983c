"""Field-by-field differences of two nested mappings, named by dotted path (`gate.kl_max: 0.001 -> 0.002`):
what a calibration's changed target definition and an engine's changed identity both report."""

from __future__ import annotations

import json
from typing import Any, Mapping


def flatten(obj: Any, path: str = "") -> dict[str, Any]:
    """{dotted.path: JSON of the leaf} of nested mappings."""
    if isinstance(obj, Mapping):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(flatten(v, f"{path}.{k}" if path else str(k)))
        return out
    return {path: json.dumps(obj, sort_keys=True)}


def changes(then: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """`path: old -> new` for every leaf that differs, in path order (`(absent)` for a missing one)."""
    a, b = flatten(then), flatten(now)
    return [f"{k}: {a.get(k, '(absent)')} -> {b.get(k, '(absent)')}" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]
