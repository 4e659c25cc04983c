"""`scoreboard` entry point: builds the typer app from one module per command, with one error boundary."""

from __future__ import annotations

import importlib
import sys

import typer

from ..errors import ScoreboardError
from .console import err_console

# (module, attribute): each module exposes either `app` (a typer group) registered under `name`,
# or `command` (a function) registered as a single command.
COMMANDS: list[tuple[str, str]] = [
    ("verify", "verify"),
    ("tier", "tier"),
    ("frontier", "frontier"),
    ("engines", "engines"),
    ("env", "env"),
    ("round", "round"),
    ("ladder", "ladder"),
    ("audit-pins", "audit_pins"),
    ("pin", "pin"),
    ("weights", "weights"),
    ("fit", "fit"),
    ("gate", "gate"),
]

app = typer.Typer(
    name="scoreboard",
    help="Sealed-round benchmark and scoreboard harness for LLM inference engines.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Sealed-round benchmark and scoreboard harness for LLM inference engines."""


def _register() -> None:
    for name, module in COMMANDS:
        try:
            mod = importlib.import_module(f"scoreboard.cli.{module}")
        except ModuleNotFoundError as exc:
            if exc.name == f"scoreboard.cli.{module}":
                continue  # command not built yet
            raise
        if hasattr(mod, "app"):
            app.add_typer(mod.app, name=name)
        else:
            app.command(name=name, help=mod.command.__doc__)(mod.command)


_register()


def run() -> None:
    """Console-script entry: domain errors -> message + hint + exit code (1 error, 2 non-compliant)."""
    try:
        rc = app(standalone_mode=False)  # click returns (not raises) typer.Exit's code in this mode
        if isinstance(rc, int) and rc:
            sys.exit(rc)
    except ScoreboardError as exc:
        err_console.print(f"[bold red]error:[/] {exc.message}", highlight=False)
        if exc.hint:
            err_console.print(f"[yellow]next:[/] {exc.hint}", highlight=False)
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        err_console.print("[bold red]interrupted[/]: nothing was sealed; the lock is untouched")
        sys.exit(130)
    except Exception as exc:  # click usage errors (typer may vendor click as typer._click)
        if hasattr(exc, "show") and hasattr(exc, "exit_code"):
            exc.show()
            sys.exit(1)  # bad command-line input is an error (1); 2 is reserved for non-compliance
        if type(exc).__name__ == "Abort":
            sys.exit(1)
        raise


if __name__ == "__main__":
    run()
