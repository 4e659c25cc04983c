"""Locks whose k3-mini-cpu target names another candidate engine (a plugin), for plugin tests."""

from __future__ import annotations

from pathlib import Path

import tomlkit
from receipt_factory import zero_slots

from scoreboard.lockfile import load_lock

REPO = Path(__file__).resolve().parent.parent
TARGET = "k3-mini-cpu"


def lock_for_engine(path: Path, engine: str, target: str = TARGET, **target_keys) -> Path:
    """The repository's lock with a fresh history, `target`'s candidate_engine set to `engine` (its old candidate's
    slots dropped: slot names carry the engine) and `target_keys` set on the target; written to `path`."""
    doc = zero_slots(tomlkit.parse((REPO / "reference.lock").read_text()))
    t = doc["targets"][target]
    old = load_lock(REPO / "reference.lock").target(target)
    for m in old.metrics:
        doc["slots"].pop(old.slot(old.candidate_engine, m), None)
    t["candidate_engine"] = engine
    for k, v in target_keys.items():
        t[k] = v
    path.write_text(tomlkit.dumps(doc))
    load_lock(path)
    return path
