"""Run the real `scoreboard` entry point in-process (its error boundary and exit codes included)."""

from __future__ import annotations

import sys


def run_cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `scoreboard ARGS...`."""
    from scoreboard.cli.main import run

    monkeypatch.setattr(sys, "argv", ["scoreboard", *args])
    try:
        run()
        code = 0
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def sigint_default() -> None:
    """preexec_fn for a child the test interrupts: SIGINT back to its default. A suite started in the background
    by a non-interactive shell inherits SIGINT ignored, and a Python started so never raises KeyboardInterrupt;
    a user's Ctrl-C at a terminal reaches a process whose SIGINT is the default, and that is what is tested."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
