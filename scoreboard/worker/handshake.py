"""The clock handshake's wire: two FIFOs in the launch's scratch directory, one JSON message per line.

The parent (the round, outside any sandbox) creates both FIFOs next to the request file before it starts
the worker; the worker finds them beside its request (the scratch directory is the one place a sandboxed
worker can write). Every message carries ``protocol``; a message of another version, another type or
another rep than the one expected ends the session with an error.

    worker -> parent   {"protocol", "type": "hello"}                       after prepare() (untimed)
    worker -> parent   {"protocol", "type": "ready", "workload": i, "rep": j}   after begin() + synchronize
    parent -> worker   {"protocol", "type": "reveal", "workload": i, "rep": j, "tokens": [...]}
    worker -> parent   {"protocol", "type": "output", "workload": i, "rep": j, "token_ids": [...],
                        "logprobs": [...] | null, "worker_ns": n}           after step() + synchronize
    parent -> worker   {"protocol", "type": "bye"}                          the session is over

The parent reads ``time.perf_counter_ns`` just before it writes a reveal and again when the output's
complete line has arrived: those readings are the samples. ``worker_ns`` (the worker's own reading around
step) is recorded as a cross-check only. ``logprobs`` (one per output id, the engine's own log-softmax of it,
computed inside the timed step) is evidence the parent holds against the gate's checked run of the same variant.

History: 1 — the first; 2 — the output carries logprobs.
"""

from __future__ import annotations

import errno
import json
import os
import select
import time
from pathlib import Path
from typing import Any, Callable

from ..errors import EngineError

PROTOCOL = "scoreboard-clock/2"
TO_WORKER = "clock.to-worker"
FROM_WORKER = "clock.from-worker"


def make_fifos(scratch: Path) -> tuple[Path, Path]:
    """Create both FIFOs (mode 0600) in the launch's scratch directory."""
    to_w, from_w = scratch / TO_WORKER, scratch / FROM_WORKER
    for p in (to_w, from_w):
        os.mkfifo(p, 0o600)
    return to_w, from_w


def encode(kind: str, **fields: Any) -> bytes:
    return (json.dumps({"protocol": PROTOCOL, "type": kind, **fields}, separators=(",", ":")) + "\n").encode()


def decode(line: bytes, expect: str, **match: Any) -> dict[str, Any]:
    """Parse one message and check its version, type and rep; EngineError names what was wrong."""
    try:
        msg = json.loads(line)
    except ValueError:
        raise EngineError(f"clock handshake: expected a {expect!r} message, got unreadable bytes {line[:120]!r}",
                          "the worker must not write to the clock FIFOs itself") from None
    if not isinstance(msg, dict) or msg.get("protocol") != PROTOCOL:
        got = msg.get("protocol") if isinstance(msg, dict) else None
        raise EngineError(f"clock handshake: protocol {got!r}, expected {PROTOCOL!r}",
                          "the worker and the harness must be the same harness version")
    if msg.get("type") == "error":
        raise EngineError(f"clock handshake: the worker failed: {msg.get('error')}", msg.get("hint"))
    if msg.get("type") != expect or any(msg.get(k) != v for k, v in match.items()):
        want = {"type": expect, **match}
        raise EngineError(f"clock handshake: expected {want}, got {_short(msg)}",
                          "the worker must follow the harness's rep order")
    return msg


class ParentChannel:
    """The round's end: both FIFOs opened read-write (never blocks on open, never sees a false EOF), reads
    bounded by a deadline and by the launcher process staying alive."""

    def __init__(self, scratch: Path, alive: Callable[[], bool], deadline: float):
        self.alive, self.deadline = alive, deadline
        self._out = os.open(scratch / TO_WORKER, os.O_RDWR | os.O_NONBLOCK)
        self._in = os.open(scratch / FROM_WORKER, os.O_RDWR | os.O_NONBLOCK)
        self._buf = b""

    def send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                n = os.write(self._out, view)
                view = view[n:]
            except BlockingIOError:
                self._wait(self._out, write=True)

    def recv_line(self) -> bytes:
        """The next complete line (without its newline); returns as soon as its last byte arrived."""
        while True:
            nl = self._buf.find(b"\n")
            if nl >= 0:
                line, self._buf = self._buf[:nl], self._buf[nl + 1:]
                return line
            try:
                chunk = os.read(self._in, 1 << 20)
            except BlockingIOError:
                chunk = None
            if chunk:
                self._buf += chunk
                continue
            self._wait(self._in, write=False)

    def _wait(self, fd: int, write: bool) -> None:
        while True:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("clock handshake: the worker's timeout passed")
            r, w, _ = select.select([] if write else [fd], [fd] if write else [], [], min(left, 0.5))
            if r or w:
                return
            if not self.alive():
                raise EngineError("clock handshake: the worker exited before it finished the session",
                                  "see the worker log")

    def close(self) -> None:
        for fd in (self._out, self._in):
            try:
                os.close(fd)
            except OSError:
                pass


class WorkerChannel:
    """The worker's end (rank 0 only): plain blocking reads and writes; the parent holds both FIFOs open."""

    def __init__(self, scratch: Path):
        self._out = open(scratch / FROM_WORKER, "wb", buffering=0)
        self._in = open(scratch / TO_WORKER, "rb", buffering=0)
        self._buf = b""

    def send(self, kind: str, **fields: Any) -> None:
        data = memoryview(encode(kind, **fields))
        while data:
            try:
                n = self._out.write(data)
            except InterruptedError:
                continue
            data = data[n or 0:]

    def recv(self, expect: str, **match: Any) -> dict[str, Any]:
        while b"\n" not in self._buf:
            try:
                chunk = os.read(self._in.fileno(), 1 << 20)
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                raise
            if not chunk:
                raise EngineError("clock handshake: the harness closed the session", None)
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return decode(line, expect, **match)

    def close(self) -> None:
        for f in (self._out, self._in):
            try:
                f.close()
            except OSError:
                pass


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."
