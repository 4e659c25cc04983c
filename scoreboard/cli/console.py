"""Shared rich consoles and small output helpers for the CLI."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console

console = Console()
err_console = Console(stderr=True, soft_wrap=True)  # never break a path or a command in two


def print_json(data: Any) -> None:
    """Machine-readable output for `--json`: plain JSON on stdout, nothing else."""
    print(json.dumps(data, indent=2, sort_keys=True, default=str))
