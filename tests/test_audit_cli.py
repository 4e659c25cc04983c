"""`scoreboard audit-pins --all` and `scoreboard pin weights` end to end against the stand-ins (local bare git
remote, stand-in Hub with the real huggingface_hub client, stand-in PyPI): every drift case exits 2, every
failure case exits 1, a clean lock exits 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from audit_fixtures import (GitRemote, StandinPypi, closed_port, generated_weights_toml, git_ref_toml, pins_of,
                            sdist_ref_toml, shard_bytes, weights_toml, write_lock)
from cli_helpers import console_script
from scoreboard.cli import main as cli
from scoreboard.lockfile import load_lock
from scoreboard.pins.report import MARKER
from standin_hub import Fault, StandinHub

HUB_REPO, Q, PR = "unsloth/Kimi-K3-GGUF", "UD-IQ1_S", "refs/pull/48/head"
SHARDS = {f"{Q}/K3-{i:05d}-of-00003.gguf": shard_bytes(i) for i in (1, 2, 3)}
SHA = "11bd71901bbe5b1630ceea73d27597364c9af683"


@dataclass
class World:
    root: Path
    git: GitRemote
    hub: StandinHub
    pypi: StandinPypi

    def lock(self, git_url: str | None = None, pinned: bool = True) -> Path:
        rows = pins_of(SHARDS) if pinned else [(p, 0, "") for p in sorted(SHARDS)]
        return write_lock(self.root / "reference.lock", [
            git_ref_toml("llamacpp-pr48", git_url or self.git.url, PR, self.git.pinned, self.git.base),
            sdist_ref_toml("llama-cpp-python", "llama-cpp-python", "0.3.36", self.pypi.sha),
            weights_toml("k3-q", HUB_REPO, self.hub.rev if pinned else "", rows, Q),
            generated_weights_toml("mini")], {"t-hub": ("llamacpp-pr48", "k3-q"), "t-mini": ("llama-cpp-python", "mini")})


@pytest.fixture
def world(tmp_path, monkeypatch):
    g = GitRemote(tmp_path / "git")
    g.base = g.commit("base")
    g.pinned = g.commit("pr head", g.base)
    g.push(g.pinned, PR)
    root = tmp_path / "repo"
    (root / ".github" / "workflows").mkdir(parents=True)
    (root / ".github" / "workflows" / "ci.yml").write_text(f"jobs:\n  a:\n    steps:\n"
                                                           f"      - uses: actions/checkout@{SHA} # v4.2.2\n")
    with StandinHub() as hub, StandinPypi() as pypi:
        hub.rev = hub.commit(HUB_REPO, {"README.md": b"card", **SHARDS})
        pypi.sha = pypi.add("llama-cpp-python", "0.3.36", b"sdist")
        monkeypatch.setenv("SCOREBOARD_HF_ENDPOINT", hub.url)
        monkeypatch.setenv("SCOREBOARD_PYPI_URL", pypi.url)
        monkeypatch.setenv("SCOREBOARD_CACHE", str(tmp_path / "cache"))
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        w = World(root, g, hub, pypi)
        w.lock()
        yield w


def scoreboard(capsys, monkeypatch, *args: str) -> tuple[int, str, str]:
    """Run the real console entry point in-process: (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["scoreboard", *args])
    with pytest.raises(SystemExit) as info:
        cli.run()
        raise SystemExit(0)
    out = capsys.readouterr()
    return info.value.code or 0, out.out, " ".join(out.err.split())  # stderr unwrapped (rich wraps at 80)


def audit(capsys, monkeypatch, world, *extra: str) -> tuple[int, dict, str]:
    rc, out, err = scoreboard(capsys, monkeypatch, "audit-pins", "--all", "--json", "--timeout", "2",
                              "--lock", str(world.root / "reference.lock"), *extra)
    return rc, json.loads(out), err


def test_clean_lock_exits_0(world, capsys, monkeypatch):
    rc, report, _ = audit(capsys, monkeypatch, world)
    assert rc == 0 and report["status"] == "clean"
    assert report["counts"] == {"drift": 0, "error": 0, "unpinned": 0, "ok": 5}
    assert {f["pin"] for f in report["findings"]} == {
        "references.llamacpp-pr48", "references.llama-cpp-python", "weights.k3-q", "weights.mini",
        ".github/workflows/ci.yml"}


def _force_push(w):
    w.git.push(w.git.commit("amended", w.git.base), PR)


def _rewrite_base(w):
    w.git.push(w.git.commit("rebased", w.git.commit("new root")), PR)


def _workflow_tag(w):
    (w.root / ".github" / "workflows" / "ci.yml").write_text("steps:\n  - uses: actions/checkout@v4\n")


DRIFT = {
    "force-push": _force_push,
    "deleted-ref": lambda w: w.git.delete(PR),
    "rewritten-base": _rewrite_base,
    "reuploaded-shard": lambda w: w.hub.put(HUB_REPO, w.hub.rev, f"{Q}/K3-00002-of-00003.gguf", b"x" * 1024),
    "extra-shard": lambda w: w.hub.put(HUB_REPO, w.hub.rev, f"{Q}/K3-00004-of-00003.gguf", b"more"),
    "missing-shard": lambda w: w.hub.put(HUB_REPO, w.hub.rev, f"{Q}/K3-00003-of-00003.gguf", None),
    "changed-size": lambda w: w.hub.put(HUB_REPO, w.hub.rev, f"{Q}/K3-00001-of-00003.gguf", b"short"),
    "squashed-revision": lambda w: w.hub.squash(HUB_REPO),
    "sdist-hash": lambda w: w.pypi.releases.update({("llama-cpp-python", "0.3.36"): []}) or w.pypi.add(
        "llama-cpp-python", "0.3.36", b"rebuilt sdist"),
    "unpinned-action": _workflow_tag,
}


@pytest.mark.parametrize("case", list(DRIFT))
def test_each_drift_case_exits_2(world, capsys, monkeypatch, case):
    DRIFT[case](world)
    rc, report, err = audit(capsys, monkeypatch, world)
    assert rc == 2, report
    assert report["counts"]["drift"] >= 1 and report["counts"]["error"] == 0
    drift = [f for f in report["findings"] if f["kind"] == "drift"]
    assert all(f["message"] and f["action"] for f in drift)
    assert "pin drift:" in err


FAILURES = {
    "hub-500": lambda w: w.hub.faults.update(revision=Fault(status=500)),
    "hub-429-paths-info": lambda w: w.hub.faults.update({"paths-info": Fault(status=429)}),
    "hub-timeout": lambda w: w.hub.faults.update(revision=Fault(sleep=5)),
    "pypi-500": lambda w: setattr(w.pypi, "fault", (500, 0.0)),
    "git-unreachable": lambda w: w.lock(git_url=f"http://127.0.0.1:{closed_port()}/llama.cpp.git"),
}


@pytest.mark.parametrize("case", list(FAILURES))
def test_each_failure_case_exits_1_and_is_not_drift(world, capsys, monkeypatch, case):
    FAILURES[case](world)
    rc, report, err = audit(capsys, monkeypatch, world)
    assert rc == 1, report
    assert report["counts"]["error"] == 1 and report["counts"]["drift"] == 0
    assert report["counts"]["ok"] == 4  # the other pins were still checked
    assert "that is not drift" in err


def test_hub_down_is_an_error_for_the_weights(world, capsys, monkeypatch):
    rc, report, _ = audit(capsys, monkeypatch, world, "--hub-endpoint", f"http://127.0.0.1:{closed_port()}")
    assert rc == 1
    (f,) = [f for f in report["findings"] if f["kind"] == "error"]
    assert f["pin"] == "weights.k3-q"


def test_error_and_drift_together_exit_1_and_list_both(world, capsys, monkeypatch):
    _force_push(world)
    world.pypi.fault = (503, 0.0)
    rc, report, err = audit(capsys, monkeypatch, world)
    assert rc == 1 and report["counts"]["drift"] == 1 and report["counts"]["error"] == 1
    assert "(1 drift also observed)" in err


def test_target_scope_and_markdown_report(world, capsys, monkeypatch, tmp_path):
    _force_push(world)
    md = tmp_path / "audit.md"
    rc, out, _ = scoreboard(capsys, monkeypatch, "audit-pins", "--target", "t-hub", "--markdown", str(md),
                            "--lock", str(world.root / "reference.lock"))
    assert rc == 2
    assert "DRIFT     references.llamacpp-pr48  ref refs/pull/48/head: ref refs/pull/48/head moved from" in out
    assert "pin audit: DRIFT (exit 2) — 1 drift, 0 error, 0 unpinned, 1 ok" in out
    text = md.read_text()
    assert text.startswith(MARKER + "\n## Pin audit: DRIFT (exit 2)")
    assert f"| `{world.git.pinned}` |" in text and "Re-pin deliberately after review and re-measure" in text
    assert "llama-cpp-python" not in text and "ci.yml" not in text  # only t-hub's pins
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".audit.md")] == []


def test_unpinned_weights_exit_0_then_pin_weights_makes_the_audit_clean(world, capsys, monkeypatch):
    lock = world.lock(pinned=False)
    rc, report, _ = audit(capsys, monkeypatch, world)
    assert rc == 0
    (f,) = [f for f in report["findings"] if f["kind"] == "unpinned"]
    assert f["action"] == f"review the upload, then `scoreboard pin weights --target t-hub --revision {world.hub.rev}`"

    before = lock.read_text()
    rc, out, _ = scoreboard(capsys, monkeypatch, "pin", "weights", "t-hub", "--revision", world.hub.rev,
                            "--lock", str(lock), "--dry-run")
    assert rc == 0 and "would pin 3 file(s), 3.0 KiB" in out and lock.read_text() == before
    rc, out, _ = scoreboard(capsys, monkeypatch, "pin", "weights", "t-hub", "--revision", world.hub.rev,
                            "--lock", str(lock))
    assert rc == 0
    assert f'  revision: "" -> {world.hub.rev}' in out
    assert f"  {Q}/K3-00001-of-00003.gguf size: 0 -> {len(SHARDS[f'{Q}/K3-00001-of-00003.gguf'])}" in out
    assert "pinned 3 file(s)" in out and "slots untouched" in out
    assert load_lock(lock).weights["k3-q"].fully_pinned
    rc, report, _ = audit(capsys, monkeypatch, world)
    assert rc == 0 and report["counts"]["unpinned"] == 0


def test_pin_weights_refuses_a_changed_file_set(world, capsys, monkeypatch):
    lock = world.lock(pinned=False)
    world.hub.put(HUB_REPO, world.hub.rev, f"{Q}/K3-00004-of-00003.gguf", b"more")
    before = lock.read_text()
    rc, _, err = scoreboard(capsys, monkeypatch, "pin", "weights", "t-hub", "--revision", world.hub.rev,
                            "--lock", str(lock))
    assert rc == 1 and lock.read_text() == before
    assert f"+ {Q}/K3-00004-of-00003.gguf (on the Hub, not in the lock)" in err and "--accept-file-set" in err


def test_console_script_exit_codes(world):
    """The installed `scoreboard` executable, in a fresh process, exits 2 on drift and 1 on error."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    cmd = [*console_script(), "audit-pins", "--all", "--timeout", "2", "--lock", str(world.root / "reference.lock")]
    world.hub.put(HUB_REPO, world.hub.rev, f"{Q}/K3-00004-of-00003.gguf", b"more")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"DRIFT     weights.k3-q  {Q}/K3-00004-of-00003.gguf: extra file" in p.stdout
    world.hub.faults["revision"] = Fault(status=500)
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
