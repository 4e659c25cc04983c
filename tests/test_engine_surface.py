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


# ----------------------------------------------------------------------------------------------
# the contract stands alone: it and the lock loader load nothing of the round, the history or the pin audit

HARNESS_ONLY = ("scoreboard.round", "scoreboard.history", "scoreboard.pins")


def _module_of(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """scoreboard's modules -> the scoreboard modules each imports anywhere in its file (lazy imports inside
    functions included, TYPE_CHECKING-only ones left out: they never run)."""
    graph: dict[str, set[str]] = {}
    for path in sorted((REPO / "scoreboard").rglob("*.py")):
        name = _module_of(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING") for n in ast.walk(node)}
        out: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                out.add(base)
                out |= {f"{base}.{a.name}" for a in node.names}  # `from . import x` imports module x
        graph[name] = {m for m in out if m == "scoreboard" or m.startswith("scoreboard.")}
    known = set(graph)
    return {k: {m for m in v if m in known} for k, v in graph.items()}


def reachable(graph: dict[str, set[str]], start: list[str]) -> set[str]:
    seen, todo = set(), list(start)
    while todo:
        m = todo.pop()
        for dep in graph.get(m, ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_the_graph_sees_lazy_relative_and_package_imports():
    graph = import_graph()
    assert "scoreboard.registry" in graph["scoreboard.round.launch"]  # `from .. import registry`
    assert "scoreboard.weights.presets" in graph["scoreboard.fit"]  # inside a function
    assert "scoreboard.round.evidence" not in graph["scoreboard.engine"]  # TYPE_CHECKING only, never run


def test_the_contract_and_what_it_lends_reach_no_round_history_or_pins_module_and_never_the_contract_again():
    graph = import_graph()
    lent = sorted(set(contract.LENT.values()))
    reached = reachable(graph, ["scoreboard.engine", *lent])
    assert not [m for m in reached if m.startswith(HARNESS_ONLY)], sorted(reached)
    assert "scoreboard.engine" not in reachable(graph, lent)  # no import circle through the contract
    assert "scoreboard.registry" not in reached  # the contract never loads engines


def test_loading_the_lock_or_the_contract_loads_no_engine_and_nothing_of_round_history_or_pins():
    code = ("import sys; from scoreboard.lockfile import load_lock; load_lock('reference.lock'); "
            "after_lock = sorted(m for m in sys.modules if m.split('.')[0] in ('scoreboard', 'engines', 'torch')); "
            "import scoreboard.engine as e; [getattr(e, n) for n in e.LENT]; "
            "after_lent = sorted(m for m in sys.modules if m.split('.')[0] in ('scoreboard', 'engines', 'torch')); "
            "import json; print(json.dumps([after_lock, after_lent]))")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    import json

    after_lock, after_lent = json.loads(p.stdout)
    for loaded in (after_lock, after_lent):
        assert not [m for m in loaded if m.startswith(HARNESS_ONLY + ("engines", "torch", "scoreboard.registry"))], loaded
    assert "scoreboard.engine" not in after_lock  # the loader does not even load the contract
