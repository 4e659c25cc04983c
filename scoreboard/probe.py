"""An engine's entry point, checked in a fresh interpreter: it imports, resolves to an Engine, instantiates, and
answers its optional calibration hook.

The check runs in a subprocess (the worker's interpreter and environment, or this process's own for
`scoreboard engines`), never in the harness's process: a plugin that fails to import, hangs or crashes takes only
its own check down, and a candidate's code never runs beside the harness. The parent reads one marked JSON line
from the child's stdout and trusts nothing else it prints.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from .engine import CalibrationSuite
from .errors import InputError

PROBE_TIMEOUT_S = 180.0
MARK = "SBENTRY"
_EMPTY = tempfile.TemporaryDirectory(prefix="sb-probe-")  # removed when this process exits

_SCRIPT = """\
import importlib, json, sys
req = json.loads(sys.argv[1])
sys.path[:0] = req["paths"]  # an arm's exported package first, as the worker puts it (scoreboard.worker.serve)
out = {"ok": False, "stage": "", "error": "", "engine_class": "", "calibration": None}
def fail(stage, exc):
    out.update(stage=stage, error=exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}")
def run():
    for mod in req["first"]:
        try:
            importlib.import_module(mod)
        except BaseException as exc:
            return fail(f"import {mod}", exc)
    module, _, attr = req["spec"].partition(":")
    try:
        obj = importlib.import_module(module)
    except BaseException as exc:
        return fail(f"import {module}", exc)
    try:
        for part in attr.split("."):
            obj = getattr(obj, part)
    except BaseException as exc:
        return fail(f"resolve {req['spec']}", exc)
    try:
        engine = obj()
    except BaseException as exc:
        return fail(f"instantiate {req['spec']}", exc)
    from scoreboard.engine import Engine
    cls = type(engine)
    out["engine_class"] = f"{cls.__module__}.{cls.__qualname__}"
    if not isinstance(engine, Engine):
        return fail("check", f"{req['spec']} is a {out['engine_class']}, not a scoreboard.engine.Engine")
    if engine.name != req["name"]:
        return fail("check", f"{out['engine_class']}.name is {engine.name!r}, but the entry point registers it as "
                             f"{req['name']!r}: receipts and the lock name an engine by one id")
    if req["device"]:
        try:
            suite = engine.calibration(req["device"])
            if suite is not None:
                from dataclasses import asdict
                out["calibration"] = json.loads(json.dumps(asdict(suite)))
        except BaseException as exc:
            return fail("calibration hook", exc)
    out["ok"] = True
run()
print("MARK" + json.dumps(out))
""".replace("MARK", MARK)


@dataclass(frozen=True)
class EntryCheck:
    """What the fresh interpreter found for one engine's entry point."""

    name: str
    spec: str  # "module:attr"
    ok: bool
    error: str = ""  # why not: "<stage>: <exception>" (stage: import X, resolve, instantiate, check, ...)
    engine_class: str = ""  # module.qualname of what the entry point made
    calibration: CalibrationSuite | None = None  # the engine's own calibration additions (asked with a device)
    distribution: str = ""  # the installed distribution that registers it ("" unknown or injected)
    version: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "entry_point": self.spec, "ok": self.ok, "error": self.error,
                "engine_class": self.engine_class, "distribution": self.distribution, "version": self.version}


Launcher = Callable[[list[str]], tuple[list[str], dict[str, str] | None]]  # argv -> (argv, env) that runs it


def check_entry(name: str, spec: str, python: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
                device: str = "", first: Sequence[str] = (), timeout_s: float = PROBE_TIMEOUT_S,
                paths: Sequence[str] = (), launcher: Launcher | None = None) -> EntryCheck:
    """Check engine `name`'s entry point `spec` in a fresh `python` (default: this interpreter) with `env` (default:
    this process's), `paths` first on its import path: the modules `first` import, then the entry point imports,
    resolves, instantiates to an Engine named `name`; with `device`, its calibration hook answers for that device.
    `launcher` wraps the command (a sandbox: it then gives the environment too)."""
    proc = start(name, spec, python, env, device, first, paths, launcher)
    return finish(name, spec, proc, timeout_s)


def check_entries(entries: Sequence[tuple[str, str]], python: Sequence[str] | None = None,
                  env: Mapping[str, str] | None = None, timeout_s: float = PROBE_TIMEOUT_S) -> list[EntryCheck]:
    """Every (name, spec), each in its own interpreter, all at once."""
    procs = [(name, spec, start(name, spec, python, env, "", ())) for name, spec in entries]
    return [finish(name, spec, proc, timeout_s) for name, spec, proc in procs]


def start(name: str, spec: str, python: Sequence[str] | None, env: Mapping[str, str] | None, device: str,
          first: Sequence[str], paths: Sequence[str] = (), launcher: Launcher | None = None,
          ) -> subprocess.Popen[str] | str:
    """The child process (or, when it could not start, why)."""
    req = json.dumps({"name": name, "spec": spec, "device": device, "first": list(first), "paths": list(paths)})
    argv = [*(python or [sys.executable]), "-c", _SCRIPT, req]
    run_env = dict(env) if env else None
    if launcher is not None:
        argv, run_env = launcher(argv)
    try:  # in an empty directory (a sandbox: its own): `python -c` puts its working directory first on sys.path
        return subprocess.Popen(argv, env=run_env, cwd=_EMPTY.name, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
    except OSError as exc:
        return f"the interpreter did not start: {exc}"


def finish(name: str, spec: str, proc: subprocess.Popen[str] | str, timeout_s: float) -> EntryCheck:
    if isinstance(proc, str):
        return EntryCheck(name, spec, False, proc)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return EntryCheck(name, spec, False, f"the check did not finish within {timeout_s:.0f} s (an import that "
                                             "hangs?)")
    line = next((ln for ln in reversed(stdout.splitlines()) if ln.startswith(MARK)), None)
    if line is None:
        tail = " | ".join((stderr or stdout).strip().splitlines()[-3:])
        return EntryCheck(name, spec, False, f"the interpreter exited {proc.returncode} before reporting: {tail}")
    out = json.loads(line[len(MARK):])
    error = f"{out['stage']}: {out['error']}" if not out["ok"] else ""
    suite, bad = _suite(out.get("calibration"))
    if bad:
        return EntryCheck(name, spec, False, f"calibration hook: {bad}", out["engine_class"])
    return EntryCheck(name, spec, bool(out["ok"]), error, out["engine_class"], suite)


def _suite(data: Any) -> tuple[CalibrationSuite | None, str]:
    """The hook's answer as a CalibrationSuite, or why it is not one."""
    if data is None:
        return None, ""
    faults, precisions = data.get("faults"), data.get("precisions")
    if not isinstance(faults, dict) or not all(isinstance(k, str) and isinstance(v, dict) for k, v in faults.items()):
        return None, "CalibrationSuite.faults must map names to option tables, e.g. {'my_bug': {'my_bug': True}}"
    bad_names = [k for k in faults if not k or not all(c.isalnum() or c in "._-" for c in k)]
    if bad_names:
        return None, f"CalibrationSuite.faults: names {bad_names} (use letters, digits, '.', '_', '-')"
    if precisions is not None and not (isinstance(precisions, list) and len(precisions) == 2
                                       and all(isinstance(p, dict) for p in precisions) and precisions[0] != precisions[1]):
        return None, "CalibrationSuite.precisions must be two different option tables (precise, coarse), or None"
    pair = (precisions[0], precisions[1]) if precisions is not None else None
    return CalibrationSuite(faults=dict(faults), precisions=pair), ""


def require(check: EntryCheck, who: str, hint: str) -> EntryCheck:
    """`check` when it is ok, else an InputError naming the engine, its entry point and what failed."""
    if check.ok:
        return check
    raise InputError(f"{who}: engine {check.name!r} ({check.spec}) is broken: {check.error}", hint)
