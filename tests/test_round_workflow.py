"""The PR round workflow (.github/workflows/round.yml) keeps its promises, read from the file itself.

actionlint and zizmor lint it in CI (.ci/run); this checks the properties they cannot know we want: opt-in by
label, the base branch's harness, the PR's head only as `--candidate`, least permissions per job, and no
PR-controlled text expanded into a script.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
WORKFLOW = REPO / ".github" / "workflows" / "round.yml"


def _flow() -> dict:
    data = yaml.safe_load(WORKFLOW.read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as true
    return data


def test_it_runs_only_when_a_maintainer_labels_a_pull_request():
    flow = _flow()
    assert flow["on"] == {"pull_request_target": {"types": ["labeled"]}}  # the workflow is the base branch's
    assert "github.event.label.name == 'round'" in flow["jobs"]["round"]["if"]
    assert flow["permissions"] == {}
    assert flow["concurrency"]["cancel-in-progress"] is False


def test_the_harness_is_the_base_commit_and_the_pr_head_is_only_the_candidate():
    steps = _flow()["jobs"]["round"]["steps"]
    checkouts = [s for s in steps if str(s.get("uses", "")).startswith("actions/checkout@")]
    harness, head = checkouts
    assert harness["with"]["ref"] == "${{ github.event.pull_request.base.sha }}" and harness["with"]["path"] == "harness"
    assert head["with"]["ref"] == "${{ github.event.pull_request.head.sha }}" and head["with"]["path"] == "pr-head"
    assert all(c["with"]["persist-credentials"] is False for c in checkouts)
    run_steps = [s for s in steps if "run" in s]
    assert all(s.get("working-directory") == "harness" for s in run_steps)  # nothing runs in the PR's tree
    fetch = next(s["run"] for s in run_steps if "git fetch" in s["run"])
    assert '"$got" != "$HEAD_SHA"' in fetch and "rm -rf ../pr-head" in fetch  # the labelled commit, or nothing
    round_run = next(s["run"] for s in run_steps if "round run" in s["run"])
    assert '--candidate "$HEAD_SHA"' in round_run and "--json" in round_run
    upload = next(s for s in steps if str(s.get("uses", "")).startswith("actions/upload-artifact@"))
    assert upload["with"]["if-no-files-found"] == "error"


def test_each_job_holds_only_the_permission_it_uses():
    jobs = _flow()["jobs"]
    assert jobs["round"]["permissions"] == {"contents": "read"}
    assert jobs["report"]["permissions"] == {"checks": "write"}
    assert jobs["report"]["runs-on"] == "ubuntu-24.04" and "self-hosted" in jobs["round"]["runs-on"]
    assert not any("uses" in s and "checkout" in s["uses"] for s in jobs["report"]["steps"])


def test_no_script_expands_an_expression_and_every_action_is_pinned_by_sha():
    flow = _flow()
    for job in flow["jobs"].values():
        for step in job["steps"]:
            assert "${{" not in step.get("run", ""), step.get("name")  # values reach scripts through env only
            uses = step.get("uses")
            if uses:
                assert re.fullmatch(r"[\w.-]+/[\w.-]+@[0-9a-f]{40}", uses), uses
    for line in WORKFLOW.read_text().splitlines():
        if re.search(r"uses: \S+@[0-9a-f]{40}", line):
            assert re.search(r"# v\d+\.\d+\.\d+$", line), line  # the version comment the audit reads
