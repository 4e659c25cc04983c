"""Shared rich consoles and small output helpers for the CLI."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from rich.console import Console

# Piped or redirected, rich lays tables out at 80 columns and cuts round ids and commits to "2026-1…"; a
# log or a closing note needs them whole. Off a terminal, without COLUMNS, stdout lays out at PIPE_WIDTH.
PIPE_WIDTH = 200


def _console(stderr: bool, piped_width: int, **kw: Any) -> Console:
    """A console whose width is never 0: rich takes COLUMNS=0 literally and then prints nothing at all (an
    error included), so COLUMNS counts only as a positive integer; otherwise a terminal's own size, or
    `piped_width` off a terminal."""
    cols = os.environ.get("COLUMNS", "")
    probe = Console(stderr=stderr, width=80)  # whether the stream is a terminal; the width is not read
    if cols.isdigit() and int(cols) > 0:
        width = None  # rich reads COLUMNS itself
    elif probe.is_terminal:
        width = shutil.get_terminal_size((80, 24)).columns  # skips a COLUMNS that is not a positive integer
    else:
        width = piped_width
    return Console(stderr=stderr, width=width, **kw)


console = _console(False, PIPE_WIDTH)
err_console = _console(True, 80, soft_wrap=True)  # never break a path or a command in two


def print_json(data: Any) -> None:
    """Machine-readable output for `--json`: plain JSON on stdout, nothing else."""
    print(json.dumps(data, indent=2, sort_keys=True, default=str))


def pick_target(option: str | None, positional: str | None, command: str) -> str:
    """One convention: the target is the `--target/-t` option in every command. The old positional form
    still works for the commands that had it, with a deprecation note on stderr (stdout stays clean)."""
    from ..errors import InputError

    if option and positional and option != positional:
        raise InputError(f"target given twice: --target {option} and {positional}", f"pass only --target {option}")
    if positional and not option:
        err_console.print(f"[yellow]deprecated:[/] `scoreboard {command} {positional}`; use "
                          f"`scoreboard {command} --target {positional}`", highlight=False)
    target = option or positional
    if not target:
        raise InputError("--target is required", f"scoreboard {command} --target <target id in reference.lock>")
    return target
