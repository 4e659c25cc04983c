"""`scoreboard round run|show`: run a sealed round; render a receipt."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import typer
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..errors import InputError
from .console import console, err_console, print_json

app = typer.Typer(help="Run a sealed round, or show a sealed receipt.", no_args_is_help=True)

DEFAULT_TARGET = "k3-mini-cpu"


def _cache_dir() -> Path:
    return Path(os.environ.get("SCOREBOARD_CACHE", Path.home() / ".cache" / "scoreboard"))


class RichReporter:
    """Turns the round's report events into rich progress lines (stderr, so --json stays clean)."""

    def __init__(self) -> None:
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                 TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                                 console=err_console, transient=False)
        self.tasks: dict[str, Any] = {}

    def close(self) -> None:
        self.progress.stop()

    def __call__(self, event: str, **kw: Any) -> None:
        if event == "stage":
            err_console.print(f"[bold cyan]== {kw['name']}[/]")
        elif event == "step":
            err_console.print(f"   {kw['message']}", highlight=False)
        elif event == "retry":
            err_console.print(f"[yellow]   transient failure in {kw['stage']} (attempt {kw['attempt']}): "
                              f"{kw['error']}[/]", highlight=False)
        elif event == "progress":
            name = kw["task"]
            if name not in self.tasks:
                self.progress.start()
                self.tasks[name] = self.progress.add_task(name, total=kw["total"])
            self.progress.update(self.tasks[name], completed=kw["done"], description=f"{name}: {kw.get('message', '')}")
            if kw["done"] >= kw["total"]:
                self.progress.stop()


@app.command("run")
def run_cmd(
    target: str = typer.Option(DEFAULT_TARGET, "--target", "-t", help="target id in reference.lock"),
    candidate: str = typer.Option("main", "--candidate", help="main | <git rev> | <path to a checkout>"),
    seed: int = typer.Option(None, "--seed", help="round seed (prompt, schedule, bootstrap); default unpredictable"),
    blocks: int = typer.Option(None, "--blocks", help="interleaved blocks (default: the target's speed policy)"),
    reps: int = typer.Option(None, "--reps", help="timed reps per arm per block (default: policy)"),
    seal: bool = typer.Option(True, "--seal/--no-seal", help="write the sealed receipt and ledger line"),
    lock: Path = typer.Option(Path("reference.lock"), "--lock", help="path to reference.lock"),
    rounds: Path = typer.Option(Path("rounds"), "--rounds", help="receipts + ledger directory"),
    json_out: bool = typer.Option(False, "--json", help="print the receipt as JSON"),
) -> None:
    """Preflight, gate before speed, interleaved timing, verdict, seal, raise-only frontier."""
    from ..round.run import RoundOptions, run_round

    opts = RoundOptions(target=target, lock_path=lock, candidate=candidate, seed=seed, blocks=blocks, reps=reps,
                        seal=seal, rounds_dir=rounds, cache_dir=_cache_dir())
    reporter = RichReporter()
    try:
        outcome = run_round(opts, reporter)
    except KeyboardInterrupt:
        reporter.close()
        err_console.print("[bold red]interrupted[/]: nothing was sealed; the lock is untouched "
                          f"(next: `scoreboard round run --target {target}` again)")
        raise typer.Exit(130) from None
    finally:
        reporter.close()  # a live progress bar must not swallow the interrupt/error message
    if json_out:
        print_json(outcome.receipt)
    else:
        render(outcome.receipt)
        if outcome.path:
            console.print(f"receipt: {outcome.path}")
        elif seal and outcome.receipt["status"] == "verdict":
            console.print("[yellow]not sealed[/]: the target's weights are not fully pinned "
                          f"(next: `scoreboard pin weights {target} --revision <sha>`)")
        for ch in outcome.frontier_change or []:
            console.print(f"[green]{ch.kind}[/] {ch.slot}: {ch.before:g} -> {ch.after:g} tok/s "
                          f"({ch.reps} reps, {ch.commit[:12]})", highlight=False)
    raise typer.Exit(outcome.exit_code)


@app.command("show")
def show_cmd(
    round_id: str = typer.Argument(..., help="round id, or a path to a receipt file"),
    rounds: Path = typer.Option(Path("rounds"), "--rounds", help="receipts directory"),
    json_out: bool = typer.Option(False, "--json", help="print the receipt as JSON"),
) -> None:
    """Render a receipt: gate per depth, speed per metric, verdict and its explanation."""
    path = Path(round_id) if round_id.endswith(".json") else rounds / f"{round_id}.json"
    if not path.exists():
        matches = sorted(rounds.glob(f"*{round_id}*.json"))
        if len(matches) != 1:
            raise InputError(f"no receipt {round_id!r} in {rounds}/" if not matches else
                             f"{round_id!r} matches {len(matches)} receipts", "list them with `ls rounds/`")
        path = matches[0]
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: not a readable JSON receipt ({exc})", "run `scoreboard verify` to check history")
    from ..receipt import parse_receipt

    receipt = parse_receipt(data, str(path)).model_dump(mode="json", by_alias=True)
    if json_out:
        print_json(receipt)
        return
    render(receipt)


def render(r: dict[str, Any]) -> None:
    console.print(f"[bold]round[/] {r['round_id']}  target [bold]{r['target']}[/]  seed {r['seed']}  "
                  f"candidate {r['candidate']['label']} {r['candidate']['commit'][:12]}"
                  f"{' (dirty)' if r['candidate'].get('dirty') else ''}")
    cal = r.get("calibration") or {}
    if cal.get("status") == "calibrated":
        console.print(f"bars calibrated by {cal['calibration_id']} ({cal.get('seeds')} seeds, margin "
                      f"{cal.get('margin'):g})", highlight=False)
    elif cal.get("status") == "skipped":
        console.print(f"[yellow]no calibration checked[/]: {cal.get('reason', '')} (moves no slot)", highlight=False)
    if r["status"] == "aborted":
        ab = r["aborted"]
        console.print(f"[bold red]ABORTED[/] at {ab['stage']}{' (transient)' if ab['transient'] else ''}: "
                      f"{ab['reason']}", highlight=False)
        return
    gate = r.get("gate")
    if gate:
        t = Table(title="correctness gate (KL(ref||cand), nats, full vocabulary, float64)")
        for col in ("depth", "rows", "KL mean", "KL p99", "KL max", "top-1", "ratchet basis", "pass"):
            t.add_column(col, justify="right")
        for d in gate["depths"]:
            base = d.get("ratchet_baseline")
            t.add_row(str(d["depth"]), str(d["rows"]), f"{d['kl_mean']:.3g}", f"{d['kl_p99']:.3g}",
                      f"{d['kl_max']:.3g}", f"{d['top1']:.4f}", "-" if base is None else f"{base:.3g}",
                      "[green]yes[/]" if d["pass"] else "[red]no[/]")
        console.print(t)
        for g in gate.get("greedy_check", []):
            console.print(f"checked decode {g['metric']}: greedy tokens match the reference's argmax on "
                          f"{g['top1_vs_reference']:.3f} of positions")
    if r.get("speed"):
        _speed_table(r)
    _memory(r.get("environment") or {})
    v = r.get("verdict") or {}
    color = {"REJECT": "red", "inconclusive": "yellow", "none": "white"}.get(v.get("label"), "green")
    console.print(f"[bold {color}]verdict: {v.get('label')}[/]")
    if v.get("explanation"):
        console.print(v["explanation"], highlight=False)
    for reason in v.get("reasons", []):
        console.print(f"  - {reason}", highlight=False)


def _memory(env: dict[str, Any]) -> None:
    """Per rank: the fit check's prediction next to the measured peak of the candidate's processes."""
    fit, peaks = env.get("fit"), env.get("peak_memory")
    if not fit or not peaks:
        return
    for p in peaks:
        dev = "" if p.get("device_gib") is None else f", device peak {p['device_gib']:.2f} GiB"
        console.print(f"memory rank {p['rank']}: fit predicted {fit['need_gib_per_rank']:.2f} GiB per rank "
                      f"(weights {fit['lines'].get('weights', 0):.2f}); measured host RSS peak "
                      f"{p['host_rss_gib']:.2f} GiB{dev}", highlight=False)


def _speed_table(r: dict[str, Any]) -> None:
    from ..lockfile import Target
    from ..tiers import summarize_speed

    target = Target.model_validate(r["lock_target"])
    t = Table(title=f"speed ({r['speed'].get('blocks', '?')} interleaved blocks, tok/s from raw ns)")
    for col in ("metric", "role", "arm", "median", "MAD", "CV", "reps", "cand/ref ratio [95% CI]"):
        t.add_column(col, justify="right")
    for ms in summarize_speed(r, target):
        first = True
        for arm, st in ms.arms.items():
            ci = ""
            if first and ms.vs_reference is not None:
                c = ms.vs_reference
                ci = f"{c.point:.3f} [{c.low:.3f}, {c.high:.3f}]"
            t.add_row(ms.name if first else "", ms.role if first else "", arm, f"{st.median:.2f}",
                      f"{st.mad:.2f}", f"{st.cv:.1%}", str(st.n), ci)
            first = False
    console.print(t)
