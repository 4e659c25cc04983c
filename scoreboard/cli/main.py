"""`scoreboard` entry point: builds the typer app from one module per command, with one error boundary."""

from __future__ import annotations

import importlib
import sys
from typing import Optional

import typer
from rich.markup import escape

from .. import __version__
from ..errors import ScoreboardError
from . import signals
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
    ("compare", "compare"),
    ("audit-pins", "audit_pins"),
    ("pin", "pin"),
    ("weights", "weights"),
    ("fit", "fit"),
    ("report", "report"),
    ("reference", "reference"),
    ("gate", "gate"),
    ("signer", "signer"),
    ("records", "records"),
]

EXIT_CODES = """Exit codes (every command): 0 ok; 1 error or refused input (nothing written); 2 a verdict-level
failure: REJECT, regression, pin drift, a tampered/unsealed receipt or a `verify` finding."""

app = typer.Typer(
    name="scoreboard",
    help="Sealed-round benchmark and scoreboard harness for LLM inference engines.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    epilog=EXIT_CODES,
)


def _show_version(value: bool) -> None:
    if value:
        print(f"scoreboard {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(version: Optional[bool] = typer.Option(None, "--version", callback=_show_version, is_eager=True,
                                                 help="print the version and exit")) -> None:
    """Sealed-round benchmark and scoreboard harness for LLM inference engines."""


def _flags_without_metavar() -> None:
    """This typer's rich help prints `--json <bool>` as if a flag took a value; a flag shows no metavar."""
    try:
        from typer.core import TyperOption
    except ImportError:  # pragma: no cover - another typer layout: leave its help alone
        return
    original = getattr(TyperOption, "display_type_rich", None)
    if original is None or getattr(original, "_scoreboard", False):
        return

    def display_type_rich(self, ctx):  # type: ignore[no-untyped-def]
        if getattr(self, "is_flag", False) and self.metavar is None:
            return None
        return original(self, ctx)

    display_type_rich._scoreboard = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


_flags_without_metavar()


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
    """Console-script entry: domain errors -> message + hint + exit code (1 error, 2 non-compliant); SIGTERM and
    SIGHUP end a command as Ctrl-C does (scoreboard/cli/signals.py)."""
    with signals.installed():
        _run()


def _run() -> None:
    try:
        rc = app(standalone_mode=False)  # click returns (not raises) typer.Exit's code in this mode
        if isinstance(rc, int) and rc:
            sys.exit(rc)
    except ScoreboardError as exc:
        err_console.print(f"[bold red]error:[/] {escape(exc.message)}", highlight=False)  # a message is text, not markup
        if exc.hint:
            err_console.print(f"[yellow]next:[/] {escape(exc.hint)}", highlight=False)
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except KeyboardInterrupt as exc:
        err_console.print(f"[bold red]{signals.what(exc)}[/]: nothing was sealed; the lock is untouched")
        sys.exit(signals.exit_code(exc))
    except Exception as exc:  # click usage errors (typer may vendor click as typer._click)
        if hasattr(exc, "show") and hasattr(exc, "exit_code"):
            exc.show()
            sys.exit(1)  # bad command-line input is an error (1); 2 is reserved for non-compliance
        if type(exc).__name__ == "Abort":
            sys.exit(1)
        raise


if __name__ == "__main__":
    run()
