"""Shared by the bench scripts: named sections whose results (or errors) are collected, never lost."""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path
from typing import Any, Callable

RESULTS: dict[str, Any] = {}
SAVE_TO: list[Path] = []  # when set, RESULTS is rewritten there after every section


def section(name: str) -> Callable:
    """Run the decorated function as section `name`: its return value, or its error with a traceback, goes
    into RESULTS[name], its seconds into RESULTS["seconds"]; one failure does not stop the script."""
    def wrap(fn: Callable) -> Callable:
        def run(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                RESULTS[name] = fn(*a, **k)
            except Exception as exc:  # record and go on: one failure must not lose the rest
                RESULTS[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
            RESULTS.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)
            print(f"== {name}: {json.dumps(RESULTS[name], default=str)[:2000]}", flush=True)
            for path in SAVE_TO:
                path.write_text(json.dumps(RESULTS, indent=1, default=str))
            return RESULTS[name]
        return run
    return wrap
