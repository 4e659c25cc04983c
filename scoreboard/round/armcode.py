"""The engine code a candidate-side arm runs: its entry point and import path, and the check, in a fresh
interpreter started the way the arm's workers are, that the entry point loads before anything of the round runs.

An arm of this harness's repository runs the entry point the registry resolves (its module in the arm's
`engines/`); a plugin arm (`--engine-repo`) runs the one its own pyproject.toml declares at the arm's commit,
with its exported package first on the import path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import probe, registry
from ..errors import InputError
from .candidate import HARNESS_ROOT, CandidateSource, Origin, import_root

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
          candidate: bool = False, device: str = "", isolation: str = "none", scratch: Path | None = None,
          target_device: str = "cpu") -> probe.EntryCheck | None:
    """The arm's entry point, imported, resolved and instantiated in a fresh interpreter started as the arm's workers
    are: inside the sandbox when `isolation` is "bwrap" (the arm's code never runs outside it, not even to be
    checked), else with the worker's plain environment; its import paths first, then its engines/ and the harness.
    InputError naming the arm, the engine and what failed. With `device`, the engine's calibration hook answers too
    (EntryCheck.calibration). None when the sandbox cannot start here: nothing is checked, because preflight
    refuses the round (sandbox.check, recorded) before any engine runs."""
    from . import sandbox
    from .ready import worker_launch

    if isolation == "bwrap" and not _sandbox_usable():
        return None

    spec = entry_point(engine, source)
    root = import_root(source, cache_dir)
    with worker_launch(root, extra_env) as (python, env):  # plain values: nothing to hold open
        pass
    paths = [str(p) for p in import_paths(source)]
    launcher = None
    boxes: list[sandbox.Launch] = []  # each closed (its cgroup removed) once the probe has ended
    own_root = sandbox.new_scratch_root() if isolation == "bwrap" and scratch is None else None
    base = scratch if scratch is not None else own_root
    if isolation == "bwrap" and base is not None:
        launch_dir = sandbox.new_launch_dir(base)  # in the round's scratch (or a root of its own, removed after)

        def launcher(argv: list[str]) -> tuple[list[str], dict[str, str] | None]:
            box = sandbox.launch(argv, mode="bwrap", engines_dir=root / "engines", harness_pkg=HARNESS_ROOT / "scoreboard",
                                 scratch=launch_dir, read_only=list(import_paths(source)), device=target_device,
                                 env=extra_env)
            boxes.append(box)
            return box.argv, box.env
    try:
        got = probe.check_entry(engine, spec, python, env, device=device, first=[WORKER_MODULE], paths=paths,
                                launcher=launcher)
    finally:
        for box in boxes:
            box.close()
        sandbox.remove_tree(own_root)
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


def _sandbox_usable() -> bool:
    from ..errors import InputError
    from .sandbox import check as sandbox_check

    try:
        sandbox_check("bwrap")
    except InputError:
        return False
    return True
