"""`scoreboard gate calibrate TARGET`: show, on N seeds, that the target's gate bars separate a correct engine
and rounding noise from every known fault; seal the measurements for `round run` to rely on."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from .console import console, err_console, print_json
from .round import RichReporter, _cache_dir

app = typer.Typer(help="Calibrate a target's correctness-gate bars against measured noise and known faults.",
                  no_args_is_help=True)


@app.command("calibrate")
def calibrate_cmd(
    target: str = typer.Argument(..., help="target id in reference.lock"),
    seeds: int = typer.Option(20, "--seeds", help="seeds (prompts) to measure; each as a round with that seed"),
    first_seed: Optional[int] = typer.Option(None, "--first-seed",
                                             help="seeds FIRST..FIRST+N-1 (default: unpredictable, recorded)"),
    candidate: str = typer.Option("main", "--candidate", help="main | <git rev> | <path to a checkout>"),
    lock: Path = typer.Option(Path("reference.lock"), "--lock", help="path to reference.lock"),
    out: Path = typer.Option(Path("rounds"), "--out",
                             help="rounds directory: the record goes to OUT/calibrations/, its line to "
                                  "OUT/calibrations.jsonl"),
    seal: bool = typer.Option(True, "--seal/--no-seal", help="write the sealed record and its chain line"),
    json_out: bool = typer.Option(False, "--json", help="print the record as JSON"),
    renew_reference_anchor: bool = typer.Option(
        False, "--renew-reference-anchor",
        help="accept a reference build whose files differ from those sealed for its build key (a deliberate "
             "rebuild, e.g. the first use of a fresh GPU box: nvcc's output is not byte-reproducible); recorded"),
) -> None:
    """Reference vs candidate, the noise floor (two precisions) and the fault suite on N seeds, against the bars."""
    from ..calibrate import CalibrationOptions, run_calibration

    opts = CalibrationOptions(target=target, lock_path=lock, candidate=candidate, seeds=seeds, first_seed=first_seed,
                              rounds_dir=out, cache_dir=_cache_dir(), seal=seal,
                              renew_reference_anchor=renew_reference_anchor)
    reporter = RichReporter()
    try:
        outcome = run_calibration(opts, reporter)
    except KeyboardInterrupt:
        reporter.close()
        err_console.print("[bold red]interrupted[/]: no calibration was recorded")
        raise typer.Exit(130) from None
    finally:
        reporter.close()
    if json_out:
        print_json(outcome.record)
    else:
        render(outcome.record)
        if outcome.path:
            console.print(f"record: {outcome.path}")
    raise typer.Exit(0 if outcome.separated else 2)


def render(rec: dict[str, Any]) -> None:
    pol, noise = rec["policy"], rec["noise_floor"]
    m = pol["margin"]
    console.print(f"[bold]calibration[/] {rec['calibration_id']}  target [bold]{rec['target']}[/]  "
                  f"{len(rec['seeds'])} seed(s)  candidate {rec['candidate']['label']} {rec['candidate']['commit'][:12]}"
                  f"  ({rec['stage_seconds'].get('total', 0):.0f} s)", highlight=False)
    console.print(f"bars: KL mean <= {pol['kl_max']:g}, p99 <= {pol['kl_p99_max']:g}, top-1 >= {pol['top1_min']:g}; "
                  f"margin {m:g}: correct and noise floor <= {pol['kl_max'] / m:.3g}, faults >= "
                  f"{pol['kl_max'] * m:.3g}", highlight=False)
    t = Table(title="KL(p||q), nats, per gate depth over seeds")
    t.add_column("arm", overflow="fold")
    for col in ("depth", "mean: worst", "mean: avg", "p99: worst", "top-1: worst"):
        t.add_column(col, justify="right")
    names = {"correct": "correct", "noise_floor": f"noise {noise['precise']}/{noise['coarse']}"}
    order = sorted(rec["summary"], key=lambda a: (a.startswith("fault:"), a != "correct", a))
    for arm in order:
        s, first = rec["summary"][arm], True
        for d, x in sorted(s["depths"].items(), key=lambda kv: int(kv[0])):
            t.add_row(names.get(arm, arm.removeprefix("fault:")) if first else "", d, f"{x['kl_mean_worst']:.3g}",
                      f"{x['kl_mean_mean']:.3g}", f"{x['kl_p99_worst']:.3g}", f"{x['top1_worst']:.4f}")
            first = False
    console.print(t)
    sep = rec["separation"]
    if sep["separated"]:
        console.print(f"[bold green]separated[/] with margin {m:g}: `round run --target {rec['target']}` may rely on it")
    else:
        console.print(f"[bold red]not separated[/] with margin {m:g}; `round run --target {rec['target']}` will refuse:")
        for p in sep["problems"]:
            console.print(f"  - {p}", highlight=False)
