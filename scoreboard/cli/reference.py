"""`scoreboard reference`: the pinned reference source in a form any box can take (docs/reference-pin.md)."""

from __future__ import annotations

from pathlib import Path

import typer

from .console import console

app = typer.Typer(help="The pinned reference source: its tree hash and its carried form.", no_args_is_help=True)


def _reference(lock: Path, ref_id: str):
    from ..errors import InputError
    from ..lockfile import load_lock

    refs = load_lock(lock).references
    if ref_id not in refs:
        raise InputError(f"unknown reference {ref_id!r} in {lock}", f"references: {', '.join(sorted(refs))}")
    return refs[ref_id]


@app.command("pack")
def pack_cmd(
    ref_id: str = typer.Argument(..., help="reference id in reference.lock, e.g. llama-cpp-python-0-3-36"),
    out: Path = typer.Argument(..., help="new path for the bare git repository to carry"),
    source: str = typer.Option(None, "--reference-source", help="where to take the source from (default: the pin)"),
    lock: Path = typer.Option(Path("reference.lock"), "--lock", help="path to reference.lock"),
) -> None:
    """Write a bare git repository whose one commit holds exactly the pinned tree (exclusions left out)."""
    from ..cache import cache_dir
    from engines.llamacpp.source import pack_git

    commit, tree = pack_git(_reference(lock, ref_id), cache_dir(), out, ref_id, source=source)
    console.print(f"tree {tree}\ncommit {commit}\ndeliver with: --reference-source git+file://{out.resolve()}@{commit}",
                  highlight=False)


@app.command("tree")
def tree_cmd(
    directory: Path = typer.Argument(..., help="an extracted source tree"),
    exclude: list[str] = typer.Option([], "--exclude", help="root-relative path left out (repeat)"),
) -> None:
    """Print the git tree id of a directory as the pin computes it (raw bytes, .gitignore ignored)."""
    from engines.llamacpp.source import tree_hash

    console.print(tree_hash(directory, tuple(exclude)), highlight=False)
