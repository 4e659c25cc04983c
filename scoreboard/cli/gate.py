"""`scoreboard gate calibrate TARGET`: show, on N seeds, that the target's gate bars separate a correct engine
and rounding noise from every known fault; seal the measurements for `round run` to rely on."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from . import signals
from .console import console, err_console, print_json
from .round import RichReporter, _cache_dir

app = typer.Typer(help="Calibrate a target's correctness-gate bars against measured noise and known faults.",
                  no_args_is_help=True)


@app.command("calibrate")
def calibrate_cmd(
    target_arg: Optional[str] = typer.Argument(None, metavar="[TARGET]", help="deprecated positional form of --target"),
    target: Optional[str] = typer.Option(None, "--target", "-t", help="target id in reference.lock"),
    seeds: int = typer.Option(20, "--seeds", help="seeds (prompts) to measure; each as a round with that seed"),
    first_seed: Optional[int] = typer.Option(None, "--first-seed",
                                             help="seeds FIRST..FIRST+N-1 (default: unpredictable, recorded)"),
    candidate: str = typer.Option("main", "--candidate",
                                  help="the instrument's commit of this repository: main | <git rev> | <path>"),
    engine_repo: Path = typer.Option(None, "--engine-repo",
                                     help="the candidate engine's own repository (a plugin): its faults and "
                                          "precisions (Engine.calibration) are measured from its main"),
    lock: Path = typer.Option(Path("reference.lock"), "--lock", help="path to reference.lock"),
    out: Path = typer.Option(Path("rounds"), "--out",
                             help="rounds directory: the record goes to OUT/calibrations/, its line to "
                                  "OUT/calibrations.jsonl"),
    seal: bool = typer.Option(True, "--seal/--no-seal", help="write the sealed record and its chain line"),
    extend: bool = typer.Option(False, "--extend",
                                help="add the --seeds to the target's latest calibration (sealed by a pinned key, "
                                     "the same definition, the same engines/ code) instead of calibrating afresh: "
                                     "the new record holds its seeds and runs as sealed, then these (a calibration "
                                     "measured over several leases of a box)"),
    json_out: bool = typer.Option(False, "--json", help="print the record as JSON"),
    renew_reference_anchor: bool = typer.Option(
        False, "--renew-reference-anchor",
        help="accept a reference build whose files differ from those sealed for its build key (a deliberate "
             "rebuild, e.g. the first use of a fresh GPU box: nvcc's output is not byte-reproducible); recorded"),
) -> None:
    """Reference vs the instrument, its noise floor (two precisions) and its fault suite on N seeds, against the
    bars; plus the candidate engine's own faults and precisions when it declares them."""
    from ..calibration_run import CalibrationOptions, run_calibration
    from .console import pick_target
    from .inputs import positive

    target = pick_target(target, target_arg, "gate calibrate")
    positive(seeds, "--seeds", "seeds")
    positive(first_seed, "--first-seed", "(a seed)", zero_means="seeds 0..N-1")

    if not extend:
        _few_seeds_note(lock, target, seeds)
    opts = CalibrationOptions(target=target, lock_path=lock, candidate=candidate, seeds=seeds, first_seed=first_seed,
                              rounds_dir=out, cache_dir=_cache_dir(), seal=seal,
                              renew_reference_anchor=renew_reference_anchor, engine_repo=engine_repo, extend=extend)
    reporter = RichReporter()
    try:
        outcome = run_calibration(opts, reporter)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM/SIGHUP (scoreboard/cli/signals.py)
        reporter.close()
        err_console.print(f"[bold red]{signals.what(exc)}[/]: no calibration was recorded")
        raise typer.Exit(signals.exit_code(exc)) from None
    finally:
        reporter.close()
    if json_out:
        print_json(outcome.record)
    else:
        render(outcome.record)
        if outcome.path:
            console.print(f"record: {outcome.path}")
    refused = outcome.record.get("extension_refused")
    if refused:  # measured and sealed on its own seeds: say why it could not join, and what to run
        err_console.print(f"[yellow]not extended[/]: these seeds differ from {refused['calibration_id']} in what one "
                          "calibration must share, so they were sealed as a calibration of their own:\n  "
                          + "\n  ".join(refused["changes"][:8])
                          + f"\nnext: `scoreboard gate calibrate -t {target}` (afresh, 20 seeds)", highlight=False)
    elif outcome.record.get("extends"):
        ext = outcome.record["extends"]
        console.print(f"extends {ext['calibration_id']} ({ext['seeds']} seed(s)) to {len(outcome.record['seeds'])} "
                      "seed(s)", highlight=False)
    raise typer.Exit(0 if outcome.separated else 2)


def _few_seeds_note(lock: Path, target: str, seeds: int) -> None:
    """Fewer seeds than the default leave the pooled noise floor little room: say so before the box time is spent
    (on 2026-12-02 six seeds at depth 131072 failed on two near-ties in 192 rows)."""
    from ..calibrate import NOISE_TOP1_POOLED_MIN, noise_flips_allowed
    from ..errors import ScoreboardError
    from ..lockfile import load_lock

    try:
        rows = load_lock(lock).target(target).gate.rows_per_depth
    except ScoreboardError:
        return  # the calibration itself names what is wrong with the lock or the target
    if seeds >= 20:
        return
    err_console.print(f"[yellow]note[/]: {seeds} seed(s) x {rows} rows = {seeds * rows} rows per depth: the noise "
                      f"floor's pooled top-1 (>= {NOISE_TOP1_POOLED_MIN:g}) allows {noise_flips_allowed(seeds, rows)} "
                      f"argmax flip(s) per depth, 20 seeds allow {noise_flips_allowed(20, rows)}; with fewer seeds a "
                      "record may not separate on rounding near-ties alone (docs/calibration.md)", highlight=False)


def render(rec: dict[str, Any]) -> None:
    from .. import calibrate
    pol, noise = rec["policy"], rec["noise_floor"]
    m = pol["margin"]
    who = rec.get("instrument") or rec["candidate"]  # format 1.0 named its instrument `candidate`
    console.print(f"[bold]calibration[/] {rec['calibration_id']}  target [bold]{rec['target']}[/]  "
                  f"{len(rec['seeds'])} seed(s)  instrument {who.get('engine', '?')} {who.get('label', '?')} "
                  f"{str(who.get('commit', ''))[:12]}  ({rec.get('stage_seconds', {}).get('total', 0):.0f} s)",
                  highlight=False)
    ext = rec.get("extends")
    if ext:
        base = ext.get("base_instrument") or {}
        console.print(f"  its first {ext['seeds']} seed(s) as sealed in {ext['calibration_id']} (instrument at "
                      f"{str(base.get('commit', ''))[:12]}), the other {len(rec['seeds']) - ext['seeds']} measured "
                      f"{rec['created_at']}", highlight=False)
    engine = rec.get("engine")
    if engine:
        console.print(_engine_line(engine), highlight=False)
    console.print(f"bars: KL mean <= {pol['kl_max']:g}, p99 <= {pol['kl_p99_max']:g}, top-1 >= {pol['top1_min']:g}; "
                  f"margin {m:g}: noise floor <= {pol['kl_max'] / m:.3g} and correct within the bars on every seed, "
                  f"each fault >= {pol['kl_max'] * m:.3g} on every seed{_fault_depths_note(pol)}", highlight=False)
    t = Table(title="KL(p||q), nats, per gate depth over seeds (worst seed: the highest KL for correct and noise, "
                    "the lowest for a fault)")
    t.add_column("arm", overflow="fold")
    for col in ("depth", "mean: worst", "mean: avg", "p99: worst", "top-1: worst"):
        t.add_column(col, justify="right")
    names = {"correct": "correct", "noise_floor": f"noise {noise['precise']}/{noise['coarse']}",
             "engine_noise_floor": f"{(engine or {}).get('engine')} noise"}
    summ = calibrate.summary(rec)  # recomputed from the seeds' numbers (records before top1_best lack it)
    order = sorted(summ, key=lambda a: (a.startswith("fault:"), a != "correct", a))
    for arm in order:
        s, first, fault = summ[arm], True, arm.startswith("fault:")
        for d, x in sorted(s["depths"].items(), key=lambda kv: int(kv[0])):
            worst_kl, worst_t1 = (x["kl_mean_best"], x["top1_best"]) if fault else (x["kl_mean_worst"], x["top1_worst"])
            t.add_row(names.get(arm, arm.removeprefix("fault:")) if first else "", d, f"{worst_kl:.3g}",
                      f"{x['kl_mean_mean']:.3g}", "" if fault else f"{x['kl_p99_worst']:.3g}", f"{worst_t1:.4f}")
            first = False
    pooled = calibrate.pooled_top1(rec, "noise_floor")
    console.print(t)
    console.print("noise floor top-1 pooled over every seed's rows (>= " f"{calibrate.NOISE_TOP1_POOLED_MIN:g}): "
                  + ", ".join(f"depth {d} {v:.4f}" for d, v in sorted(pooled.items())), highlight=False)
    sep = rec["separation"]
    if sep["separated"]:
        console.print(f"[bold green]separated[/] with margin {m:g}: `round run --target {rec['target']}` may rely on it")
    else:
        console.print(f"[bold red]not separated[/] with margin {m:g}; `round run --target {rec['target']}` will refuse:")
        for p in sep["problems"]:
            console.print(f"  - {p}", highlight=False)


def _fault_depths_note(pol: dict) -> str:
    """Where the faults were graded, when that is not every gate depth (gate.fault_depths)."""
    fd = pol.get("fault_depths") or pol.get("depths") or []
    if sorted(fd) == sorted(pol.get("depths") or []):
        return ""
    return f" (graded at depths {', '.join(str(d) for d in fd)} on the prompt's prefix: gate.fault_depths)"


def _engine_line(engine: dict[str, Any]) -> str:
    """What the record says of the candidate engine's own faults and precisions."""
    if not engine.get("measured"):
        return f"candidate engine {engine['engine']}: {engine.get('note', '')}"
    src = engine.get("source") or {}
    where = f" of {src['repo']}" if src.get("repo") else ""
    return (f"candidate engine {engine['engine']}: its own faults and noise floor measured at "
            f"{src.get('label', '?')} {str(src.get('commit', ''))[:12]}{where}")


@app.command("show")
def show_cmd(
    target_arg: Optional[str] = typer.Argument(None, metavar="[TARGET]", help="deprecated positional form of --target"),
    target: Optional[str] = typer.Option(None, "--target", "-t", help="target id in reference.lock"),
    lock: Path = typer.Option(Path("reference.lock"), "--lock", help="path to reference.lock"),
    rounds: Path = typer.Option(Path("rounds"), "--rounds", help="rounds directory holding calibrations/"),
    json_out: bool = typer.Option(False, "--json", help="print the record as JSON"),
) -> None:
    """The target's latest sealed calibration (chain, file hash and seal checked), and whether `round run` may
    rely on it under the lock as it is now. Exit 2 when it may not."""
    from rich.markup import escape

    from ..calibrate import check_calibration, latest_calibration
    from ..errors import InputError
    from ..history.trust import Trust
    from ..lockfile import load_lock
    from .console import pick_target
    from .inputs import existing_dir

    target = pick_target(target, target_arg, "gate show")
    existing_dir(rounds, "--rounds")
    lk = load_lock(lock)
    lk.target(target)  # an unknown target is an input error naming the lock's targets
    found = latest_calibration(rounds, target)
    if found is None:
        raise InputError(f"target {target!r} has no calibration in {rounds}/calibrations.jsonl",
                         f"scoreboard gate calibrate --target {target}")
    rec, _line = found
    if json_out:
        print_json(rec)
        raise typer.Exit(0)
    render(rec)
    standing = Trust.of(lk, lock).standing(rec, "calibration")
    console.print(f"sealed: {escape(standing.describe())}" if standing.trusted else
                  f"[bold red]UNTRUSTED[/]: {escape(standing.why)}", highlight=False)
    try:
        check_calibration(lk, target, rounds, lock)
    except InputError as exc:
        console.print(f"[bold red]`round run --target {target}` refuses it now[/]: {escape(exc.message)}",
                      highlight=False)
        console.print(f"  next: {escape(exc.hint or '')}", highlight=False)
        raise typer.Exit(2) from None
    console.print(f"under {lock} as it is now, `round run --target {target}` relies on {rec['calibration_id']}",
                  highlight=False)
