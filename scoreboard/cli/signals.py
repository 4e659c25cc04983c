"""A termination signal ends a command the way Ctrl-C does: cleanly, with nothing sealed.

A round's clean-up (its workers stopped, the seal's reserve deleted, its scratch tmpfs unmounted) runs on
KeyboardInterrupt. Python raises that for SIGINT only: SIGTERM (`kill`, `timeout`, a CI job cancelled, systemd
stopping a unit) and SIGHUP (the ssh session to the benchmark box dropped) otherwise end the process at once,
and a root round leaves its scratch tmpfs mounted and its reserve behind. `install()` makes both raise
`Terminated`, a KeyboardInterrupt, so every path that cleans up after Ctrl-C cleans up after them, and the
command exits 128 + the signal's number (143 for SIGTERM, 129 for SIGHUP), as a shell reports a process killed
by it.

A signal the process was started with ignored stays ignored (`nohup scoreboard round run` keeps running when the
terminal goes). Once one has arrived, further SIGTERMs and SIGHUPs are ignored, so a second `kill` cannot cut
the clean-up short; SIGKILL still ends the process at once.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType

CAUGHT = (signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """A termination signal, raised where the main thread was, so that clean-up runs as after Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


def _raise(signum: int, frame: FrameType | None) -> None:
    for sig in CAUGHT:  # one clean-up: a second kill must not interrupt it
        signal.signal(sig, signal.SIG_IGN)
    raise Terminated(signum)


def install() -> list[int]:
    """Make SIGTERM and SIGHUP raise Terminated in the main thread, unless the process was started with the
    signal ignored. Returns the signals now caught."""
    caught: list[int] = []
    for sig in CAUGHT:
        if signal.getsignal(sig) == signal.SIG_IGN:
            continue
        signal.signal(sig, _raise)
        caught.append(sig)
    return caught


@contextlib.contextmanager
def installed() -> Iterator[list[int]]:
    """install() for the block, then the handlers as they were (a CLI run inside another program, a test, leaves
    that program's handlers as it found them)."""
    before = {sig: signal.getsignal(sig) for sig in CAUGHT}
    try:
        yield install()
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def exit_code(exc: KeyboardInterrupt) -> int:
    """130 for Ctrl-C, 128 + the signal's number for a termination signal."""
    return 128 + (exc.signum if isinstance(exc, Terminated) else signal.SIGINT)


def what(exc: KeyboardInterrupt) -> str:
    """"interrupted" for Ctrl-C; "terminated (SIGTERM)" for a termination signal."""
    return f"terminated ({exc.name})" if isinstance(exc, Terminated) else "interrupted"
