"""Parent side of the fresh-process workers: spawn, bound by wall clock, hold the clock handshake, read the
result file."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Sequence

from .. import registry
from ..engine import EngineTarget
from ..errors import EngineError, TransientError
from ..worker.distributed import launch_command
from ..worker.handshake import ParentChannel, make_fifos
from ..worker.protocol import (HarnessEngine, ProtocolError, WireTarget, WorkerOp, WorkerRequest, WorkerResult, check_result,
                               decode_result, encode, failure, pid_path, result_path)
from . import sandbox
from .candidate import HARNESS_ROOT
from .limits import Limits

# Never visible to a candidate process: signing keys and tokens (a key it can read, it can sign with).
SECRET_ENV = ("SCOREBOARD_SIGNING_KEY", "GH_TOKEN", "GITHUB_TOKEN", "HF_TOKEN")
KEPT_LOG_BYTES = 8 << 20  # a failed launch's log kept under <cache>/logs/: its last 8 MiB


@dataclass
class WorkerRun:
    """One launch as the parent saw it: the worker's result, and what only the parent measures or knows."""

    result: WorkerResult
    wall_ns: int  # the parent's clock around the whole launch
    command: list[str]  # the worker's own command (inside the sandbox, without bwrap's binds)
    session: Any = None  # what the parent's clock session returned (op "timed")
    isolation: dict[str, Any] | None = None

    @property
    def base_command(self) -> list[str]:
        """The launch without its scratch files (request.json, result.json): what a receipt records."""
        return [c for c in self.command if not c.endswith(".json")]


def worker_env(import_root: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of an unsandboxed worker (isolation "none", an explicit opt-out). A sandboxed worker
    gets a cleared environment and an allow-list instead (sandbox.launch)."""
    env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
    env.update(extra or {})
    env["PYTHONPATH"] = os.pathsep.join([str(import_root), str(HARNESS_ROOT)])
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # nothing written into an arm's export (it is re-hashed before each use)
    return env


def worker_command(world: int, request: Path, result: Path) -> list[str]:
    """One fresh worker process, or `world` ranks of it under torchrun (scoreboard.worker.distributed)."""
    args = [str(request), str(result)]
    if world == 1:
        return [sys.executable, "-m", "scoreboard.worker", *args]
    return launch_command(world, "scoreboard.worker", args)


def sandboxed(import_root: Path, target: EngineTarget, cache_dir: Path, scratch: Path, cmd: list[str],
              env: dict[str, str] | None, isolation: str, limits: Limits | None = None,
              import_paths: Sequence[Path] = ()) -> sandbox.Launch:
    """The launch of `cmd` for this arm: inside bwrap (only the arm's engines/, the harness's scoreboard/
    package, the weight shards, a plugin arm's exported package (`import_paths`, read-only at their own paths)
    and `scratch` reachable), or as a plain subprocess for isolation "none"."""
    shards = [Path(target.model_path), *map(Path, target.shard_paths)]
    return sandbox.launch(cmd, mode=isolation, engines_dir=Path(import_root) / "engines",
                          harness_pkg=HARNESS_ROOT / "scoreboard", scratch=scratch,
                          read_only=[*(p for p in shards if p.exists()), *import_paths], device=target.device, env=env,
                          fallback_env=worker_env(import_root, env), fallback_cache=cache_dir, limits=limits)


def prober(device: str, scratch_root: Path, cache_dir: Path, isolation: str, limits: Limits | None = None,
           on_launch: Callable[[dict[str, Any]], None] | None = None
           ) -> Callable[[Path, dict[str, str] | None], ContextManager[tuple[list[str], dict[str, str]]]]:
    """The launch of the preflight's import probe (ready.check_worker_imports): the same sandbox, limits and
    environment as every other launch of an arm's code, around a bare interpreter (the probe adds `-c CODE`)."""

    @contextmanager
    def probe(import_root: Path, env: dict[str, str] | None) -> Iterator[tuple[list[str], dict[str, str]]]:
        tmp = sandbox.new_launch_dir(scratch_root)
        try:
            with sandbox.launch([sys.executable], mode=isolation, engines_dir=Path(import_root) / "engines",
                                harness_pkg=HARNESS_ROOT / "scoreboard", scratch=tmp, read_only=[], device=device,
                                env=env, fallback_env=worker_env(import_root, env), fallback_cache=cache_dir,
                                limits=limits) as box:
                if on_launch is not None:  # its binds are not a worker's (no weights): those come from the first worker
                    on_launch({k: v for k, v in box.isolation.items() if k != "binds"})
                yield box.argv, box.env
        finally:
            sandbox.remove_tree(tmp)

    return probe


def read_own(path: Path, limit: int | None = None) -> bytes | None:
    """The last `limit` bytes (all: None) of a regular file in a launch's scratch dir, or None. The dir is the
    sandbox's: its processes could have replaced any file there by a symlink (to a host file the harness, as root,
    could read: the signing key), a FIFO (a read that never returns) or a device, so the final component is
    never followed (O_NOFOLLOW), never waited on (O_NONBLOCK) and must be a regular file. Read once the launch
    has ended, when no process of it is left to swap the file after the check; its parents are the harness's."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        if limit is not None and st.st_size > limit:
            fh.seek(st.st_size - limit)
        return fh.read()


def keep_log(log: Path, logs_dir: Path, limit: int = KEPT_LOG_BYTES) -> Path:
    """Copy a failed launch's log (at most its last `limit` bytes: the candidate writes it) to `logs_dir`, which
    outlives the round's scratch; returns the copy, or the original where it cannot be copied."""
    dest = logs_dir / f"{log.parent.name}.log"
    data = read_own(log, limit)
    if data is None:
        data = f"[{log} was not a regular file when the launch ended (the worker replaced it: a symlink, a FIFO); " \
               "nothing of it is kept]\n".encode()
    try:
        logs_dir.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
        return dest
    except OSError:
        return log


def run_worker(engine: str, import_root: Path, target: EngineTarget, cache_dir: Path, op: WorkerOp,
               timeout_s: float, workdir: Path | None = None, env: dict[str, str] | None = None,
               session: Callable[[ParentChannel], Any] | None = None, isolation: str = "bwrap",
               harness_engine: HarnessEngine = None, limits: Limits | None = None,
               logs_dir: Path | None = None, on_launch: Callable[[dict[str, Any]], None] | None = None,
               entry_point: str | None = None, import_paths: Sequence[Path] = ()) -> WorkerRun:
    """Run one engine operation in a fresh process (or target.ranks ranks); raise EngineError/TransientError.

    `engine` is resolved here, through the registry, to the entry point the worker imports (`harness_engine`
    "null": the harness's own null engine instead), unless `entry_point` names it (a plugin arm's, read from its
    own commit), with `import_paths` first on the worker's import path. A result that is not this harness's
    protocol is an EngineError, like a worker that crashed.

    The launch runs sandboxed (sandbox.launch; `isolation="none"` opts out) in a private directory inside
    `workdir` (the round's scratch root, which its owner removes), or, without a workdir, in a private root
    removed when the launch ends (then no output file outlives the call). The log of a launch that fails is
    kept in `logs_dir` (default <cache_dir>/logs/<the scratch root's name>), which the error names.
    `on_launch(isolation)` is told the launch's sandbox record before the launch starts.

    With `session` (op "timed"): the clock handshake's two FIFOs are made in the launch's scratch directory
    before the launch, and `session(channel)` runs here, in the parent, while the worker runs; its return
    value is `WorkerRun.session`. The wall clock bounds the whole launch. On timeout every process is
    stopped (the launcher's session, then each rank by the pid it recorded, or the sandbox's pid namespace)
    and none is left running.
    """
    own_root: Path | None = None
    if workdir is None:
        own_root = root = sandbox.new_scratch_root()
    else:
        root = Path(workdir)
    try:
        return _run_worker(engine, import_root, target, cache_dir, op, timeout_s, sandbox.new_launch_dir(root), env,
                           isolation, session, harness_engine, limits, logs_dir or Path(cache_dir) / "logs" / root.name,
                           on_launch, entry_point, tuple(import_paths))
    finally:
        sandbox.remove_tree(own_root)


def _run_worker(engine: str, import_root: Path, target: EngineTarget, cache_dir: Path, op: WorkerOp,
                timeout_s: float, tmp: Path, env: dict[str, str] | None, isolation: str,
                session: Callable[[ParentChannel], Any] | None, harness_engine: HarnessEngine, limits: Limits | None,
                logs_dir: Path, on_launch: Callable[[dict[str, Any]], None] | None, entry_point: str | None = None,
                import_paths: tuple[Path, ...] = ()) -> WorkerRun:
    entry = None if harness_engine else (entry_point or registry.entry_point(engine))
    if session is not None:
        make_fifos(tmp)
    cmd = worker_command(target.ranks, tmp / "request.json", tmp / "result.json")
    with sandboxed(import_root, target, cache_dir, tmp, cmd, env, isolation, limits, import_paths) as box:
        if on_launch is not None:
            on_launch(box.isolation)
        paths = () if harness_engine else tuple(map(str, import_paths))
        return _launch(engine, target, op, timeout_s, tmp, session, harness_engine, entry, cmd, box, logs_dir, paths)


def _launch(engine: str, target: EngineTarget, op: WorkerOp, timeout_s: float, tmp: Path,
            session: Callable[[ParentChannel], Any] | None, harness_engine: HarnessEngine, entry: str | None,
            cmd: list[str], box: sandbox.Launch, logs_dir: Path, import_paths: tuple[str, ...] = ()) -> WorkerRun:
    res = tmp / "result.json"
    req = WorkerRequest(engine=engine, entry_point=entry, harness_engine=harness_engine, target=WireTarget.of(target),
                        cache_dir=box.cache_dir, timeout_s=timeout_s, op=op, import_paths=import_paths)
    (tmp / "request.json").write_text(encode(req))
    name = f"{engine} worker ({op.kind}{_world(target)})"
    log = tmp / "worker.log"

    def where() -> Path:  # the log of a failed launch, kept where it outlives the round's scratch
        return keep_log(log, logs_dir)

    t0 = time.perf_counter_ns()
    deadline = time.monotonic() + timeout_s
    sess_value, sess_error = None, None
    with open(log, "w") as log_file:  # the worker's output goes to a file: a full pipe never stalls a rep
        proc = subprocess.Popen(box.argv, env=box.env, cwd=tmp, stdin=subprocess.DEVNULL, stdout=log_file,
                                stderr=subprocess.STDOUT, start_new_session=True)
        world = 1 if box.pid_namespace else target.ranks  # namespace pids are never signalled from outside
        try:
            if session is not None:
                chan = ParentChannel(tmp, lambda: proc.poll() is None, deadline)
                try:
                    sess_value = session(chan)
                except EngineError as exc:  # the worker's own result (written as it exits) names the cause
                    sess_error = exc
                finally:
                    chan.close()
            if sess_error is not None:  # a broken session: a short grace to write its result, then stop it
                try:
                    proc.wait(timeout=min(5.0, max(deadline - time.monotonic(), 0.01)))
                except subprocess.TimeoutExpired:
                    _stop(proc, res, world)
            proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
            _kill_group(proc)  # what the worker left running in its session (a background process) goes too
        except (subprocess.TimeoutExpired, TimeoutError):
            _stop(proc, res, world)
            raise EngineError(f"{name} exceeded the {timeout_s:.0f} s timeout; "
                              f"every process was stopped{box.oom_note()}; log {where()}",
                              "raise speed.timeout_s in the target policy only if the workload is really that slow")
        except BaseException:  # Ctrl-C: leave no rank behind
            _stop(proc, res, world)
            raise
        finally:
            _reap_ranks(res, world)
    wall = time.perf_counter_ns() - t0
    out = (read_own(log, KEPT_LOG_BYTES) or b"").decode(errors="replace")
    try:
        body = _result(res, target.ranks, out)
    except ProtocolError as exc:  # what a crashed worker gets: the worker did not deliver a result
        raise EngineError(f"{name} wrote a malformed result: {exc.message}; log {where()}\n{out[-2000:]}".rstrip(),
                          exc.hint) from None
    if sess_error is not None and not any(x in sess_error.message for x in ("exited before it finished",
                                                                           "the worker failed")):
        # the parent saw the session break first (a forged or out-of-order message); what the worker says
        # afterwards (a broken pipe) follows from it
        raise EngineError(f"{engine} ({op.kind}): {sess_error.message} (log {where()})", sess_error.hint)
    if body is not None and body.ok:
        try:
            check_result(op, body)
        except ProtocolError as exc:
            raise EngineError(f"{name} wrote a malformed result: {exc.message}; log {where()}", exc.hint) from None
        outside = [f.path for f in body.logits or [] if not _own_file(Path(f.path), tmp)]
        if outside:
            raise EngineError(f"{name} named logits files that are not regular files of its own scratch dir {tmp}: "
                              f"{outside[:3]}; log {where()}", "a worker writes its logits into its launch's directory")
    if body is None:
        tail = out[-2000:]
        raise EngineError(f"{name} crashed with exit {proc.returncode} and no result{box.oom_note()}; "
                          f"log {where()}\n{tail}")
    if not body.ok:
        cls = TransientError if body.transient else EngineError
        detail = body.traceback or ""
        on = f" on rank {body.rank} of {target.ranks}" if target.ranks > 1 else ""
        raise cls(f"{engine} ({op.kind}) failed{on}: {body.error}{box.oom_note()} (log {where()})\n"
                  f"{detail[-1500:]}".rstrip(), body.hint)
    if sess_error is not None:
        raise EngineError(f"{sess_error.message} (log {where()})", sess_error.hint)
    return WorkerRun(body, wall, cmd, sess_value, box.isolation)


def _own_file(path: Path, scratch: Path) -> bool:
    """A file the parent may load for the worker: directly in the launch's scratch dir, a regular file, no symlink
    (what the parent then reads by path, np.load, is read after every process of the launch has ended)."""
    try:
        same_dir = os.path.realpath(path.parent) == os.path.realpath(scratch)
        return same_dir and stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _world(target: EngineTarget) -> str:
    return f", {target.ranks} ranks" if target.ranks > 1 else ""


# what a rank reports when a peer went away: a consequence, never the root cause
_PEER = re.compile(r"connection (reset|closed) by peer|broken pipe|socket closed|communicator was aborted|"
                   r"ncclRemoteError|remote process exited|DistNetworkError", re.IGNORECASE)
# one failure block of torchrun's summary: a line "  rank : N (local_rank: M)", the next "  exitcode : C (pid: P)".
# Line-anchored: torchrun's own log line before the summary ("failed (exitcode: -6) local_rank: 0 (pid: 7) ...") names
# a local_rank too, and a pattern free to span lines paired it with the next block's exit code (rank 0 with rank 1's 9)
_TORCHRUN_FAILURE = re.compile(r"^[ \t]*rank[ \t]*:[ \t]*(\d+)[^\n]*\n[ \t]*exitcode[ \t]*:[ \t]*(-?\d+)",
                               re.MULTILINE)


def _result(res: Path, world: int, log_text: str = "") -> WorkerResult | None:
    """Rank 0's result when every rank succeeded; else the root cause over all ranks, in this order: a rank's
    own error (earliest first), a rank that died without writing its outcome, and only then a rank's report
    that a peer went away (what every survivor says after the real failure). A malformed result file of any
    rank raises ProtocolError."""
    bodies = {r: _read(result_path(res, r), r) for r in range(world)}
    failed = sorted((b for b in bodies.values() if b is not None and not b.ok), key=lambda b: b.at_ns)
    own = [b for b in failed if not _PEER.search(b.error or "")]
    if own:
        return own[0]
    if world > 1:
        started = {r for r in range(world) if pid_path(res, r).exists()}
        silent = sorted(r for r in range(world) if bodies[r] is None and (r in started or not started))
        codes = {int(r): int(c) for r, c in _TORCHRUN_FAILURE.findall(log_text)}
        root = _TORCHRUN_FAILURE.search(log_text, max(log_text.find("Root Cause"), 0))  # torchrun's first failure
        if root and int(root.group(1)) in silent:
            r = int(root.group(1))
        elif silent and (failed or len(silent) < world):
            r = silent[0]
        else:
            r = None
        if r is not None:
            how = f"exit code {codes[r]}" if r in codes else "no exit code reported"
            return failure(f"rank {r} ended without a result ({how}); the other ranks' errors follow from it",
                           "see the worker log for its output", rank=r)
    if failed:
        return failed[0]
    head = bodies[0]
    if head is None or (world > 1 and any(b is None or not b.ok for b in bodies.values())):
        return None  # killed or crashed without a word from any rank
    return head


def _read(path: Path, rank: int) -> WorkerResult | None:
    data = read_own(path)
    if data is None:
        return None
    text = data.decode(errors="replace")
    try:
        return decode_result(text)
    except ProtocolError as exc:
        raise ProtocolError(f"rank {rank}'s {exc.message}" if rank else exc.message, exc.hint) from None


def _rank_pids(res: Path, world: int) -> list[int]:
    pids = []
    for r in range(world):
        try:
            pids.append(int(pid_path(res, r).read_text()))
        except (OSError, ValueError):
            continue
    return pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _reap_ranks(res: Path, world: int, grace_s: float = 5.0) -> None:
    """After the launcher returned: a rank that outlived it (it should not) is terminated, then killed."""
    if world == 1:
        return
    pids = [p for p in _rank_pids(res, world) if p != os.getpid() and _alive(p)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _alive(p)]
            time.sleep(0.05)
        if not pids:
            return


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(proc: subprocess.Popen, res: Path, world: int, grace_s: float = 10.0) -> None:
    """SIGTERM the launcher's session (torchrun forwards it to its ranks), SIGKILL after `grace_s`."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    _reap_ranks(res, world)
    _await_gone(res.parent)


def _naming(text: bytes) -> list[int]:
    """Host pids whose command line names `text` (every worker's names its request in the launch's scratch)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if text in (d / "cmdline").read_bytes():
                    out.append(int(d.name))
            except OSError:
                continue
    return out


def _await_gone(scratch: Path, grace_s: float = 5.0) -> None:
    """After a stop: the kernel tears a killed sandbox's pid namespace down asynchronously, so a worker can
    outlive the launcher's exit by a moment. Wait for every process naming this launch's scratch to go (and
    kill any left after `grace_s`), so the scratch is removed with nothing still writing into it."""
    key = str(scratch).encode()
    deadline = time.monotonic() + grace_s
    while _naming(key) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in _naming(key):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
