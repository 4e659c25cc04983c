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


def scoreboard_command() -> list[str]:
    """`scoreboard` as a fresh process of the interpreter running the tests (activated virtual environment or not):
    `python -m scoreboard`, never whatever `scoreboard` PATH finds first (another install's copy, or none)."""
    return [sys.executable, "-m", "scoreboard"]


def console_script() -> list[str]:
    """The installed `scoreboard` console script of this interpreter's environment: its scripts directory (a
    venv's bin/, activated or not), else the user scheme's (a `pip install --user`); `python -m scoreboard` when
    neither holds one (the package run from a source tree only)."""
    import os
    import sysconfig
    from pathlib import Path

    for scheme in (sysconfig.get_default_scheme(), f"{os.name}_user"):
        exe = Path(sysconfig.get_path("scripts", scheme)) / "scoreboard"
        if exe.is_file() and os.access(exe, os.X_OK):
            return [str(exe)]
    return scoreboard_command()
