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
