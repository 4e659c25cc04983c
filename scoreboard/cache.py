"""The one rule for where the harness's cache lives: an explicit path, else $SCOREBOARD_CACHE, else ~/.cache/scoreboard.

The cache holds what rounds reuse (the reference's source and build, generated weights, import shims). It is
resolved in the round's own process before any worker starts, and a worker only ever gets the path its parent
passes in its request (inside the sandbox: a private tmpfs), so nothing a candidate runs can move it.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "SCOREBOARD_CACHE"


def cache_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """`explicit` if given (and non-empty), else $SCOREBOARD_CACHE if set (and non-empty), else ~/.cache/scoreboard."""
    if explicit:
        return Path(explicit).expanduser()
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "scoreboard"
