"""Before any engine runs: everything the round needs at its end must already be usable.

A round that measures for minutes and then cannot seal loses what it measured. So before the reference or the
candidate runs, the round checks:

* the signing library (``cryptography``) imports, and the signing key (``$SCOREBOARD_SIGNING_KEY``, when set)
  loads exactly as the sealing step will load it (outside the checkout, mode 0600, Ed25519);
* ``rounds/`` is (or can be created as) a writable directory on a filesystem with at least
  :data:`MIN_FREE_BYTES` free, and the lock's directory is writable when the round may raise the frontier;
* the candidate's worker can import ``scoreboard.worker.serve`` and the candidate engine's module in the worker's own
  environment (a fresh interpreter with the worker's environment: it does not inherit the parent's
  ``PYTHONPATH``), checked by :func:`probe_worker_imports` for the launch command the workers use.

Each failure is an InputError naming the path or module and the fix; nothing is written. Then
:class:`SealReserve` holds the space the seal needs until it writes. If sealing fails anyway,
:func:`save_unsealed` keeps the complete receipt (see docs/nothing-lost.md).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Mapping

from ..errors import InputError, ScoreboardError

# A receipt is a few hundred KiB at most, the ledger a line, the lock a few KiB; 64 MiB leaves room for all of
# them several times over, and a filesystem that full is about to fail other writes of the round too.
MIN_FREE_BYTES = 64 * 1024 * 1024
PROBE_TIMEOUT_S = 180.0
UNSEALED_DIR = "unsealed"  # rounds/unsealed/<round_id>.json: outside the receipt set (rounds/*.json)
# launch.prober's shape: (import root, extra env) -> a context giving (python command prefix, environment)
ProbeLaunch = Callable[[Path, "dict[str, str] | None"], ContextManager[tuple[list[str], dict[str, str]]]]


def check_signing(rounds_dir: Path) -> dict[str, Any]:
    """The signing library imports and the configured key loads as sealing will load it."""
    try:
        from cryptography.hazmat.primitives import serialization  # noqa: F401
        from cryptography.hazmat.primitives.asymmetric import ed25519  # noqa: F401
    except ImportError as exc:
        raise InputError(f"the signing library cannot be imported ({exc}): every round seals its receipt with "
                         "`cryptography`, so this round would lose what it measured at the end",
                         f"install it into this Python: `{sys.executable} -m pip install 'cryptography>=41'`") from None
    from ..history.records import _forbidden_roots
    from ..history.seal import SIGNING_KEY_ENV, load_private_key

    try:
        key = load_private_key(None, _forbidden_roots(rounds_dir))
    except ScoreboardError as exc:
        raise InputError(f"${SIGNING_KEY_ENV}: {exc.message} (checked before the round, so that sealing at its "
                         "end cannot fail)", exc.hint) from None
    except OSError as exc:
        raise InputError(f"${SIGNING_KEY_ENV}: the signing key cannot be read: {exc}",
                         f"fix its permissions (the harness's user must read it, mode 600) or unset {SIGNING_KEY_ENV}"
                         ) from None
    return {"signed": key is not None}


def _existing_ancestor(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_writable_dir(path: Path, what: str, need_bytes: int | None = None) -> dict[str, Any]:
    """`path` is, or can be created as, a writable directory with `need_bytes` (default MIN_FREE_BYTES) free;
    nothing is left behind."""
    need_bytes = MIN_FREE_BYTES if need_bytes is None else need_bytes
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise InputError(f"{path}: {what} is not a directory", "remove it or pass another directory")
    base = path if path.exists() else _existing_ancestor(path)
    if not base.is_dir():
        raise InputError(f"{path}: cannot create {what}: {base} is not a directory", "pass another directory")
    try:  # a real write (root ignores mode bits; a read-only mount or a full disk does not)
        fd, probe = tempfile.mkstemp(prefix=".sb-write-probe-", dir=base)
        try:
            os.write(fd, b"probe\n")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        raise InputError(f"{path}: {what} is not writable ({exc.strerror or exc}: probing {base})",
                         f"make {base} writable for this user, or pass another directory") from None
    free = shutil.disk_usage(base).free
    if free < need_bytes:
        raise InputError(f"{path}: {what} has {free / 2**20:.1f} MiB free, the round needs at least "
                         f"{need_bytes / 2**20:.0f} MiB to keep its receipt", f"free space on the filesystem of {base}")
    return {"path": str(path), "free_mib": round(free / 2**20, 1)}


def check_before_round(rounds_dir: Path, lock_path: Path, seal: bool, update_frontier: bool) -> dict[str, Any]:
    """Signing and storage, checked before anything runs (InputError, nothing written)."""
    if not seal:
        return {}
    out = {"signing": check_signing(rounds_dir), "rounds": check_writable_dir(rounds_dir, "the rounds directory")}
    if update_frontier:  # the frontier is written by a temp file + rename in the lock's own directory
        out["lock_dir"] = check_writable_dir(Path(lock_path).absolute().parent, "the lock's directory")
    return out


# ----------------------------------------------------------------------------------------------
# the worker's imports, in the worker's own environment

_PROBE = """\
import importlib, json, sys, traceback
out = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
        out[name] = None
    except BaseException as exc:
        out[name] = f"{type(exc).__name__}: {exc}"
        break
print("SBPROBE" + json.dumps(out))
"""


def probe_worker_imports(python: list[str], env: Mapping[str, str], modules: list[str],
                         cwd: Path | None = None, timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, str | None]:
    """Import `modules` in a fresh interpreter started the way a worker is (`python` is the command prefix that
    runs the worker's Python, e.g. [sys.executable] or a sandbox launcher around it; `env` its environment).

    Returns module -> None (imported) or the error; the probe stops at the first failure.
    """
    try:
        proc = subprocess.run([*python, "-c", _PROBE, *modules], env=dict(env), cwd=cwd, capture_output=True,
                              text=True, errors="replace", timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {modules[0] if modules else "python": f"the worker's Python did not run: {exc}"}
    for line in proc.stdout.splitlines():
        if line.startswith("SBPROBE"):
            return json.loads(line[len("SBPROBE"):])
    tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
    return {modules[0] if modules else "python": f"exit {proc.returncode} before any import: {tail}"}


@contextmanager
def worker_launch(import_root: Path, extra_env: dict[str, str] | None = None
                  ) -> Iterator[tuple[list[str], dict[str, str]]]:
    """(python command prefix, environment) of an unsandboxed worker of this import root (isolation "none", the
    tests' opt-out); a round probes through launch.prober, the sandbox its workers run in."""
    from .launch import worker_env

    yield [sys.executable], worker_env(import_root, extra_env)


def engine_module(engine: str) -> str | None:
    """The module an engine's entry point names ("engines.sparkinfer.engine"); None for injected factories."""
    from .. import registry

    spec = registry._table().get(engine)
    return spec.partition(":")[0] if isinstance(spec, str) else None


def check_worker_imports(engine: str, import_root: Path, extra_env: dict[str, str] | None, who: str,
                         launch: ProbeLaunch, candidate: bool = False) -> None:
    """Refuse when a worker for `import_root` cannot import scoreboard.worker.serve and the engine's module.

    `launch(import_root, extra_env)` is a context manager giving the (python command prefix, environment) the
    workers are started with: the round's sandbox (launch.prober), so the probe, which imports the arm's own
    code, runs under the same isolation as every other launch of it. candidate: the engine is a PR candidate's
    own code (the harness's copy already imported), so a failure is the candidate's and the round records it.
    """
    modules = ["scoreboard.worker.serve"] + [m for m in [engine_module(engine)] if m]
    with launch(import_root, extra_env) as (python, env):
        result = probe_worker_imports(python, env, modules, cwd=Path(tempfile.gettempdir()))
    bad = {m: e for m, e in result.items() if e}
    if not bad and len(result) == len(modules):
        return
    module, error = next(iter(bad.items())) if bad else (modules[-1], "not reached")
    interpreter = python[-1]  # the worker's Python (sandboxed: the last word of bwrap's and the dropper's argv)
    raise InputError(
        f"the {who} worker cannot import {module} in its own environment: {error}",
        f"the worker runs `{interpreter}` with PYTHONPATH={_pythonpath(python, env)} (it does not inherit "
        f"this process's PYTHONPATH; sandboxed, it reads only world-readable files): " + (
            "the harness's own copy of the engine imports there, so this is the candidate's own code: fix the "
            "candidate" if candidate else
            f"install the missing package into that Python (`{interpreter} -m pip install <package>`), or fix the "
            "environment variables named above; nothing was run or written"))


def _pythonpath(argv: list[str], env: Mapping[str, str]) -> str:
    """The worker's PYTHONPATH: bwrap's --setenv when sandboxed, else the plain environment's."""
    for i, a in enumerate(argv[:-2]):
        if a == "--setenv" and argv[i + 1] == "PYTHONPATH":
            return argv[i + 2]
    return env.get("PYTHONPATH", "")


# ----------------------------------------------------------------------------------------------
# a seal that fails anyway

def unsealed_places(rounds_dir: Path, cache_dir: Path) -> list[Path]:
    """Where an unsealed receipt goes, in order: beside the receipts (rounds/unsealed/, outside the receipt set
    that verify reads: rounds/*.json), the cache, the system temp dir, the user's home."""
    return [Path(rounds_dir) / UNSEALED_DIR, Path(cache_dir) / UNSEALED_DIR,
            Path(tempfile.gettempdir()) / "scoreboard-unsealed", Path.home() / "scoreboard-unsealed"]


def save_unsealed(receipt: Mapping[str, Any], rounds_dir: Path, cache_dir: Path) -> tuple[Path | None, list[str]]:
    """Write the complete unsealed receipt to the first of unsealed_places() that takes it: (its path, or None
    when none did, and why each place before it failed). Never raises for a write failure."""
    data = json.dumps(receipt, indent=1, sort_keys=True, ensure_ascii=False, default=str) + "\n"
    return keep_first(data.encode(), f"{receipt.get('round_id', 'round')}.json", unsealed_places(rounds_dir, cache_dir))


def keep_first(data: bytes, name: str, places: list[Path]) -> tuple[Path | None, list[str]]:
    """Write `data` as `name` into the first of `places` that takes it (fsynced; never over an existing file):
    (its path, or None when none did, and why each place before it failed). Never raises for a write failure."""
    failed: list[str] = []
    for d in places:
        path = d / name
        try:
            d.mkdir(parents=True, exist_ok=True)
            with open(path, "xb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            return path, failed
        except OSError as exc:
            failed.append(f"{path}: {exc.strerror or exc}")
            if path.exists() and not isinstance(exc, FileExistsError):
                path.unlink(missing_ok=True)  # a partial file is no receipt
    return None, failed


# ----------------------------------------------------------------------------------------------
# space held for the seal, from preflight until the seal writes

RESERVE_PREFIX = ".sb-seal-reserve-"
RESERVE_MIN_BYTES = 8 << 20  # a receipt is at most a few hundred KiB; the rest covers the ledger's and lock's


def seal_bytes(rounds_dir: Path, lock_path: Path) -> int:
    """What sealing writes at most at once: the receipt, the ledger rewritten whole (temp + rename) twice (its
    round line, a frontier-raise line) and the lock once (temp + rename)."""
    def size(p: Path) -> int:
        try:
            return p.stat().st_size
        except OSError:
            return 0

    return RESERVE_MIN_BYTES + 2 * size(Path(rounds_dir) / "ledger.jsonl") + 2 * size(Path(lock_path))


class SealReserve:
    """Files of zeros (allocated, not sparse) on each filesystem the seal writes to, made at preflight and
    deleted just before the seal writes: a candidate (or anything else) that fills the disk during the round
    cannot take the seal's space. Hidden names in rounds/ (or, before it exists, its nearest existing parent),
    outside the receipt set; removed however the round ends."""

    def __init__(self) -> None:
        self.paths: list[Path] = []

    def hold(self, dirs: list[Path], need: int) -> dict[str, Any]:
        """Reserve `need` bytes on the filesystem of each of `dirs` (once per filesystem); InputError when the
        space is not there (nothing left behind)."""
        devices: set[int] = set()
        for d in dirs:
            base = Path(d) if Path(d).is_dir() else _existing_ancestor(Path(d))
            dev = base.stat().st_dev
            if dev in devices:
                continue
            devices.add(dev)
            self.paths.append(_allocate(base, need))
        return {"bytes": need, "files": len(self.paths)}

    def release(self) -> None:
        for p in self.paths:
            p.unlink(missing_ok=True)
        self.paths = []


def _allocate(base: Path, need: int) -> Path:
    fd, name = tempfile.mkstemp(prefix=RESERVE_PREFIX, dir=base)
    try:
        try:
            os.posix_fallocate(fd, 0, need)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            for _ in range(0, need, 1 << 20):  # a filesystem without fallocate: real zeros
                os.write(fd, bytes(1 << 20))
        os.fsync(fd)
    except OSError as exc:
        os.close(fd)
        os.unlink(name)
        raise InputError(f"{base}: cannot reserve {need / 2**20:.0f} MiB for the seal ({exc.strerror or exc})",
                         f"free space on the filesystem of {base}, then run the round again") from None
    os.close(fd)
    return Path(name)
