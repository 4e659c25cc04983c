"""A third-party engine scored from its own repository, end to end, through the CLI a plugin author runs.

A throwaway plugin repository (`sbplug`, src layout, its own pyproject.toml) holds a tiny engine that subclasses
the bundled sparkinfer (the same math, so it passes the real gate of k3-mini-cpu) and declares, through the
optional Engine.calibration hook, a fault of its own (its logits rolled by one token) and a precision pair. It is
installed editable into a temporary virtual environment (the test interpreter's site-packages visible behind it,
for torch; removed at the end), and that environment's `python -m scoreboard` runs: `gate calibrate` (the instrument's arms and the
plugin's own, one seed), a main round of the plugin's main, and a PR round of its second commit; each arm is a
commit of the plugin's repository, in the real sandbox, against the real llama.cpp build.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
from plugin_fixtures import lock_for_engine
from sandbox_fixtures import git

REPO = Path(__file__).resolve().parent.parent
TARGET = "k3-mini-cpu"

PYPROJECT = """\
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "sbplug"
version = "0.1.0"

[project.entry-points."scoreboard.engines"]
sbplug = "sbplug.engine:PlugEngine"

[tool.setuptools.packages.find]
where = ["src"]
"""

OPTIONS = '''\
"""sbplug's options: sparkinfer's, plus a bug of its own that only calibration switches on (torch-free)."""
from typing import Literal

from engines.sparkinfer import options as spark

LockOptions = spark.LockOptions
OWN = ("plug_fault",)


class Options(spark.Options):
    plug_fault: Literal["", "roll"] = ""


def parse(options):
    return Options.model_validate(dict(options or {}))
'''

ENGINE = '''\
"""sbplug: sparkinfer's math under another name, with one injected bug of its own (logits rolled by a token)."""
from dataclasses import replace

import numpy as np

from engines.sparkinfer.engine import SparkInferEngine
from scoreboard.engine import CalibrationSuite

from . import options as _options

VERSION = "{version}"


class PlugEngine(SparkInferEngine):
    name = "sbplug"

    def _spark(self, target):
        return replace(target, options={{k: v for k, v in target.options.items() if k not in _options.OWN}})

    def describe(self, target):
        own = _options.parse(target.options)
        ident = super().describe(self._spark(target))
        return replace(ident, engine=self.name, version=VERSION,
                       source={{**ident.source, "package": "sbplug", "file": __file__}},
                       extra={{**ident.extra, "plug_fault": own.plug_fault}})

    def prepare(self, target, cache_dir, progress=None):
        own = _options.parse(target.options)
        prepared = super().prepare(self._spark(target), cache_dir, progress)
        prepared.identity = replace(prepared.identity, extra={{**prepared.identity.extra, "plug_fault": own.plug_fault}})
        prepared.notes["plug_fault"] = own.plug_fault
        return prepared

    def logits(self, prepared, request):
        out = super().logits(prepared, request)
        if prepared.notes.get("plug_fault") == "roll":
            return replace(out, logits=np.roll(out.logits, 1, axis=-1))
        return out

    def calibration(self, device):
        return CalibrationSuite(faults={{"rolled_vocab": {{"plug_fault": "roll"}}}},
                                precisions=({{"dtype": "float64"}}, {{"dtype": "float32"}}))
'''


def _write(repo: Path, version: str) -> None:
    pkg = repo / "src" / "sbplug"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "options.py").write_text(OPTIONS)
    (pkg / "engine.py").write_text(ENGINE.format(version=version))
    (repo / "pyproject.toml").write_text(PYPROJECT)
    (repo / ".gitignore").write_text("__pycache__/\n*.egg-info/\n")


@pytest.fixture
def plugin(tmp_path: Path):
    """(the plugin's repository with main = v1 and branch pr = v2, the venv's python with it installed editable)."""
    repo = tmp_path / "sbplug"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    _write(repo, "1")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "sbplug 1")
    git(repo, "checkout", "-q", "-b", "pr")
    _write(repo, "2")
    git(repo, "commit", "-q", "-am", "sbplug 2: a pull request")
    git(repo, "checkout", "-q", "main")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    # what this interpreter has (torch, pip, setuptools: in the system Python or in a venv of its own) shows through
    # behind the new environment's own site-packages
    site_dir = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                   capture_output=True, text=True, check=True).stdout.strip())
    (site_dir / "zz-outer.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(repo)],
                   check=True, capture_output=True)
    yield repo, python
    shutil.rmtree(venv)  # the editable install goes with its environment
    assert not venv.exists()


def _scoreboard(python: Path, *args: str, timeout: int = 1800) -> subprocess.CompletedProcess:
    # the session's signing key (tests/signer_fixtures.py) seals: the test lock pins it (zero_slots)
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    return subprocess.run([str(python), "-m", "scoreboard", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_a_plugin_is_calibrated_and_scored_from_its_own_repository_commit_by_commit(plugin, tmp_path):
    repo, python = plugin
    main, pr = git(repo, "rev-parse", "main"), git(repo, "rev-parse", "pr")
    lock = lock_for_engine(tmp_path / "reference.lock", "sbplug")
    shrunk = lock.read_text().replace("speed = { warmup_reps = 1, reps = 3, blocks = 4, timeout_s = 600 }",
                                      "speed = { warmup_reps = 1, reps = 1, blocks = 2, timeout_s = 600 }", 1)
    assert shrunk != lock.read_text()
    lock.write_text(shrunk)
    rounds = tmp_path / "rounds"
    listed = _scoreboard(python, "engines", "--json")
    assert listed.returncode == 0, listed.stderr
    row = next(r for r in json.loads(listed.stdout)["engines"] if r["name"] == "sbplug")
    assert (row["ok"], row["distribution"], row["version"]) == (True, "sbplug", "0.1.0")

    cal = _scoreboard(python, "gate", "calibrate", TARGET, "--seeds", "1", "--first-seed", "7", "--engine-repo",
                      str(repo), "--lock", str(lock), "--out", str(rounds), "--json")
    assert cal.returncode == 0, cal.stderr[-3000:]
    rec = json.loads(cal.stdout)
    assert rec["separation"]["separated"], rec["separation"]["problems"]
    assert rec["format_version"] == "1.1" and rec["instrument"]["engine"] == "sparkinfer"
    assert rec["instrument"]["commit"] == git(REPO, "rev-parse", "HEAD")  # the harness's commit measured
    assert "candidate_engine" not in rec["definition"] and rec["definition"]["instrument"]["engine"] == "sparkinfer"
    eng = rec["engine"]
    assert eng["engine"] == "sbplug" and eng["measured"] and eng["source"]["commit"] == main
    assert eng["source"]["repo"] == str(repo.resolve()) and eng["source"]["entry_point"] == "sbplug.engine:PlugEngine"
    assert "sbplug:rolled_vocab" in rec["faults"]
    assert eng["identities"]["fault:sbplug:rolled_vocab"]["extra"]["plug_fault"] == "roll"
    run = rec["runs"][0]
    assert min(d["kl_mean"] for d in run["faults"]["sbplug:rolled_vocab"]) > 0.02  # kl_max x margin
    assert max(d["kl_mean"] for d in run["engine_noise_floor"]) < 5e-5  # kl_max / margin

    first = _scoreboard(python, "round", "run", "--target", TARGET, "--engine-repo", str(repo), "--lock", str(lock),
                        "--rounds", str(rounds), "--seed", "11", "--json")
    assert first.returncode == 0, first.stderr[-3000:]
    r = json.loads(first.stdout)
    assert r["status"] == "verdict" and r["gate"]["pass"], r.get("aborted") or r["gate"]["reasons"]
    assert r["calibration"]["status"] == "calibrated" and r["calibration"]["calibration_id"] == rec["calibration_id"]
    assert r["candidate"]["engine"] == "sbplug" and r["candidate"]["commit"] == main and r["candidate"]["is_main"]
    ident = r["candidate"]["identity"]
    assert ident["version"] == "1" and "/src/sbplug/engine.py" in ident["source"]["file"]
    assert not ident["source"]["file"].startswith(str(repo))  # the export of the commit, never the working tree
    assert r["environment"]["isolation"]["tool"] == "bwrap"
    assert r["provenance"]["engine_repo"]["arms"][0]["commit"] == main

    second = _scoreboard(python, "round", "run", "--target", TARGET, "--engine-repo", str(repo), "--candidate", pr,
                         "--lock", str(lock), "--rounds", str(rounds), "--seed", "12", "--json")
    assert second.returncode in (0, 2), second.stderr[-3000:]
    p = json.loads(second.stdout)
    assert p["status"] == "verdict" and p["gate"]["pass"], p.get("aborted") or p["gate"]["reasons"]
    assert p["candidate"]["commit"] == pr and p["candidate"]["identity"]["version"] == "2"
    assert p["main"]["commit"] == main and not p["candidate"]["is_main"]
    assert {a["arm"]: a["commit"] for a in p["provenance"]["engine_repo"]["arms"]} == {"candidate": pr, "main": main}
    ledger = [json.loads(x) for x in (rounds / "ledger.jsonl").read_text().splitlines()]
    rounds_of = [(e["round_id"], e["candidate_commit"]) for e in ledger if e["kind"] == "round"]
    assert rounds_of == [(r["round_id"], main), (p["round_id"], pr)]  # the plugin's commits, in the chain
    verified = _scoreboard(python, "verify", "--lock", str(lock), "--rounds", str(rounds))
    assert verified.returncode == 0, verified.stdout + verified.stderr
