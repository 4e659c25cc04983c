"""The source trees of installed engine plugins: what a sandboxed worker must also see to import them.

A plugin installed into site-packages is inside the interpreter's prefix, which the sandbox binds already. One
installed editable (`pip install -e`) is not: site-packages holds only a pointer to its source tree, which the
sandbox would not show (the worker fails with `No module named '<plugin>'`). For every installed distribution
that provides a `scoreboard.engines` entry point, except the harness's own (its engines come from the arm's
export at /sb/arm/engines, and its checkout must stay hidden), these are the directories that pointer names:

* the path lines of the distribution's .pth files (setuptools' static editable form, hatchling, flit,
  `setup.py develop`);
* the values of `MAPPING` (package -> directory) in setuptools' editable finder module
  (`__editable___<name>_finder.py`), read as a literal, never imported;
* the project directory of its `direct_url.json` when it is editable and names neither of the above.

The sandbox binds each read-only at its own path; nothing else of the host.
"""

from __future__ import annotations

import ast
import json
from importlib.metadata import Distribution, entry_points
from pathlib import Path
from urllib.parse import unquote, urlparse

GROUP = "scoreboard.engines"
HARNESS_DIST = "scoreboard"  # this project's own distribution (pyproject's [project].name)


def plugin_distributions() -> list[Distribution]:
    """Installed distributions with a scoreboard.engines entry point, the harness's own left out."""
    seen: dict[str, Distribution] = {}
    for ep in entry_points(group=GROUP):
        dist = getattr(ep, "dist", None)
        if dist is None:
            continue
        name = (dist.metadata["Name"] or "").lower()
        if name and name != HARNESS_DIST:
            seen.setdefault(name, dist)
    return list(seen.values())


def _pth_dirs(pth: Path) -> list[Path]:
    """Directories a .pth file adds to sys.path (its lines that are neither comments nor imports)."""
    out = []
    for line in pth.read_text(errors="replace").splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "import ", "import\t")):
            continue
        p = Path(line) if Path(line).is_absolute() else pth.parent / line
        if p.is_dir():
            out.append(p)
    return out


def _finder_dirs(finder: Path) -> list[Path]:
    """The directories of a setuptools editable finder's MAPPING literal ({package: directory})."""
    try:
        tree = ast.parse(finder.read_text(errors="replace"))
    except SyntaxError:
        return []
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and node.targets else getattr(node, "target", None)
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and target.id == "MAPPING" and value is not None:
            try:
                mapping = ast.literal_eval(value)
            except ValueError:
                return []
            return [Path(d) for d in mapping.values() if isinstance(d, str) and Path(d).is_dir()]
    return []


def _editable_project(dist: Distribution) -> list[Path]:
    """direct_url.json's project directory when the distribution was installed editable (PEP 610)."""
    text = dist.read_text("direct_url.json")
    try:
        info = json.loads(text) if text else {}
    except ValueError:
        return []
    url = urlparse(str(info.get("url", "")))
    if not (info.get("dir_info") or {}).get("editable") or url.scheme != "file":
        return []
    p = Path(unquote(url.path))
    return [p] if p.is_dir() else []


def source_dirs_of(dist: Distribution) -> list[Path]:
    """The source directories one distribution's installed pointers name (see the module's docstring)."""
    out: list[Path] = []
    for f in dist.files or []:
        path = Path(str(dist.locate_file(f)))
        if path.suffix == ".pth" and path.is_file():
            out += _pth_dirs(path)
        elif path.name.startswith("__editable__") and path.name.endswith("_finder.py") and path.is_file():
            out += _finder_dirs(path)
    return out or _editable_project(dist)


def source_dirs(hidden: tuple[Path, ...] = ()) -> list[Path]:
    """Every installed engine plugin's source directories, resolved, in a stable order; never one that is or
    holds a path of `hidden` (the harness's checkout: a .pth naming a parent of it would bind it)."""
    dirs = {d.resolve() for dist in plugin_distributions() for d in source_dirs_of(dist)}
    keep = [Path(h).resolve() for h in hidden]
    return sorted(d for d in dirs if not any(d == h or d in h.parents for h in keep))
