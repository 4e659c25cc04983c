"""CI pins: the `uses:` checker on sample workflows, and the project's audit-pins.yml parsed and simulated
(triggers, least permissions, SHA pinning, which job runs for each exit code and event)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from scoreboard.pins.report import MARKER
from scoreboard.pins.workflows import check_workflows, classify

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / ".github" / "workflows" / "audit-pins.yml"
SHA = "11bd71901bbe5b1630ceea73d27597364c9af683"


@pytest.mark.parametrize("spec,ok", [
    (f"actions/checkout@{SHA}", True),
    (f"github/codeql-action/init@{SHA}", True),
    (f"octo/repo/.github/workflows/reusable.yml@{SHA}", True),
    ("./.github/actions/local", True),
    ("docker://alpine@sha256:" + "a" * 64, True),
    ("actions/checkout@v4", False),
    ("actions/checkout@main", False),
    ("actions/checkout@11bd719", False),
    ("actions/checkout@" + SHA.upper(), False),
    ("actions/checkout", False),
    ("docker://alpine:3.20", False),
])
def test_classify(spec, ok):
    assert (classify(spec) is None) is ok


def test_checker_reports_each_unpinned_use_with_its_line(tmp_path):
    wf = tmp_path / ".github" / "workflows"
    wf.mkdir(parents=True)
    (wf / "good.yml").write_text(f"jobs:\n  a:\n    steps:\n      - uses: actions/checkout@{SHA} # v4.2.2\n"
                                 f"      - uses: \"actions/setup-python@{SHA}\"\n      - uses: ./local\n")
    (wf / "bad.yaml").write_text("jobs:\n  a:\n    steps:\n      - name: x\n        uses: actions/checkout@v4  # v4\n"
                                 "      - uses: docker://alpine:3\n")
    findings = check_workflows(tmp_path)
    bad = [f for f in findings if f.kind == "drift"]
    assert [(f.pin, f.subject) for f in bad] == [
        (".github/workflows/bad.yaml", "line 5: uses: actions/checkout@v4"),
        (".github/workflows/bad.yaml", "line 6: uses: docker://alpine:3")]
    assert "a mutable tag or branch 'v4'" in bad[0].message
    assert "`uses: actions/checkout@<40-hex sha of the release> # <version>`" in bad[0].action
    (good,) = [f for f in findings if f.kind == "ok"]
    assert good.pin == ".github/workflows/good.yml"
    assert good.message == ("2 third-party action(s) pinned by commit SHA; 1 without a `# vX` version comment "
                            "(recommended)")


# ------------------------------------------------------------------------------------------------
# the project's own workflow


@pytest.fixture(scope="module")
def wf() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def triggers(wf: dict) -> dict:
    return wf.get("on", wf.get(True))  # YAML 1.1 reads a bare `on` key as the boolean True


def test_triggers_weekly_manual_and_on_lock_changes(wf):
    on = triggers(wf)
    (cron,) = [s["cron"] for s in on["schedule"]]
    minute, hour, dom, month, dow = cron.split()
    assert (dom, month) == ("*", "*") and re.fullmatch(r"[0-6]", dow), "weekly"
    assert "workflow_dispatch" in on
    for event in ("push", "pull_request"):
        assert {"reference.lock", ".github/workflows/**", "scoreboard/pins/**"} <= set(on[event]["paths"])
    assert wf["concurrency"]["group"].startswith("audit-pins")


def test_least_permissions(wf):
    assert wf["permissions"] == {"contents": "read"}
    perms = {name: job.get("permissions") for name, job in wf["jobs"].items()}
    assert perms == {"audit": None, "report-drift": {"issues": "write"}}


def test_every_action_is_pinned_by_sha_with_a_version_comment():
    findings = [f for f in check_workflows(ROOT) if f.pin == ".github/workflows/audit-pins.yml"]
    assert [f.kind for f in findings] == ["ok"], findings
    assert "without" not in findings[0].message
    assert "actions/checkout@11bd71901bbe5b1630ceea73d27597364c9af683 # v4.2.2" in WORKFLOW.read_text()


def test_issue_step_files_one_issue_by_the_reports_marker(wf):
    (step,) = wf["jobs"]["report-drift"]["steps"]
    assert step["env"]["GH_TOKEN"] == "${{ github.token }}"
    assert MARKER in step["run"] and "gh issue comment" in step["run"] and "gh issue create" in step["run"]
    audit_run = next(s for s in wf["jobs"]["audit"]["steps"] if s.get("id") == "audit")["run"]
    assert "scoreboard audit-pins --all --markdown audit.md" in audit_run and "set +e" in audit_run


def test_run_scripts_are_valid_bash(wf, tmp_path):
    for job in wf["jobs"].values():
        for step in job["steps"]:
            if "run" in step:
                script = re.sub(r"\$\{\{[^}]*\}\}", "X", step["run"])
                (tmp_path / "s.sh").write_text(script)
                subprocess.run(["bash", "-n", str(tmp_path / "s.sh")], check=True)


def _eval(expr: str, ctx: dict[str, str]) -> bool:
    """GitHub `if:` expressions as used here: context paths, '...' literals, ==, !=, &&, ||, parentheses."""
    py = re.sub(r"\b[a-z_]+(?:\.[a-z_-]+)+\b", lambda m: repr(ctx[m.group(0)]), expr)
    py = py.replace("&&", " and ").replace("||", " or ")
    assert not re.search(r"\w\(", py), f"a function call this evaluator does not model: {expr}"
    return bool(eval(py, {"__builtins__": {}}))  # noqa: S307 - our own fixed workflow text


def simulate(wf: dict, event: str, rc: int) -> tuple[bool, bool]:
    """(issue filed, run failed) for one event and audit exit code."""
    ctx = {"github.event_name": event, "steps.audit.outputs.exit": str(rc), "needs.audit.outputs.exit": str(rc)}
    audit_failed = any(_eval(s["if"], ctx) and "exit 1" in s["run"]
                       for s in wf["jobs"]["audit"]["steps"] if "if" in s)
    job = wf["jobs"]["report-drift"]
    assert job["needs"] == "audit"
    filed = not audit_failed and _eval(job["if"], ctx)  # a job's `if` implies success() of its needs
    return filed, audit_failed or filed


@pytest.mark.parametrize("event", ["schedule", "workflow_dispatch", "pull_request", "push"])
def test_reaction_to_each_exit_code(wf, event):
    scheduled = event in ("schedule", "workflow_dispatch")
    assert simulate(wf, event, 0) == (False, False)  # clean: green, no issue
    assert simulate(wf, event, 1) == (False, True)  # error: red, never a drift issue
    assert simulate(wf, event, 2) == (scheduled, True)  # drift: the issue on schedule/dispatch, a red check always
