"""Engine discovery: entry point group ``scoreboard.engines``, loaded lazily by name.

Built-ins use the same path as third-party plugins. Tests inject engines with :func:`inject`, which
adds entries to the same table the entry points fill. A worker process never reads this table: the parent
resolves the engine to its "module:attr" (:func:`entry_point`) and the worker request carries it, so an
engine injected as a spec whose module sits in an arm's engines/ runs in that arm's workers too.
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Callable

from .engine import Engine
from .errors import InputError

if TYPE_CHECKING:
    from pydantic import BaseModel

GROUP = "scoreboard.engines"
_injected: dict[str, Callable[[], Engine] | str] = {}
_injected_options: dict[str, tuple[type, type]] = {}


def _table() -> dict[str, str | Callable[[], Engine]]:
    table: dict[str, str | Callable[[], Engine]] = {ep.name: ep.value for ep in entry_points(group=GROUP)}
    table.update(_injected)
    return table


@dataclass(frozen=True)
class Registered:
    """One engine the table holds, and who put it there."""

    name: str
    spec: str  # "module:attr"; "" for an injected factory
    distribution: str  # the installed distribution whose entry point registers it; "(injected)" for tests
    version: str


def registered() -> list[Registered]:
    """Every engine in the table, sorted by name: entry points with their distribution, then injected ones."""
    out: dict[str, Registered] = {}
    for ep in entry_points(group=GROUP):
        dist = getattr(ep, "dist", None)
        out[ep.name] = Registered(ep.name, ep.value, dist.metadata["Name"] if dist else "",
                                  dist.version if dist else "")
    for name, spec in _injected.items():
        out[name] = Registered(name, spec if isinstance(spec, str) else "", "(injected)", "")
    return [out[k] for k in sorted(out)]


def available() -> list[str]:
    """Engine ids that can be loaded, sorted."""
    return sorted(_table())


def inject(name: str, factory: Callable[[], Engine] | str) -> None:
    """Register an engine under `name` (a factory, or a "module:attr" spec) — used by tests."""
    _injected[name] = factory


def uninject(name: str) -> None:
    _injected.pop(name, None)
    _injected_options.pop(name, None)


def inject_options(name: str, lock_model: type, full_model: type | None = None) -> None:
    """Typed options for an injected engine (tests): see :func:`options_models`."""
    _injected_options[name] = (lock_model, full_model or lock_model)


def options_models(name: str) -> tuple[type[BaseModel], type[BaseModel]] | None:
    """(what a lock may set, what the engine reads) for engine `name`, as pydantic models; None when unknown.

    An engine declares them in the module ``options`` beside its entry point's module (``engines.sparkinfer.options``
    for ``engines.sparkinfer.engine:SparkInferEngine``) as ``LockOptions`` and ``Options``; that module must not
    import torch or the engine itself, because the harness's own process imports it (a round's input check). An engine without such a module accepts
    no options. Unknown engines and engines that cannot be imported give None (preflight reports them).
    """
    if name in _injected_options:
        return _injected_options[name]
    spec = _table().get(name)
    if spec is None or callable(spec):
        return None
    module = spec.partition(":")[0].rpartition(".")[0] + ".options"
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module.startswith(exc.name):  # the engine has no options module
            from pydantic import BaseModel, ConfigDict

            class NoOptions(BaseModel):
                model_config = ConfigDict(extra="forbid")

            return NoOptions, NoOptions
        return None
    except ImportError:
        return None
    lock_model: type[BaseModel] | None = getattr(mod, "LockOptions", None)
    if lock_model is None:
        return None
    full_model: type[BaseModel] = getattr(mod, "Options", lock_model)
    return lock_model, full_model


def option_problems(engine: str, options: dict[str, Any], path: str, in_lock: bool = True) -> list[str] | None:
    """Problems of `options` for `engine` through its typed options model, each prefixed with `path`
    (``targets.<id>.candidate_options``); None when the engine or its model cannot be found here.

    in_lock: only what a target may pin (the engine's LockOptions); else everything the engine reads. The lock's
    loader never calls this (loading the lock loads no engine): a round checks its own target's options
    (``scoreboard.round.run.check_inputs``) before anything runs.
    """
    from pydantic import ValidationError

    models = options_models(engine)
    if models is None:
        return None
    lock_model, full_model = models
    model = lock_model if in_lock else full_model
    known = ", ".join(model.model_fields) or "none"
    problems: list[str] = []
    for name in sorted(options):
        if in_lock and name in full_model.model_fields and name not in lock_model.model_fields:
            problems.append(f"{path}.{name}: {engine} reads this option, but only tests and calibration set it "
                            f"(RoundOptions.candidate_options), never a target: remove it from the lock")
    if problems:
        return problems
    try:
        model.model_validate(dict(options))
    except ValidationError as exc:
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"])
            where = f"{path}.{where}" if where else path
            if err["type"] == "extra_forbidden":
                problems.append(f"{where}: unknown {engine} option (known: {known}); remove it or check its spelling")
            else:
                msg = err["msg"].removeprefix("Value error, ")
                problems.append(f"{where}: {msg}, got {err.get('input')!r} (engine {engine}; options: {known})")
    return problems


def load(name: str) -> Engine:
    """Instantiate the engine registered as `name`; unknown names get a did-you-mean."""
    spec = _lookup(name)
    return _check(name, spec, spec()) if callable(spec) else load_entry_point(name, spec)


def entry_point(name: str) -> str:
    """The "module:attr" that engine `name` resolves to here, for a worker process to import: the parent
    resolves, the worker imports exactly that (an injected engine reaches the worker this way too, as long
    as its module is on the worker's import path, e.g. an arm's engines/)."""
    spec = _lookup(name)
    if callable(spec):
        raise InputError(f"engine {name!r} is injected as a factory, which no worker process can import",
                         f"inject it as a \"module:attr\" spec: registry.inject({name!r}, \"engines.x.engine:X\")")
    return spec


def load_entry_point(name: str, spec: str) -> Engine:
    """Instantiate engine `name` from its "module:attr" spec (what :func:`entry_point` gave)."""
    module, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except ImportError as exc:
        raise InputError(
            f"engine {name!r} could not be imported ({spec}): {exc}",
            "install its extra, e.g. `pip install -e '.[sparkinfer]'`",
        ) from exc
    return _check(name, spec, obj())


def _lookup(name: str) -> str | Callable[[], Engine]:
    table = _table()
    if name not in table:
        close = difflib.get_close_matches(name, table, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known engines: {', '.join(sorted(table)) or 'none'}"
        raise InputError(f"unknown engine {name!r}", f"{hint} (engines register under entry point group {GROUP!r})")
    return table[name]


def _check(name: str, spec: object, engine: object) -> Engine:
    if not isinstance(engine, Engine):
        raise InputError(f"engine {name!r} ({spec}) is not a scoreboard.engine.Engine")
    return engine
