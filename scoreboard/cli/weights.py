"""`scoreboard weights`: generate a preset model deterministically; re-hash a target's shards against the lock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from ..errors import InputError
from ..lockfile import load_lock
from .console import console, err_console, pick_target, print_json

app = typer.Typer(help="Model weights: generate presets, verify shard hashes.", no_args_is_help=True)


@app.command()
def generate(
    spec: str = typer.Argument(..., help="preset name, e.g. k3-mini, k3-mini-smooth, k3-mid"),
    out: Path = typer.Option(..., "--out", help="directory to write the shard(s) into"),
    seed: int = typer.Option(None, "--seed", help="random seed (default: the preset's)"),
    json_out: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """Write a random-weight kimi-k3 GGUF from a named spec; same spec + seed -> same bytes."""
    from ..weights.generate import generate as gen
    from ..weights.presets import get_spec
    from ..weights.verify import hash_files

    s = get_spec(spec)
    paths = gen(s, out, seed)
    hashes = hash_files(paths)
    rows: list[dict[str, Any]] = [{"path": p.name, "size": p.stat().st_size, "sha256": hashes[p]} for p in paths]
    if json_out:
        print_json({"spec": s.name, "seed": s.default_seed if seed is None else seed, "quant": s.weight_type.upper(),
                    "dir": str(out), "files": rows})
        return
    table = Table(title=f"{s.name} (seed {s.default_seed if seed is None else seed}, {s.weight_type.upper()}) in {out}")
    table.add_column("shard")
    table.add_column("bytes", justify="right")
    table.add_column("sha256", overflow="fold")  # a hash is only useful whole
    for r in rows:
        table.add_row(r["path"], str(r["size"]), r["sha256"])
    console.print(table)


@app.command()
def verify(
    target_arg: str = typer.Argument(None, metavar="[TARGET]", help="deprecated positional form of --target"),
    target: str = typer.Option(None, "--target", "-t",
                               help="target id in the lock (its weights are checked), or a weights id"),
    dir: Path = typer.Option(None, "--dir", help="directory holding the shards (default: the scoreboard cache)"),
    lock: str = typer.Option("reference.lock", "--lock", help="path of reference.lock"),
    workers: int = typer.Option(0, "--workers", min=0, help="hashing threads (0 = one per shard, up to the cores)"),
    json_out: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """Re-hash every shard of a target's weights in parallel; refuse on any mismatch, naming the shard."""
    from ..weights.verify import verify_weights, weights_dir

    target = pick_target(target, target_arg, "weights verify")
    lk = load_lock(lock)
    if target in lk.targets:
        weights_id = lk.targets[target].weights
    elif target in lk.weights:
        weights_id = target
    else:
        lk.target(target)  # raises with did-you-mean
        raise InputError(f"unknown target {target!r}")
    root = dir or weights_dir(weights_id)
    with Progress(TextColumn("hashing {task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=err_console, transient=True, disable=json_out) as bar:
        task = bar.add_task(weights_id, total=None)

        def tick(done: int, total: int, name: str) -> None:
            bar.update(task, completed=done, total=total, description=f"{weights_id} ({name})")

        rep = verify_weights(lk, weights_id, root, tick, workers or None)
    if json_out:
        print_json({"weights": weights_id, "dir": str(root), "ok": rep.ok, "unpinned": rep.unpinned,
                    "files": rep.hashes})
        return
    n = len(rep.paths)
    if rep.unpinned:
        err_console.print(f"[yellow]warning:[/] {len(rep.unpinned)} of {n} shard(s) of {weights_id} are not pinned: "
                          f"the target can run but cannot seal. next: `scoreboard pin weights --target {target} --revision <sha>`")
    console.print(f"[green]ok[/]: {n - len(rep.unpinned)} of {n} shard(s) of {weights_id} match the lock ({root})")
