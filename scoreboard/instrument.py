"""The calibration's instrument, and what a candidate engine adds to it.

A target's gate bars are a property of the target (its workload, its reference, its bars), so they are calibrated
with one instrument whatever engine the target's candidate is: the bundled sparkinfer engine of this harness,
with its injected faults (engines/sparkinfer/faults.py, GATE_FAULTS) and its two precisions (the `dtype` option).
Its options are the target's `candidate_options` when sparkinfer is the candidate, else the target's
`instrument_options`. Every candidate engine relies on the record that instrument made.

An engine may add faults and precisions of its own (scoreboard.engine.CalibrationSuite, returned by the optional
Engine.calibration hook, asked in a fresh interpreter by scoreboard.probe): when it is the target's candidate,
`scoreboard gate calibrate` measures those too, with the engine's own code (its --engine-repo main, or this
repository's engines/), each held to the same margin.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .engine import CalibrationSuite
from .errors import InputError
from .lockfile import Lock, Target

INSTRUMENT = "sparkinfer"  # the bundled engine whose faults and precisions calibrate every target's bars


def instrument_options(target: Target) -> dict[str, Any]:
    """The instrument's options for this target: its candidate's when the candidate is the instrument."""
    return dict(target.candidate_options if target.candidate_engine == INSTRUMENT else target.instrument_options)


def option_problems(target_id: str, target: Target) -> list[str]:
    """What is wrong with the target's instrument_options (checked against sparkinfer's LockOptions)."""
    from . import registry

    where = f"targets.{target_id}.instrument_options"
    if target.candidate_engine == INSTRUMENT and target.instrument_options:
        return [f"{where}: the candidate engine is the instrument ({INSTRUMENT}), whose options are the target's "
                "candidate_options: remove instrument_options"]
    got = registry.option_problems(INSTRUMENT, target.instrument_options, where)
    if got is None:
        return [f"{where}: the instrument {INSTRUMENT!r} or its typed options could not be loaded (install the "
                "harness with its engines: `pip install -e '.[sparkinfer]'`)"]
    return got


def instrument_view(lock: Lock, target_id: str) -> Lock:
    """The lock as the instrument's workers see it: the target's candidate is the instrument, at its options."""
    t = lock.target(target_id)
    problems = option_problems(target_id, t)
    if problems:
        from .errors import LockError

        raise LockError(problems, hint="fix instrument_options in the lock, then `scoreboard gate calibrate "
                                       f"{target_id}`")
    view = t.model_copy(update={"candidate_engine": INSTRUMENT, "candidate_options": instrument_options(t),
                                "instrument_options": {}})
    return lock.model_copy(update={"targets": {**lock.targets, target_id: view}})


def instrument_faults() -> tuple[str, ...]:
    """The instrument's injected bugs that change the gate's logits (the timed-only ones are the speed stage's)."""
    from engines.sparkinfer.faults import GATE_FAULTS  # plain names, no torch import

    return tuple(GATE_FAULTS)


# ----------------------------------------------------------------------------------------------
# a candidate engine's own additions

@dataclass(frozen=True)
class EngineSuite:
    """The candidate engine's calibration additions, and where its code comes from."""

    engine: str
    source: Any  # scoreboard.round.candidate.CandidateSource of the engine's code
    suite: CalibrationSuite | None  # None: the engine declares none (or is not measured: see note)
    note: str = ""  # why nothing of the engine's own was measured
    arms: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (arm name, extra options)

    def record(self) -> dict[str, Any]:
        """The calibration record's `engine` section (its arms' numbers are in each run)."""
        out: dict[str, Any] = {"engine": self.engine, "measured": bool(self.arms), "note": self.note}
        s = self.source
        if s is not None:
            out["source"] = {"label": s.label, "commit": s.commit, "dirty": s.dirty, "kind": s.kind}
            if s.plugin is not None:
                out["source"] |= {"repo": str(s.plugin.repo), "url": s.plugin.url,
                                  "entry_point": s.plugin.entry_point, "package": s.plugin.package}
        if self.suite is not None:
            out["faults"] = sorted(self.suite.faults)
            out["precisions"] = None if self.suite.precisions is None else {
                "precise": self.suite.precisions[0], "coarse": self.suite.precisions[1]}
        return out


def fault_arm(engine: str, name: str) -> str:
    """The record's name of an engine's own fault: `<engine>:<fault>` (the instrument's are bare names)."""
    return f"{engine}:{name}"


def suite_arms(engine: str, suite: CalibrationSuite) -> list[tuple[str, dict[str, Any]]]:
    """(arm name, the options it merges over the target's candidate_options) for each of the engine's additions."""
    arms = [(f"fault:{fault_arm(engine, n)}", dict(opts)) for n, opts in sorted(suite.faults.items())]
    if suite.precisions is not None:
        arms += [("engine_precise", dict(suite.precisions[0])), ("engine_coarse", dict(suite.precisions[1]))]
    return arms


def check_suite_options(engine: str, target_id: str, base: Mapping[str, Any],
                        arms: list[tuple[str, dict[str, Any]]]) -> None:
    """Every arm's options, merged over the target's, through the engine's typed options (InputError naming the
    arm before anything is measured)."""
    from . import registry

    for name, extra in arms:
        problems = registry.option_problems(engine, {**base, **extra}, f"{engine}.calibration({name})", in_lock=False)
        if problems:
            raise InputError(f"the {engine} engine's calibration suite: arm {name}: " + "; ".join(problems),
                             f"fix {engine}'s Engine.calibration hook: every fault and precision is a set of its own "
                             f"options (targets.{target_id}.candidate_options are merged under them)")


def engine_source(engine: str, engine_repo: Path | None, scratch: Path, main_branch: str, instrument_src: Any,
                  ) -> tuple[Any, str]:
    """(where the candidate engine's code comes from, a note when it cannot be measured): --engine-repo's main, or
    this repository's engines/ (the instrument's own export) when the engine lives there."""
    from .round import armcode
    from .round import candidate as cand_mod

    if engine_repo is not None:
        origin = cand_mod.Origin(cand_mod.plugin_repo(engine_repo), engine)
        return origin.resolve("main", scratch, main_branch), ""
    outside = armcode.installed_elsewhere(engine)
    if outside:
        return None, (f"not measured: {engine} is installed ({outside}), not part of this repository's engines/; "
                      "pass --engine-repo PATH to measure its own faults and precisions from its main")
    return instrument_src, ""
