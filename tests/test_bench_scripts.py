"""The GPU box's shell jobs (bench/*.sh): they parse, the ladder refuses an unknown phase before touching
anything, and the poll brings back what a finished job left. None of them runs a round here."""

from __future__ import annotations

import os
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((REPO / "bench").glob("*.sh"))
LADDER = REPO / "bench" / "h200_ladder.sh"
POLL = REPO / "bench" / "h200_poll.sh"


def bash(args: list[str], env: dict[str, str] | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_there_are_scripts() -> None:
    assert LADDER in SCRIPTS and POLL in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(script: Path) -> None:
    out = bash(["-n", str(script)])
    assert out.returncode == 0, out.stderr


def test_ladder_refuses_an_unknown_phase_by_name(tmp_path: Path) -> None:
    work = tmp_path / "work"
    out = bash([str(LADDER), str(work), str(tmp_path), "HEAD", "HEAD"], {"PHASES": "cal ladder wdie profile"})
    assert out.returncode == 1
    assert out.stderr.strip() == ('unknown phase \'wdie\' in PHASES="cal ladder wdie profile"; '
                                  "the phases: cal calext round ladder wide widestep profile start sweep sandbox diag")
    assert not work.exists()  # refused before the job made anything


def test_ladder_known_phases_pass_to_the_usage_check(tmp_path: Path) -> None:
    out = bash([str(LADDER), str(tmp_path / "work")], {"PHASES": "widestep profile"})
    assert out.returncode == 1
    assert "unknown phase" not in out.stderr and out.stderr.startswith("usage: [PHASES=")


@pytest.mark.parametrize(("wide_step", "phases"), [("0", "cal ladder wide profile"),
                                                   ("1", "cal ladder wide widestep profile")])
def test_ladder_default_phases(wide_step: str, phases: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PHASES"} | {"WIDE_STEP": wide_step}
    out = subprocess.run(["bash", str(LADDER)], capture_output=True, text=True, timeout=30, env=env)
    assert out.returncode == 1
    assert out.stderr.startswith(f'usage: [PHASES="{phases}"] bash ')


def test_poll_brings_back_a_finished_job(tmp_path: Path) -> None:
    work, out_dir = tmp_path / "work", tmp_path / "out"
    work.mkdir(), out_dir.mkdir()
    (work / "job.log").write_text("== setup at 0 s\nstep1 rc 0\nverdict: XL\nsomething else\n")
    (work / "step1.log").write_text("verdict: XL\n")
    with tarfile.open(work / "state.tgz", "w:gz") as tar:
        tar.add(work / "step1.log", arcname="rounds/x.json")
    (work / "done").touch()
    out = bash([str(POLL), str(out_dir), str(work), "60"], timeout=20)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["JOB DONE", "== setup at 0 s", "step1 rc 0", "verdict: XL"]
    assert (out_dir / "state.tgz").read_bytes() == (work / "state.tgz").read_bytes()
    with tarfile.open(out_dir / "logs.tgz") as tar:
        names = set(tar.getnames())
    assert {"./job.log", "./step1.log", "./done"} <= names and "./state.tgz" not in names


def test_poll_returns_when_the_job_is_gone(tmp_path: Path) -> None:
    work, out_dir = tmp_path / "work", tmp_path / "out"
    work.mkdir(), out_dir.mkdir()
    (work / "job.log").write_text("== setup at 0 s\n")
    dead = subprocess.Popen(["true"])
    dead.wait()
    (work / "pid").write_text(f"{dead.pid}\n")
    out = bash([str(POLL), str(out_dir), str(work), "120"], timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == f"job {dead.pid} is not running and left no done file: it died"


def test_a_poll_cut_off_mid_wait_has_already_brought_back_the_job_s_state(tmp_path: Path) -> None:
    """The device kills a call at its limit: what the poll copied while it waited is what comes back."""
    work, out_dir = tmp_path / "work", tmp_path / "out"
    work.mkdir(), out_dir.mkdir()
    (work / "job.log").write_text("== round1 at 490 s\n")
    with tarfile.open(work / "state.tgz", "w:gz") as tar:
        tar.add(work / "job.log", arcname="rounds/r.json")
    job = subprocess.Popen(["sleep", "120"])  # the job, still running
    (work / "pid").write_text(f"{job.pid}\n")
    poll = subprocess.Popen(["bash", str(POLL), str(out_dir), str(work), "600"], env={**os.environ, "EVERY": "1"},
                            stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (out_dir / "logs.tgz").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(1.5)
        os.killpg(poll.pid, 9)  # cut off, as at the device's limit: no end-of-poll copy
        poll.wait()
    finally:
        job.kill(), job.wait()
    assert (out_dir / "state.tgz").read_bytes() == (work / "state.tgz").read_bytes()
    with tarfile.open(out_dir / "logs.tgz") as tar:
        assert "./job.log" in tar.getnames()
    assert not list(out_dir.glob(".*"))  # no half-written copy left under its final name or beside it


LEASE = REPO / "bench" / "lease.sh"


def _lease_box(tmp_path: Path, card: str) -> tuple[Path, dict[str, str]]:
    """A copy of lease.sh beside a stub ladder that records what it was given, and an nvidia-smi naming `card`."""
    bench, bin_dir = tmp_path / "bench", tmp_path / "bin"
    bench.mkdir(), bin_dir.mkdir()
    (bench / "lease.sh").write_bytes(LEASE.read_bytes())
    (bench / "h200_ladder.sh").write_text('echo "args: $*"; echo "PHASES=$PHASES GPU_TARGET=$GPU_TARGET"\n')
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\necho '{card}'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    return bench / "lease.sh", {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def _job_log(work: Path) -> list[str]:
    for _ in range(100):  # the job runs detached (setsid): wait for its log
        log = (work / "job.log").read_text() if (work / "job.log").exists() else ""
        if "PHASES=" in log:
            return log.splitlines()
        subprocess.run(["sleep", "0.1"])
    return []


def test_lease_runs_the_plan_of_the_card_it_got(tmp_path: Path) -> None:
    lease, env = _lease_box(tmp_path, "NVIDIA H100 80GB HBM3")
    kit, work = tmp_path / "kit", tmp_path / "work"
    kit.mkdir()
    (kit / "plan.h200").write_text('PHASES="round ladder"\nGPU_TARGET=k3-gpu-long-h200\nBASE=aaaa\nSTEPS="bbbb"\n')
    (kit / "plan.h100").write_text('PHASES="calext round"\nGPU_TARGET=k3-gpu-long-h100\nBASE=cccc\nSTEPS="dddd eeee"\n')
    out = bash([str(lease), str(kit), str(work)], env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"card: NVIDIA H100 80GB HBM3 -> plan {kit}/plan.h100\n")
    assert _job_log(work) == [f"args: {work} {kit} cccc dddd eeee",
                              "PHASES=calext round GPU_TARGET=k3-gpu-long-h100"]


def test_lease_without_a_plan_for_the_card_starts_nothing(tmp_path: Path) -> None:
    lease, env = _lease_box(tmp_path, "NVIDIA A100-SXM4-80GB")
    kit, work = tmp_path / "kit", tmp_path / "work"
    kit.mkdir()
    (kit / "plan.h200").write_text("BASE=aaaa\n")
    out = bash([str(lease), str(kit), str(work)], env)
    assert out.returncode == 1
    assert f"no plan for this card ({kit}/plan.a100-sxm4-80gb)" in out.stderr
    assert not work.exists()


@pytest.mark.parametrize("budget,phases", [("1400", "round start"), ("1300", "round start"), ("1299", "start"),
                                           ("10", "verify"), ("", "round start")])
def test_lease_runs_the_plan_of_its_card_that_needs_the_most_within_the_budget(tmp_path: Path, budget, phases):
    lease, env = _lease_box(tmp_path, "NVIDIA H100 80GB HBM3")
    kit, work = tmp_path / "kit", tmp_path / "work"
    kit.mkdir()
    (kit / "plan.h100").write_text('PHASES="round start"\nGPU_TARGET=t\nBASE=cccc\nNEEDS_S=1300\n')
    (kit / "plan.h100.diag").write_text('PHASES="start"\nGPU_TARGET=t\nBASE=cccc\nNEEDS_S=500\n')
    (kit / "plan.h100.least").write_text('PHASES="verify"\nGPU_TARGET=t\nBASE=cccc\n')  # needs 0
    (kit / "plan.h200.diag").write_text('PHASES="cal"\nGPU_TARGET=u\nBASE=aaaa\nNEEDS_S=1\n')  # another card's
    out = bash([str(lease), str(kit), str(work)] + ([budget] if budget else []), env)
    assert out.returncode == 0, out.stderr
    assert _job_log(work) == [f"args: {work} {kit} cccc", f"PHASES={phases} GPU_TARGET=t"]


def test_lease_refuses_a_budget_no_plan_fits_or_that_is_not_seconds(tmp_path: Path) -> None:
    lease, env = _lease_box(tmp_path, "NVIDIA H100 80GB HBM3")
    kit, work = tmp_path / "kit", tmp_path / "work"
    kit.mkdir()
    (kit / "plan.h100").write_text('PHASES="round"\nBASE=cccc\nNEEDS_S=900\n')
    out = bash([str(lease), str(kit), str(work), "600"], env)
    assert out.returncode == 1 and "no plan for this card fits the budget of 600 s" in out.stderr
    out = bash([str(lease), str(kit), str(work), "10m"], env)
    assert out.returncode == 1 and "BUDGET_S must be whole seconds, not '10m'" in out.stderr
    (kit / "plan.h100.diag").write_text('PHASES="start"\nBASE=cccc\nNEEDS_S=10m\n')  # not read as 0, i.e. free
    out = bash([str(lease), str(kit), str(work), "1000"], env)
    assert out.returncode == 1 and f"{kit}/plan.h100.diag: NEEDS_S must be whole seconds" in out.stderr
    assert not work.exists()


def _replan(work: Path) -> subprocess.CompletedProcess:
    """The ladder's replan function alone (cut out of the script), run on a plan of PHASES="round" and no STEPS."""
    fn = subprocess.run(["sed", "-n", "/^replan() {/,/^}/p", str(LADDER)], capture_output=True, text=True).stdout
    assert fn.startswith("replan() {")
    prog = ("set -u\nALL_PHASES=\"cal calext round ladder\"\nPHASES=round\nSTEPS=()\nN=0\nWORK=$1\n"
            "stamp() { echo \"== $*\"; }\n" + fn + '\nreplan\necho "PHASES=$PHASES N=$N STEPS=${STEPS[*]}"\n')
    return bash(["-c", prog, "replan-test", str(work)])


@pytest.mark.parametrize(("text", "want"), [
    (None, "PHASES=round N=0 STEPS="),
    ('PHASES=ladder\nSTEPS="abc123 def456"\n', "PHASES=ladder N=2 STEPS=abc123 def456"),
    ('PHASES="ladder wdie"\nSTEPS=abc\n', "PHASES=round N=0 STEPS="),
    ("STEPS=abc\n", "PHASES=round N=0 STEPS="),
])
def test_a_replan_written_during_the_build_replaces_the_phases(tmp_path: Path, text: str | None, want: str) -> None:
    """$WORK/replan, when written, replaces PHASES and STEPS; one naming an unknown phase, or none, leaves the plan."""
    if text is not None:
        (tmp_path / "replan").write_text(text)
    out = _replan(tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == want
    if text and "wdie" in text:
        assert "replan: unknown phase 'wdie'; the plan stands" in out.stdout


MAKE_KIT = REPO / "bench" / "make_kit.sh"


def test_make_kit_writes_every_plan_at_the_base_and_the_lease_picks_by_budget(tmp_path: Path) -> None:
    """The kit's plans come from bench/plans/ with BASE filled in; the lease then runs the lent card's plan that
    needs the most within the budget (a budget after failed starts gets the diagnosis, not a cut-off round)."""
    kit = tmp_path / "kit"
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    out = bash([str(MAKE_KIT), "--plans-only", str(kit), head])
    assert out.returncode == 0, out.stderr
    templates = sorted(p.name for p in (REPO / "bench" / "plans").glob("plan.*"))
    assert {"plan.h100", "plan.h100.diag", "plan.h200", "plan.h200.diag"} <= set(templates)
    assert sorted(p.name for p in kit.glob("plan.*")) == templates
    for name in templates:
        text = (kit / name).read_text()
        assert f"\nBASE={head}\n" in text and "@BASE@" not in text, name
    assert (kit / "first.sh").read_bytes() == (REPO / "bench" / "first.sh").read_bytes()
    lease, env = _lease_box(tmp_path, "NVIDIA H100 80GB HBM3")
    for budget, want in (("2000", 'PHASES=round start GPU_TARGET=k3-wide-long-h100'),
                         ("600", 'PHASES=start GPU_TARGET=k3-wide-long-h100')):
        work = tmp_path / f"work-{budget}"
        r = bash([str(lease), str(kit), str(work), budget], env)
        assert r.returncode == 0, r.stderr
        assert _job_log(work) == [f"args: {work} {kit} {head}", want]


def test_make_kit_refuses_a_base_that_is_not_a_commit_of_main(tmp_path: Path) -> None:
    kit = tmp_path / "kit"
    out = bash([str(MAKE_KIT), "--plans-only", str(kit), "no-such-commit"])
    assert out.returncode == 1 and "BASE 'no-such-commit' is not a commit of" in out.stderr
    assert not kit.exists()


def test_make_kit_refuses_a_plan_template_without_its_base_line_and_writes_nothing(tmp_path: Path) -> None:
    """A template whose BASE line cannot be filled would send a lease to whatever BASE it names: refused by path,
    before the kit's directory exists."""
    repo = tmp_path / "repo"
    (repo / "bench" / "plans").mkdir(parents=True)
    (repo / "bench" / "make_kit.sh").write_bytes(MAKE_KIT.read_bytes())
    (repo / "bench" / "first.sh").write_text("exit 0\n")
    (repo / "bench" / "plans" / "plan.h100").write_text('PHASES="round"\nBASE=@BASE@\nNEEDS_S=900\n')
    (repo / "bench" / "plans" / "plan.h100.diag").write_text('PHASES="start"\nBASE=1234567\nNEEDS_S=400\n')
    for cmd in (["init", "-q", "-b", "main"], ["add", "-A"],
                ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "plans"]):
        subprocess.run(["git", "-C", str(repo), *cmd], check=True, capture_output=True)
    kit = tmp_path / "kit"
    out = bash([str(repo / "bench" / "make_kit.sh"), "--plans-only", str(kit)])
    assert out.returncode == 1
    assert f"{repo}/bench/plans/plan.h100.diag: no line BASE=@BASE@ to fill; nothing written" in out.stderr
    assert not kit.exists()
