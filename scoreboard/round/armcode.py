"""The engine code a candidate-side arm runs: its entry point and import path, and the check, in a fresh
interpreter started the way the arm's workers are, that the entry point loads before anything of the round runs.

An arm of this harness's repository runs the entry point the registry resolves (its module in the arm's
`engines/`); a plugin arm (`--engine-repo`) runs the one its own pyproject.toml declares at the arm's commit,
with its exported package first on the import path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .. import probe, registry
from ..errors import InputError
from .candidate import CandidateSource, Origin, import_root

WORKER_MODULE = "scoreboard.worker.serve"  # imported first: the harness's own worker must load beside the engine
CANDIDATE_FIX = ("this is the candidate's own code: fix the candidate (its entry point must import, resolve to a "
                 "scoreboard.engine.Engine subclass whose `name` is the engine id, and instantiate)")
HARNESS_FIX = ("reinstall the engine's package (`pip install -e PATH`), or fix the entry point it declares under "
               "[project.entry-points.\"scoreboard.engines\"]; `scoreboard engines` checks every one; nothing was "
               "run or written")


def entry_point(engine: str, source: CandidateSource | None) -> str:
    """The "module:attr" this arm's workers import for `engine`."""
    if source is not None and source.plugin is not None:
        return source.plugin.entry_point
    return registry.entry_point(engine)


def import_paths(source: CandidateSource | None) -> tuple[Path, ...]:
    return source.import_paths() if source is not None else ()


def installed_elsewhere(engine: str) -> str | None:
    """The module of `engine`'s registered entry point when it lives outside this harness's `engines/` (an
    installed plugin: the same installed copy would run in every arm of a round of this repository), else None."""
    spec = registry._table().get(engine)
    module = spec.partition(":")[0] if isinstance(spec, str) else ""
    return module if module and module != "engines" and not module.startswith("engines.") else None


def check(engine: str, source: CandidateSource, cache_dir: Path, extra_env: dict[str, str] | None, who: str,
          candidate: bool = False, device: str = "") -> probe.EntryCheck:
    """The arm's entry point, imported, resolved and instantiated in the arm's own worker environment (PYTHONPATH:
    its import paths, its engines/, the harness); InputError naming the arm, the engine and what failed. With
    `device`, the engine's calibration hook answers too (EntryCheck.calibration)."""
    from .ready import worker_launch

    spec = entry_point(engine, source)
    python, env = worker_launch(import_root(source, cache_dir), extra_env)
    first = [str(p) for p in import_paths(source)]
    if first:
        env = {**env, "PYTHONPATH": os.pathsep.join([*first, env.get("PYTHONPATH", "")])}
    got = probe.check_entry(engine, spec, python, env, device=device, first=[WORKER_MODULE])
    if got.ok:
        return got
    raise InputError(f"the {who} arm's engine {engine!r} ({spec}) cannot run: {got.error}",
                     CANDIDATE_FIX if candidate else HARNESS_FIX)


def repo_record(where: Origin, sources: dict[str, CandidateSource]) -> dict[str, Any]:
    """A plugin round's provenance.engine_repo: the plugin's repository (path, remote URL) and, per arm, the commit,
    the entry point its pyproject.toml declared there and the package exported with its tree hash (a list: an arm
    name is never a key, and "frontier" is a verdict field's name)."""
    arms = [{"arm": name, "commit": s.commit, "entry_point": s.plugin.entry_point, "package": s.plugin.package,
             "package_tree": s.engines_tree} for name, s in sources.items() if s.plugin is not None]
    url = next((s.plugin.url for s in sources.values() if s.plugin is not None), "")
    return {"path": str(where.repo), "url": url, "engine": where.engine, "arms": arms}
