"""A newcomer's first hour: displays that cannot lie, values validated up front with the option's name,
the ladder per slot, one estimator name, the reference-drift warning, and the CLI's conventions."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from history_factory import build_history
from receipt_factory import REF_SCORED_SLOT, make_receipt
from scoreboard.history.records import write_receipt

REPO = Path(__file__).resolve().parent.parent
FLAGSHIP = "kimi-k3-h200x8-iq1s"


def cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    from scoreboard.cli.main import run

    monkeypatch.setattr(sys, "argv", ["scoreboard", *args])
    monkeypatch.setenv("COLUMNS", "200")
    try:
        run()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, " ".join(out.err.split())


@pytest.fixture
def history(tmp_path):
    return build_history(tmp_path / "h")


def _edit(path: Path, fn) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    fn(data)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------------------------
# displays check the seal first

def test_round_show_renders_a_sealed_receipt(history, monkeypatch, capsys):
    lock, rounds, ids = history
    code, out, _ = cli(monkeypatch, capsys, "round", "show", ids[3], "--rounds", str(rounds), "--lock", str(lock))
    assert code == 0 and "verdict: M" in out
    assert "geomean of block medians" in out and "median of all reps" in out  # one estimator, named


@pytest.mark.parametrize("how", ["edited", "unsealed"])
@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_round_show_refuses_an_edited_or_unsealed_receipt(history, monkeypatch, capsys, how, json_flag):
    lock, rounds, ids = history
    path = rounds / f"{ids[3]}.json"

    def edit(d):
        if how == "edited":
            d["verdict"]["label"] = "XL"
        else:
            del d["seal"]

    _edit(path, edit)
    code, out, err = cli(monkeypatch, capsys, "round", "show", ids[3], "--rounds", str(rounds), *json_flag)
    assert code == 2
    assert ("TAMPERED" in err and "verdict.label" in err) if how == "edited" else "UNSEALED" in err
    assert "verdict" not in out and "XL" not in out  # nothing rendered as if it were a measurement


def test_ladder_is_per_slot_and_states_its_count(history, monkeypatch, capsys):
    lock, rounds, ids = history
    code, out, _ = cli(monkeypatch, capsys, "ladder", "--rounds", str(rounds), "--json", "--lock", str(lock))
    assert code == 0
    data = json.loads(out)
    comp = data["compounding"]
    assert len(comp) == 2  # decode and prefill: two series, never one product
    dec = next(c for k, c in comp.items() if "DECODE" in k)
    pre = next(c for k, c in comp.items() if "PREFILL" in k)
    assert dec["total_ratio"] == pytest.approx(56 / 50) and dec["steps"] == 2
    assert dec["geomean_step"] == pytest.approx((56 / 50) ** 0.5)
    assert pre["total_ratio"] == pytest.approx(1000 / 900)
    steps = data["steps"]
    assert [s["tier"] for s in steps if "DECODE" in s["slot"]] == ["BASELINE", "S", "M"]
    assert [s["date"] for s in steps if "DECODE" in s["slot"]] == [
        "2026-11-29T10:00:00Z", "2026-11-30T10:00:00Z", "2026-12-01T10:00:00Z"]  # the rounds' dates
    assert [s["reference"] for s in steps if "DECODE" in s["slot"]] == pytest.approx([40.0, 40.0, 41.0])


def test_ladder_text_and_plot(history, monkeypatch, capsys, tmp_path):
    lock, rounds, ids = history
    plot = tmp_path / "ladder.svg"
    code, out, _ = cli(monkeypatch, capsys, "ladder", "--rounds", str(rounds), "--plot", str(plot), "--lock", str(lock))
    assert code == 0
    assert "over 2 step(s)" in out and "over those 2" in out
    svg = plot.read_text(encoding="utf-8")
    assert svg.count('class="slot-panel"') == 2
    for text in ("throughput (tok/s", "round, in ledger order (candidate commit, date)", "reference, same round",
                 "aaaaaaaa", "2026-11-30", ">S 52<", ">M 56<", "BASELINE 50"):
        assert text in svg, text


@pytest.mark.parametrize("columns", [None, "0", "wide"])
def test_piped_ladder_keeps_round_ids_and_commits_whole(history, tmp_path, columns):
    """Redirected to a file (no terminal, no COLUMNS), rich would lay the table out at 80 columns and cut every
    round id to "2026-1…": a log or a closing note could not name the round. The piped console is wider. A
    COLUMNS that is no positive integer counts as unset: at COLUMNS=0 rich printed nothing, an error neither."""
    import os

    lock, rounds, ids = history
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"} | ({} if columns is None else {"COLUMNS": columns})
    bad = subprocess.run([sys.executable, "-m", "scoreboard", "round", "show", "no-such-round", "--rounds",
                          str(rounds)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert bad.returncode == 1 and "no receipt 'no-such-round'" in bad.stderr, bad
    args = [sys.executable, "-m", "scoreboard", "ladder", "--rounds", str(rounds), "--lock", str(lock)]
    proc = subprocess.run([*args, "--plot", str(tmp_path / "l.svg")], capture_output=True, text=True, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "…" not in proc.stdout
    steps = json.loads(subprocess.run([*args, "--json"], capture_output=True, text=True, env=env, cwd=tmp_path,
                                      check=True).stdout)["steps"]
    assert steps and all(st["round_id"] in proc.stdout and st["commit"][:12] in proc.stdout for st in steps), steps


def test_ladder_marks_a_step_whose_receipt_was_edited(history, monkeypatch, capsys, tmp_path):
    lock, rounds, ids = history
    _edit(rounds / f"{ids[1]}.json", lambda d: d["verdict"].__setitem__("label", "XL"))
    code, out, err = cli(monkeypatch, capsys, "ladder", "--rounds", str(rounds), "--plot", str(tmp_path / "l.svg"),
                         "--lock", str(lock))
    assert code == 2 and "UNVERIFIED" in out and "TAMPERED" in err and "UNTRUSTED" not in err
    assert "XL" not in out


# ----------------------------------------------------------------------------------------------
# values validated up front, with the option's name

@pytest.mark.parametrize("args,match", [
    (["ladder", "--plot", "/no/such/dir/ladder.svg"], "--plot /no/such/dir/ladder.svg: directory /no/such/dir"),
    (["report", "--out", "/no/such/dir/r.html"], "--out /no/such/dir/r.html: directory /no/such/dir"),
    (["weights", "verify", "--target", "k3-mini-cpu", "--workers", "-1"], "--workers"),
    (["round", "run", "--seed", "-1", "--candidate", "deadbeef1234"], "--seed -1"),
    (["fit"], "--target is required"),
])
def test_bad_values_exit_1_naming_the_option(monkeypatch, capsys, args, match, tmp_path):
    monkeypatch.chdir(REPO)
    code, out, err = cli(monkeypatch, capsys, *args, *(["--rounds", str(tmp_path / "r")] if args[0] == "round" else []))
    assert code == 1, err
    assert match in err
    assert not (tmp_path / "r").exists()


# ----------------------------------------------------------------------------------------------
# reference drift

def test_reference_drift_warns_beyond_the_policy_tolerance():
    from scoreboard.drift import reference_drift
    from scoreboard.history.receipt import parse_receipt

    near = parse_receipt(make_receipt(reference_tps=35.0))  # 12.5% below a 40 tok/s baseline: within 25%
    far = parse_receipt(make_receipt(reference_tps=28.0))  # 30% below: the box is not what it was
    assert reference_drift(near, None, {REF_SCORED_SLOT: 40.0}) == []
    (w,) = reference_drift(far, None, {REF_SCORED_SLOT: 40.0})
    assert "0.70x its baseline slot" in w and "reference_drift_max 25%" in w and "box is not what it was" in w
    assert reference_drift(far, None, {}) == []  # no baseline yet: nothing to compare


def test_round_show_prints_the_drift_warning(history, monkeypatch, capsys):
    lock, rounds, ids = history
    pr = make_receipt(is_main=False, label="none", reference_tps=20.0, created_at="2026-12-01T12:00:00Z",
                      round_hex="000000aa")
    path = write_receipt(pr, rounds)
    code, out, _ = cli(monkeypatch, capsys, "round", "show", str(path), "--lock", str(lock))
    assert code == 0
    assert "warning:" in out and "the box is not what it was" in " ".join(out.split())


# ----------------------------------------------------------------------------------------------
# conventions

def test_version_and_python_dash_m(monkeypatch, capsys):
    from scoreboard import __version__

    code, out, _ = cli(monkeypatch, capsys, "--version")
    assert code == 0 and out.strip() == f"scoreboard {__version__}"
    proc = subprocess.run([sys.executable, "-m", "scoreboard", "--version"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0 and proc.stdout.strip() == f"scoreboard {__version__}"


def test_help_shows_flags_as_flags_and_offers_completion(monkeypatch, capsys):
    code, out, _ = cli(monkeypatch, capsys, "engines", "--help")
    assert code == 0 and "--json" in out and "<bool>" not in out
    code, out, _ = cli(monkeypatch, capsys, "round", "run", "--help")
    assert "<bool>" not in out and "--seal" in out and "<int>" in out
    code, out, _ = cli(monkeypatch, capsys, "--help")
    assert "--install-completion" in out and "--show-completion" in out
    assert "Exit codes" in out


def test_target_is_an_option_everywhere_and_the_old_form_still_works(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    code, new, err_new = cli(monkeypatch, capsys, "fit", "--target", FLAGSHIP, "--node-class", "--json")
    assert code == 0 and "deprecated" not in err_new
    code, old, err_old = cli(monkeypatch, capsys, "fit", FLAGSHIP, "--node-class", "--json")
    assert code == 0 and json.loads(old) == json.loads(new)
    assert "deprecated" in err_old and f"scoreboard fit --target {FLAGSHIP}" in err_old
    code, _, err = cli(monkeypatch, capsys, "fit", FLAGSHIP, "--target", "k3-mini-cpu")
    assert code == 1 and "target given twice" in err


def test_env_exits_1_when_the_box_is_not_the_node_class(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    code, out, err = cli(monkeypatch, capsys, "env", "--target", FLAGSHIP, "--json")
    assert json.loads(out)["node_mismatches"]
    assert code == 1 and "node class" in err


def test_progress_lines_when_not_on_a_terminal():
    """Output to a file: a plain line per progress event (throttled) and a heartbeat while a stage is quiet."""
    from rich.console import Console

    from scoreboard.cli.round import RichReporter

    buf = io.StringIO()
    rep = RichReporter(Console(file=buf, force_terminal=False, width=200), interval=0.2)
    rep("stage", name="speed")
    rep("progress", task="speed blocks", done=0, total=4, message="block 0: reference")
    time.sleep(1.5)
    rep("progress", task="speed blocks", done=4, total=4, message="done")
    rep.close()
    text = buf.getvalue()
    assert "== speed" in text and "speed blocks 4/4 done" in text
    assert len(re.findall(r"\.\.\. speed: \d+ s so far \(last: speed blocks 0/4", text)) >= 2
    assert not [t for t in __import__("threading").enumerate() if t.name == "scoreboard-progress"]


def test_the_readme_lists_every_command_and_the_exit_codes():
    from scoreboard.cli.main import COMMANDS, app

    import typer.main

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    table = "\n".join(line for line in readme.splitlines() if line.startswith("| `scoreboard"))
    group = typer.main.get_group(app)
    for name in (n for n, _ in COMMANDS):
        cmd = group.commands[name]
        subs = getattr(cmd, "commands", None)
        for full in ([f"{name} {s}" for s in subs] if subs else [name]):
            assert re.search(rf"`(scoreboard )?{re.escape(full)}\b", table), f"README command table lacks {full}"
    for needle in ("tier --receipt", "--metric", "frontier lower --target", "--slot", "--value", "frontier resume",
                   "scoreboard report", "gate calibrate"):
        assert needle in table, needle
    for where in (readme, (REPO / "docs" / "receipt-format.md").read_text(encoding="utf-8")):
        assert "| 0 |" in where and "| 1 |" in where and "| 2 |" in where
    assert "pip install -U scoreboard" not in readme


@pytest.mark.parametrize("fmt", ["md", "csv"])
def test_ladder_in_markdown_and_csv(history, monkeypatch, capsys, fmt):
    """`--format md` pastes into a PR as llama-bench -o md does; csv is one row per step with a header."""
    import csv as csv_mod

    lock, rounds, ids = history
    code, out, _ = cli(monkeypatch, capsys, "ladder", "--rounds", str(rounds), "--format", fmt, "--lock", str(lock))
    assert code == 0
    lines = out.strip().splitlines()
    if fmt == "md":
        assert lines[0].startswith("| slot | metric | date | round |") and set(lines[1]) <= set("|-: ")
        assert "---:" in lines[1]  # numbers right-aligned
        assert sum(ids[3] in line for line in lines) == 2 and "| M |" in out
    else:
        rows = list(csv_mod.DictReader(lines))
        assert [r["tier"] for r in rows if "DECODE" in r["slot"]] == ["BASELINE", "S", "M"]
        assert float(rows[-1]["frontier after"]) == pytest.approx(1000.0)
    code, _, err = cli(monkeypatch, capsys, "ladder", "--rounds", str(rounds), "--format", "mdd")
    assert code == 1 and "did you mean --format md" in err


def test_the_ladder_plot_draws_decode_against_depth(history, monkeypatch, capsys, tmp_path):
    lock, rounds, ids = history
    plot = tmp_path / "l.svg"
    code, _, _ = cli(monkeypatch, capsys, "ladder", "--rounds", str(rounds), "--plot", str(plot), "--lock", str(lock))
    svg = plot.read_text(encoding="utf-8")
    assert code == 0 and 'class="depth-profile"' in svg and "context depth (tokens in the cache, log scale)" in svg
    assert 'data-arm="reference" data-depth="512"' in svg and 'data-arm="candidate" data-depth="512"' in svg


def test_every_command_that_takes_a_target_takes_dash_t():
    """The README says every command takes `--target/-t`: `gate show` and `gate calibrate` took a positional only,
    `tier` and `frontier lower` had no `-t`. Checked over the real command tree, so a new command cannot miss it."""
    import typer.main

    from scoreboard.cli.main import app

    def walk(cmd, path):
        subs = getattr(cmd, "commands", None)
        if subs:
            for name, sub in subs.items():
                yield from walk(sub, [*path, name])
        else:
            yield " ".join(path), cmd

    seen = []
    for name, cmd in walk(typer.main.get_group(app), []):
        for p in cmd.params:
            if p.name == "target" and getattr(p, "opts", None):
                seen.append(name)
                assert "--target" in p.opts and "-t" in p.opts, f"{name}: {p.opts}"
    assert {"gate show", "gate calibrate", "tier", "frontier lower", "frontier rebase", "round run", "ladder",
            "report", "fit", "env"} <= set(seen), seen


def test_gate_show_takes_the_target_as_an_option_and_the_old_form_with_a_note(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    code, new, err_new = cli(monkeypatch, capsys, "gate", "show", "-t", "k3-mini-cpu", "--json")
    assert code == 0 and "deprecated" not in err_new
    code, old, err_old = cli(monkeypatch, capsys, "gate", "show", "k3-mini-cpu", "--json")
    assert code == 0 and json.loads(old) == json.loads(new)
    assert "deprecated" in err_old and "scoreboard gate show --target k3-mini-cpu" in err_old


@pytest.mark.parametrize("args,says", [
    (["verify", "--rounds", "roundz"], "--rounds roundz: directory not found, and rounds is next: did you mean --rounds rounds?"),
    (["round", "run", "--rounds", "roundz"], "did you mean --rounds rounds? (for a new history create it first"),
    (["ladder", "--target", "k3-mini-cu"], "--target k3-mini-cu: no such target"),
    (["ladder", "--target", "k3-mini-cu"], "did you mean --target k3-mini-cpu?"),
    (["report", "--target", "k3-mini-cu", "--out", "OUT"], "did you mean --target k3-mini-cpu?"),
    (["report", "--rounds", "roundz", "--out", "OUT"], "did you mean --rounds rounds?"),
    (["round", "show", "nope", "--rounds", "roundz"], "did you mean --rounds rounds?"),
    (["gate", "show", "-t", "k3-mini-cpu", "--rounds", "roundz"], "did you mean --rounds rounds?"),
    (["frontier", "resume", "--rounds", "roundz"], "did you mean --rounds rounds?"),
    (["fit", "-t", "k3-mini-cpu", "--ctx", "-5"], "--ctx -5: a size cannot be negative"),
    (["fit", "-t", "k3-mini-cpu", "--ranks", "-2", "--node-class"], "--ranks -2: a size cannot be negative"),
    (["fit", "-t", "k3-mini-cpu", "--usable-gib", "-1"], "--usable-gib -1.0: a size cannot be negative"),
    (["gate", "calibrate", "-t", "k3-mini-cpu", "--seeds", "-3", "--no-seal"], "--seeds -3: a size cannot be negative"),
    (["ladder", "--format", "yaml"], "--format yaml: not one of table, json, csv, md"),
])
def test_a_misspelled_or_negative_option_is_an_error_naming_the_near_match(monkeypatch, capsys, tmp_path, args, says):
    """`verify --rounds roundz` reported 12 "hand-edited" slots (exit 2); `ladder --target k3-mini-cu` said "no frontier
    has moved yet" (exit 0); `report --target k3-mini-cu` wrote an empty report; `fit --ctx -5` priced a negative KV
    cache. Each is an input error now: exit 1, the option and its near match named, nothing written."""
    monkeypatch.chdir(REPO)
    out_file = tmp_path / "r.html"
    code, out, err = cli(monkeypatch, capsys, *[str(out_file) if a == "OUT" else a for a in args])
    assert code == 1, (out, err)
    assert says in err, err
    assert not out_file.exists()


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("args,says", [
    (["--target", "k3-gpu-h200"], "this box is not of node class 'h200x1' that target 'k3-gpu-h200' is measured on"),
    (["--candidate", "EMPTY"], "engines holds no sparkinfer engine"),
    (["--reference-source", "foo://bar"], "--reference-source: reference source 'foo://bar': not 'pin', git+<url>@<rev>"),
])
def test_round_run_input_errors_write_nothing(tmp_path, args, says):
    """On a CPU box `round run --target k3-gpu-h200`, and a --candidate whose engines/ is empty, each sealed an
    ABORTED receipt and a ledger line; a bad --reference-source passed unread while the build was cached. All three
    are refused before any receipt exists: exit 1, the next command named, the repository's history untouched."""
    import shutil

    work = tmp_path / "w"
    work.mkdir()
    shutil.copytree(REPO / "rounds", work / "rounds")
    shutil.copy2(REPO / "reference.lock", work / "reference.lock")
    (tmp_path / "empty" / "engines").mkdir(parents=True)
    before = _snapshot(work)
    argv = [str(tmp_path / "empty") if a == "EMPTY" else a for a in args]
    proc = subprocess.run([sys.executable, "-m", "scoreboard", "round", "run", *argv], capture_output=True, text=True,
                          cwd=work, env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    err = " ".join(proc.stderr.split())
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert says in err and "next:" in err
    assert _snapshot(work) == before


def test_a_long_stage_shows_what_is_left():
    """Stages of more than a minute (the speed stage on a 2-core box: many minutes) say how long is left, from
    the pace of their own progress events; a short one says nothing."""
    from rich.console import Console

    from scoreboard.cli.progress import eta_text
    from scoreboard.cli.round import RichReporter

    assert eta_text(40.0, 2, 10) == "~3 min 20 s left"  # 20 s a block, 10 to go
    assert eta_text(10.0, 5, 5) == ""  # 20 s in all: short
    assert eta_text(0.0, 0, 8) == "" and eta_text(30.0, 3, 0) == ""
    now = [0.0]
    buf = io.StringIO()
    rep = RichReporter(Console(file=buf, force_terminal=False, width=200), interval=5.0, clock=lambda: now[0])
    rep("stage", name="speed")
    for done, msg in ((0, "block 0: reference"), (1, "block 0: candidate"), (2, "block 1: reference")):
        rep("progress", task="speed blocks", done=done, total=8, message=msg)
        now[0] += 30.0  # 30 s a launch
    rep.close()
    text = buf.getvalue()
    assert "speed blocks 1/8 block 0: candidate (~3 min 30 s left)" in text, text
    assert "speed blocks 2/8 block 1: reference (~3 min 00 s left)" in text, text


def test_round_show_with_a_missing_lock_is_an_input_error(history, monkeypatch, capsys):
    """A mistyped --lock names the option and the fix (exit 1), never "UNTRUSTED receipt" (exit 2)."""
    lock, rounds, ids = history
    code, out, err = cli(monkeypatch, capsys, "round", "show", ids[3], "--rounds", str(rounds),
                         "--lock", str(lock) + ".typo")
    assert code == 1 and "--lock" in err and "lock file not found" in err and "UNTRUSTED" not in err + out
