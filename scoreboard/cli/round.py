"""`scoreboard round run|show`: run a sealed round; render a receipt."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from ..cache import cache_dir
from ..errors import InputError
from ..history.seal import SIGNING_KEY_ENV
from ..history.receipt import EnvironmentRec, Receipt
from . import signals
from .console import console, err_console, print_json
from .progress import RichReporter  # noqa: F401  (gate.py and the tests take it from here)

app = typer.Typer(help="Run a sealed round, or show a sealed receipt.", no_args_is_help=True)

DEFAULT_TARGET = "k3-mini-cpu"


def _cache_dir() -> Path:
    return cache_dir()


@app.command("run")
def run_cmd(
    target: str = typer.Option(DEFAULT_TARGET, "--target", "-t", help="target id in reference.lock"),
    candidate: str = typer.Option("main", "--candidate", help="main | <git rev> | <path to a checkout>"),
    engine_repo: Path = typer.Option(None, "--engine-repo",
                                     help="the candidate engine's own git repository (a plugin): --candidate and "
                                          "every arm are its commits, main is its main branch"),
    seed: int = typer.Option(None, "--seed", help="round seed (prompt, schedule, bootstrap); default unpredictable"),
    blocks: int = typer.Option(None, "--blocks", help="interleaved blocks (default: the target's speed policy)"),
    reps: int = typer.Option(None, "--reps", help="timed reps per arm per block (default: policy)"),
    seal: Optional[bool] = typer.Option(
        None, "--seal/--no-seal",
        help="write the sealed receipt and ledger line (default: when $SCOREBOARD_SIGNING_KEY is set; a machine "
             "without a pinned key runs an unsealed trial whose receipt is kept under rounds/unsealed/)"),
    lock: Path = typer.Option(Path("reference.lock"), "--lock", help="path to reference.lock"),
    rounds: Path = typer.Option(Path("rounds"), "--rounds", help="receipts + ledger directory"),
    json_out: bool = typer.Option(False, "--json", help="print the receipt as JSON"),
    renew_reference_anchor: bool = typer.Option(
        False, "--renew-reference-anchor",
        help="accept a reference build whose files differ from the ones sealed for its build key (a deliberate "
             "rebuild); recorded in the receipt"),
    reference_source: str = typer.Option(
        None, "--reference-source",
        help="where the pinned reference source comes from when it is built: pin (default), git+<url>@<rev>, a "
             "directory or the sdist file; it must hash to the pinned tree (docs/reference-pin.md; env "
             "SCOREBOARD_REFERENCE_SOURCE)"),
) -> None:
    """Preflight, gate before speed, interleaved timing, verdict, seal, raise-only frontier."""
    from ..lockfile import load_lock
    from ..round.run import RoundOptions
    from .inputs import new_or_existing_dir
    from .written import ledger_kinds

    trial = seal is None and not os.environ.get(SIGNING_KEY_ENV)  # no key here: history is a box's to write
    opts = RoundOptions(target=target, lock_path=lock, candidate=candidate, seed=seed, blocks=blocks, reps=reps,
                        seal=bool(seal if seal is not None else not trial), rounds_dir=rounds, cache_dir=_cache_dir(),
                        renew_reference_anchor=renew_reference_anchor, reference_source=reference_source,
                        engine_repo=engine_repo)
    new_or_existing_dir(rounds, "--rounds")
    before = {k: v.value for k, v in load_lock(lock).slots.items()}  # baselines as they were at round start
    lines_before = len(ledger_kinds(rounds))
    if trial:
        err_console.print(f"[yellow]unsealed trial[/]: ${SIGNING_KEY_ENV} is not set, so this round seals nothing and "
                          "moves no slot (sealed history is written by a box whose key reference.lock pins: "
                          "docs/signing.md; `--seal` to require it, `--no-seal` to say so)", highlight=False)
    outcome = _run_with_progress(opts)
    _print_outcome(outcome, opts, json_out, before, lines_before)
    if trial:
        _keep_trial(outcome, opts, json_out)
    raise typer.Exit(outcome.exit_code)


def _keep_trial(outcome: Any, opts: Any, json_out: bool) -> None:
    """An unsealed trial's receipt, kept beside the records (rounds/unsealed/, outside what verify reads) and named."""
    from ..round.ready import save_unsealed

    path, failed = save_unsealed(outcome.receipt, opts.rounds_dir, opts.cache_dir)
    out = err_console if json_out else console
    if path is not None:
        out.print(f"unsealed receipt (a trial, not history): {path}", highlight=False)
    else:
        out.print(f"[yellow]the unsealed receipt could not be kept[/]: {'; '.join(failed)}", highlight=False)


def _run_with_progress(opts: Any) -> Any:
    """The round with its progress on stderr; an unsealed receipt is printed before its error."""
    from ..round.run import UnsealedReceipt, run_round

    reporter = RichReporter()
    try:
        return run_round(opts, reporter)
    except UnsealedReceipt as exc:  # print the kept receipt, then the error (exit 1) names its path
        reporter.close()
        if exc.path is not None:
            print_json(json.loads(exc.path.read_text(encoding="utf-8")))
        else:  # no place could take it: stderr is where it survives (the error says so)
            print(json.dumps(exc.receipt, indent=1, sort_keys=True, default=str), file=sys.stderr, flush=True)
        raise
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM/SIGHUP (scoreboard/cli/signals.py)
        reporter.close()
        err_console.print(f"[bold red]{signals.what(exc)}[/]: nothing was sealed; the lock is untouched "
                          f"(next: `scoreboard round run --target {opts.target}` again)")
        raise typer.Exit(signals.exit_code(exc)) from None
    finally:
        reporter.close()  # a live progress bar must not swallow the interrupt/error message


def _print_outcome(outcome: Any, opts: Any, json_out: bool, before: dict[str, float], lines_before: int) -> None:
    """The receipt (rendered, or as JSON on stdout), drift warnings, slot changes, then where the records are."""
    from ..drift import reference_drift
    from ..history.receipt import parse_receipt
    from .written import written_since

    parsed = parse_receipt(outcome.receipt)
    drift = reference_drift(parsed, None, before)
    if json_out:
        print_json(outcome.receipt)
        for w in drift:
            err_console.print(f"[yellow]warning:[/] {w}", highlight=False)
    else:
        render(parsed, drift)
        if outcome.path:
            console.print(f"receipt: {outcome.path}")
        if outcome.records:
            console.print(f"records saved: {outcome.records}", highlight=False)
        elif opts.seal and outcome.receipt["status"] == "verdict":
            console.print("[yellow]not sealed[/]: the target's weights are not fully pinned "
                          f"(next: `scoreboard pin weights --target {opts.target} --revision <sha>`)")
        for ch in outcome.frontier_change or []:
            console.print(f"[green]{ch.kind}[/] {ch.slot}: {ch.before:g} -> {ch.after:g} tok/s "
                          f"({ch.reps} reps, {ch.commit[:12]})", highlight=False)
    if outcome.path:  # on stderr under --json: stdout stays the receipt alone
        out = err_console if json_out else console
        written = written_since(opts.rounds_dir, opts.lock_path, lines_before, outcome.path,
                                outcome.frontier_change or [])
        for line in _after_round(parsed, outcome.path, opts.lock_path) + records_lines(written, parsed):
            out.print(line, highlight=False, soft_wrap=True)


def records_lines(written: Any, r: Receipt) -> list[str]:
    """Where a sealed round's records are, and the commit that keeps them (cli/written.py)."""
    from .written import records_note

    label = r.verdict.label if r.verdict else "aborted"
    gain = f" ({r.verdict.gain * 100:+.2f}%)" if r.verdict and r.verdict.gain is not None else ""
    return records_note(written, f"records: {r.target} round {r.round_id} at {r.candidate.commit[:12] or '-'}: "
                                 f"{label}{gain}")


def _after_round(r: Receipt, path: Path, lock: Path) -> list[str]:
    """The next step a main round scored against a pinned slot (its frontier's commit could not run) needs."""
    note = str((r.provenance or {}).get("frontier_arm") or "")
    v = r.verdict
    if not note.startswith("not measured") or v is None or v.basis != "frontier-slot" or v.label in ("BASELINE",):
        return []
    return [f"note: {note}",
            "next: on a quiet box of this target's node class the verdict against the slot is a measurement; if this "
            "is the box the target is measured on now, re-base the frontier to this round (logged, checked by "
            f"`scoreboard verify`): scoreboard frontier rebase --target {r.target} --receipt {path} --lock {lock} "
            "--reason '<why: e.g. the frontier commit speaks an older engine contract>'"]


@app.command("show")
def show_cmd(
    round_id: str = typer.Argument(..., help="round id, or a path to a receipt file"),
    rounds: Path = typer.Option(Path("rounds"), "--rounds", help="receipts directory"),
    lock: Optional[Path] = typer.Option(None, "--lock",
                                        help="the pinned signers and the baseline slots (reference-drift warning); "
                                             "default: this checkout's reference.lock (./reference.lock or the "
                                             "working tree's root), never one that merely lies beside the receipt"),
    json_out: bool = typer.Option(False, "--json", help="print the receipt as JSON (= --format json)"),
    fmt: Optional[str] = typer.Option(None, "--format", metavar="table|json|csv|md",
                                      help="output format (json: the receipt; csv, md: the speed per metric and arm)"),
    plot: Optional[Path] = typer.Option(None, "--plot", metavar="FILE",
                                        help="also write decode tok/s against depth for every arm (SVG)"),
) -> None:
    """Render a receipt: gate per depth, speed per metric, decode by depth, verdict and its explanation."""
    from ..history.sealed import read_sealed
    from ..history.trust import near
    from .formats import flat, pick_format
    from .inputs import judging_lock, receipt_path
    from .receipt_view import SPEED_COLUMNS, speed_rows, verdict_line, write_depth_plot

    out_fmt = pick_format(fmt, json_out)
    if plot is not None and not plot.parent.is_dir():
        raise InputError(f"--plot {plot}: directory {plot.parent} not found", "create it or pick another path")
    path = receipt_path(round_id, rounds)
    # the seal and its signer before anything is rendered: exit 2 when edited, unsealed or untrusted
    # the lock the receipt is judged by: --lock, else this checkout's (history.trust.near: never one that only lies
    # beside the receipt, which whoever handed it over could have put there); a --lock that is not there is the
    # caller's typo, not an untrusted receipt
    judging_lock(lock, "the receipt")
    trust = near(path.parent, lock)
    lock = Path(trust.source) if trust.source else (lock or Path("reference.lock"))
    parsed = read_sealed(path, trust).receipt
    if out_fmt == "json":
        print_json(parsed.model_dump(mode="json", by_alias=True))
    elif out_fmt in ("csv", "md"):
        print(flat(SPEED_COLUMNS, speed_rows(parsed), out_fmt))
        if out_fmt == "md":
            print("\n" + verdict_line(parsed))
    else:
        render(parsed, _drift_vs_lock(parsed, lock))
    if plot is not None:
        written = write_depth_plot(parsed, plot)
        (console if out_fmt == "table" else err_console).print(f"plot: {written}", highlight=False)


def _drift_vs_lock(receipt: Receipt, lock: Path) -> list[str]:
    """The reference arm against the lock's baseline slots (when the lock is there and loads)."""
    from ..drift import reference_drift
    from ..errors import ScoreboardError
    from ..lockfile import load_lock

    if not lock.is_file():
        return []
    try:
        return reference_drift(receipt, load_lock(lock))
    except ScoreboardError:
        return []


def render(receipt: Receipt | dict[str, Any], drift: list[str] | None = None) -> None:
    """A receipt on the console, read through its typed model (a dict is parsed first)."""
    from ..history.receipt import parse_receipt

    r = receipt if isinstance(receipt, Receipt) else parse_receipt(receipt)
    c = r.candidate
    console.print(f"[bold]round[/] {r.round_id}  target [bold]{r.target}[/]  seed {r.seed}  "
                  f"candidate {c.label} {c.commit[:12]}{' (dirty)' if c.dirty else ''}")
    cal = r.calibration
    if cal is not None and cal.status == "calibrated":
        extra = cal.model_extra or {}
        console.print(f"bars calibrated by {cal.calibration_id} ({extra.get('seeds')} seeds, margin "
                      f"{extra.get('margin'):g})", highlight=False)
    elif cal is not None and cal.status == "skipped":
        console.print(f"[yellow]no calibration checked[/]: {cal.reason} (moves no slot)", highlight=False)
    if r.aborted is not None:
        ab = r.aborted
        console.print(f"[bold red]ABORTED[/] at {ab.stage}{' (transient)' if ab.transient else ''}: "
                      f"{ab.reason}", highlight=False)
        return
    gate = r.gate
    if gate:
        t = Table(title="correctness gate (KL(ref||cand), nats, full vocabulary, float64)")
        for col in ("depth", "rows", "KL mean", "KL p99", "KL max", "top-1", "ratchet basis", "pass"):
            t.add_column(col, justify="right")
        for d in gate.depths:
            base = d.get("ratchet_baseline")
            t.add_row(str(d["depth"]), str(d["rows"]), f"{d['kl_mean']:.3g}", f"{d['kl_p99']:.3g}",
                      f"{d['kl_max']:.3g}", f"{d['top1']:.4f}", "-" if base is None else f"{base:.3g}",
                      "[green]yes[/]" if d["pass"] else "[red]no[/]")
        console.print(t)
        for g in gate.greedy_check or []:
            console.print(f"checked decode {g['metric']}: greedy tokens match the reference's argmax on "
                          f"{g['top1_vs_reference']:.3f} of positions")
        for p in gate.decode_path or []:
            console.print(f"decode path {p['metric']}: its own step's rows vs the reference's, {p['rows']} rows: KL mean "
                          f"{p['kl_mean']:.3g}, p99 {p['kl_p99']:.3g}, top-1 {p['top1']:.4f} "
                          + ("[green]pass[/]" if p["pass"] else "[red]fail[/]"))
    if r.speed:
        from .receipt_view import depth_table

        _speed_table(r)
        depth_table(r)
        for w in drift or []:
            console.print(f"[yellow]warning:[/] {w}", highlight=False)
    _memory(r.environment)
    if r.stage_seconds:
        console.print("box time by stage: " + ", ".join(f"{k} {float(v):,.1f} s" for k, v in r.stage_seconds.items())
                      + f" (total {sum(float(v) for v in r.stage_seconds.values()):,.1f} s)", highlight=False)
    v = r.verdict
    label = v.label if v else None
    color = {"REJECT": "red", "regression": "red", "inconclusive": "yellow", "none": "white"}.get(label or "", "green")
    console.print(f"[bold {color}]verdict: {label}[/]")
    if v and v.explanation:
        console.print(v.explanation, highlight=False)
    for reason in v.reasons if v else []:
        console.print(f"  - {reason}", highlight=False)


def _memory(env: EnvironmentRec) -> None:
    """Per rank: the fit check's prediction next to the measured peak of the candidate's processes."""
    fit, peaks = env.fit, env.peak_memory
    if not fit or not peaks:
        return
    for p in peaks:
        dev = "" if p.device_gib is None else f", device peak {p.device_gib:.2f} GiB"
        host = "?" if p.host_rss_gib is None else f"{p.host_rss_gib:.2f}"
        console.print(f"memory rank {p.rank}: fit predicted {fit.need_gib_per_rank:.2f} GiB per rank "
                      f"(weights {fit.lines.get('weights', 0):.2f}); measured host RSS peak "
                      f"{host} GiB{dev}", highlight=False)


def _speed_table(r: Receipt) -> None:
    from ..tiers import ESTIMATOR, POOLED_MEDIAN, receipt_target, summarize_speed

    target = receipt_target(r)
    blocks = r.speed.blocks if r.speed and r.speed.blocks is not None else "?"
    t = Table(title=f"speed ({blocks} interleaved blocks, tok/s from raw ns; value = "
                    f"{ESTIMATOR}, the verdict's estimator)")
    for col in ("metric", "role", "arm", f"value ({ESTIMATOR})", POOLED_MEDIAN, "MAD", "CV", "reps",
                "candidate/reference, same round [95% CI]"):
        t.add_column(col, justify="right")
    for ms in summarize_speed(r, target):
        first = True
        for arm, st in ms.arms.items():
            ci = ""
            if first and ms.vs_reference is not None:
                c = ms.vs_reference
                ci = f"{c.point:.3f} [{c.low:.3f}, {c.high:.3f}]"
            t.add_row(ms.name if first else "", ms.role if first else "", arm, f"{st.value:.2f}", f"{st.median:.2f}",
                      f"{st.mad:.2f}", f"{st.cv:.1%}", str(st.n), ci)
            first = False
    console.print(t)
