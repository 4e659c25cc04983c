"""A build's files against the hashes recorded for them, in the harness's wording (one problem per file).

Shared by the reference build's own manifest check (an engine's, through ``scoreboard.engine``) and the
anchor in sealed history (``scoreboard.round.evidence``); imports nothing, so the plugin contract can lend it.
"""

from __future__ import annotations


def compare_scans(found: dict[str, dict[str, str]], want_files: dict[str, str], want_links: dict[str, str],
                  against: str = "the manifest") -> list[str]:
    """Every difference between a fresh scan ({"files": name -> sha256, "links": name -> target}) and recorded
    hashes, one problem per file, naming it."""
    files, links = found["files"], found["links"]
    where = "" if against == "the manifest" else f" ({against})"
    problems = []
    for name, sha in sorted(want_files.items()):
        if name not in files:
            problems.append(f"{name}: missing{where}")
        elif files[name] != sha:
            problems.append(f"{name}: sha256 {files[name]} != recorded {sha}{where}")
    problems += [f"{name}: not recorded in {against}" for name in sorted(set(files) - set(want_files))]
    for name, target in sorted(want_links.items()):
        if links.get(name) != target:
            problems.append(f"{name}: link -> {links.get(name)!r}, recorded -> {target!r}{where}")
    problems += [f"{name}: link not recorded in {against}" for name in sorted(set(links) - set(want_links))]
    return problems
