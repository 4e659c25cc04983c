"""The published plugin surface: engines import from the harness only scoreboard.engine and scoreboard.errors,
and from scoreboard.engine only the names it publishes (its ``__all__``: the contract and the lent helpers)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import scoreboard.engine as contract

REPO = Path(__file__).resolve().parent.parent
SURFACE = ("scoreboard.engine", "scoreboard.errors")


def surface_violations(source: str, where: str = "<src>") -> list[str]:
    """Every harness import in `source` outside the surface (at any depth: lazy imports inside functions too)."""
    out: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [f"{where}:{node.lineno}: import {a.name}" for a in node.names
                    if (a.name == "scoreboard" or a.name.startswith("scoreboard.")) and a.name not in SURFACE]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mod = node.module
            if mod == "scoreboard":
                out += [f"{where}:{node.lineno}: from scoreboard import {a.name}" for a in node.names
                        if f"scoreboard.{a.name}" not in SURFACE]
            elif mod.startswith("scoreboard.") and mod not in SURFACE:
                out.append(f"{where}:{node.lineno}: from {mod} import ...")
            elif mod == "scoreboard.engine":
                out += [f"{where}:{node.lineno}: scoreboard.engine.{a.name} is not published" for a in node.names
                        if a.name not in contract.__all__]
    return out


def test_the_check_sees_each_way_past_the_surface():
    src = ("from scoreboard.lockfile import GitReference\nimport scoreboard.fit\nfrom scoreboard import registry\n"
           "def f():\n    from scoreboard.round.clock import in_process_reps\n"
           "from scoreboard.engine import Geometry, _private\nfrom scoreboard.errors import EngineError\n"
           "from scoreboard import errors\nfrom . import model\n")
    assert surface_violations(src) == [
        "<src>:1: from scoreboard.lockfile import ...", "<src>:2: import scoreboard.fit",
        "<src>:3: from scoreboard import registry", "<src>:6: scoreboard.engine._private is not published",
        "<src>:5: from scoreboard.round.clock import ..."]


def test_bundled_engines_import_only_the_published_surface():
    files = sorted((REPO / "engines").rglob("*.py"))
    assert len(files) > 10
    found = [v for p in files for v in surface_violations(p.read_text(), str(p.relative_to(REPO)))]
    assert found == [], "import it through scoreboard.engine (add it to LENT and __all__ if an engine needs it)"


def test_every_published_name_resolves_and_the_lent_ones_load_lazily():
    code = ("import sys, scoreboard.engine as e; lent = {m for m in e.LENT.values()}; "
            "assert not lent & set(sys.modules), lent & set(sys.modules); "
            "missing = [n for n in e.__all__ if not hasattr(e, n)]; assert not missing, missing; "
            "assert set(e.LENT) <= set(e.__all__); print('ok')")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr
    from scoreboard.cache import cache_dir

    assert contract.cache_dir is cache_dir  # the harness's own function, not a copy
    try:
        contract.no_such_helper  # noqa: B018
    except AttributeError as exc:
        assert "no_such_helper" in str(exc)
    else:
        raise AssertionError("an unknown name must be an AttributeError")
