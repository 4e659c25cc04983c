"""`scoreboard engines` checks each entry point in a fresh interpreter; `round run` refuses a broken one first.

The plugins here are real installed distributions as far as importlib.metadata can tell: a `*.dist-info`
directory (METADATA + entry_points.txt, what pip writes) on the import path of a `scoreboard` started as a
subprocess, each pointing at a module of its own beside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from plugin_fixtures import lock_for_engine
from sandbox_fixtures import make_repo

from scoreboard import probe, registry
from scoreboard.errors import InputError
from scoreboard.round.run import RoundOptions, run_round

REPO = Path(__file__).resolve().parent.parent

GOOD = """
from scoreboard.engine import Engine

class Good(Engine):
    name = "goodplug"
    describe = prepare = logits = lambda *a: None
"""
PLUGINS = {  # engine id -> (module source, attribute)
    "goodplug": (GOOD, "Good"),
    "missingdep": ("import not_installed_dep_xyz\n", "X"),
    "wrongattr": (GOOD, "NoSuchEngine"),
    "notengine": ("class NotAnEngine:\n    name = 'notengine'\n", "NotAnEngine"),
    "misnamed": (GOOD, "Good"),  # its class says name = "goodplug"
    "crasher": ("import os\nos._exit(9)\n", "X"),  # takes its interpreter down while importing
}


def _site(tmp_path: Path) -> Path:
    """One distribution per plugin, each a dist-info directory with its entry point and a module beside it."""
    site = tmp_path / "site"
    for name, (source, attr) in PLUGINS.items():
        dist = site / f"sb_{name}-1.{len(name)}.dist-info"
        dist.mkdir(parents=True)
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sb-{name}\nVersion: 1.{len(name)}\n")
        (dist / "entry_points.txt").write_text(f"[scoreboard.engines]\n{name} = sb_{name}:{attr}\n")
        (site / f"sb_{name}.py").write_text(textwrap.dedent(source))
    return site


def _engines(site: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)]), "COLUMNS": "250"}
    return subprocess.run([sys.executable, "-m", "scoreboard", "engines", *args], env=env, capture_output=True,
                          text=True, cwd=REPO, timeout=600)


def test_scoreboard_engines_lists_each_broken_entry_point_with_its_error_and_exits_1(tmp_path):
    site = _site(tmp_path)
    table = _engines(site)
    assert table.returncode == 1
    line = {row.split("│")[1].strip(): row for row in table.stdout.splitlines() if row.count("│") >= 5}
    assert "ok" in line["goodplug"] and "sb-goodplug" in line["goodplug"] and "1.8" in line["goodplug"]
    assert "broken" in line["wrongattr"] and "broken" not in line["sparkinfer"]
    proc = _engines(site, "--json")
    assert proc.returncode == 1, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)["engines"]}
    assert {n for n, r in rows.items() if r["ok"]} == {"llamacpp", "sparkinfer", "goodplug"}
    assert (rows["goodplug"]["distribution"], rows["goodplug"]["version"]) == ("sb-goodplug", "1.8")
    assert rows["sparkinfer"]["distribution"] == "scoreboard"
    assert rows["missingdep"]["error"] == ("import sb_missingdep: ModuleNotFoundError: No module named "
                                           "'not_installed_dep_xyz'")
    assert rows["wrongattr"]["error"].startswith("resolve sb_wrongattr:NoSuchEngine: AttributeError")
    assert "is a sb_notengine.NotAnEngine, not a scoreboard.engine.Engine" in rows["notengine"]["error"]
    assert "name is 'goodplug', but the entry point registers it as 'misnamed'" in rows["misnamed"]["error"]
    assert "exited 9 before reporting" in rows["crasher"]["error"]  # the CLI survived its plugin's crash
    assert "broken missingdep (sb_missingdep:X, from sb-missingdep)" in proc.stderr
    assert "next: reinstall the plugin" in proc.stderr


def test_a_clean_install_exits_0():
    proc = subprocess.run([sys.executable, "-m", "scoreboard", "engines", "--json"], capture_output=True, text=True,
                          cwd=REPO, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert all(r["ok"] for r in json.loads(proc.stdout)["engines"])


def test_the_probe_reads_the_calibration_hook_and_refuses_a_malformed_one(tmp_path):
    mod = tmp_path / "hooked.py"
    mod.write_text(textwrap.dedent("""
        from scoreboard.engine import CalibrationSuite
        from engines.sparkinfer.engine import SparkInferEngine

        class Hooked(SparkInferEngine):
            name = "hooked"
            def calibration(self, device):
                return CalibrationSuite(faults={"f1": {"faults": ["mla_as_mqa"]}},
                                        precisions=({"dtype": "float64"}, {"dtype": device == "cpu" and "float32"}))

        class Bad(Hooked):
            def calibration(self, device):
                return CalibrationSuite(faults={"no spaces": {}})
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    got = probe.check_entry("hooked", "hooked:Hooked", env=env, device="cpu")
    assert got.ok, got.error
    assert got.calibration is not None and got.calibration.faults == {"f1": {"faults": ["mla_as_mqa"]}}
    assert got.calibration.precisions == ({"dtype": "float64"}, {"dtype": "float32"})
    assert probe.check_entry("hooked", "hooked:Hooked", env=env).calibration is None  # asked only with a device
    bad = probe.check_entry("hooked", "hooked:Bad", env=env, device="cpu")
    assert not bad.ok and bad.error.startswith("calibration hook: CalibrationSuite.faults: names ['no spaces']")


# ----------------------------------------------------------------------------------------------
# round run

@pytest.fixture
def broken_lock(tmp_path: Path) -> Path:
    """k3-mini-cpu with an injected candidate engine whose entry point names a class its module lacks."""
    path = lock_for_engine(tmp_path / "reference.lock", "brokenspark")
    registry.inject("brokenspark", "engines.sparkinfer.engine:NoSuchEngine")
    yield path
    registry.uninject("brokenspark")


def test_round_run_refuses_a_broken_candidate_entry_point_before_anything_runs(broken_lock, tmp_path):
    rounds, cache = tmp_path / "rounds", tmp_path / "cache"
    with pytest.raises(InputError) as exc:
        run_round(RoundOptions(target="k3-mini-cpu", lock_path=broken_lock, rounds_dir=rounds, cache_dir=cache,
                               require_calibration=False, repo=make_repo(tmp_path / "repo")))
    assert ("the main (harness) arm's engine 'brokenspark' (engines.sparkinfer.engine:NoSuchEngine) cannot run: "
            "resolve engines.sparkinfer.engine:NoSuchEngine: AttributeError") in exc.value.message
    assert "scoreboard engines" in exc.value.hint
    assert not rounds.exists()  # nothing written: no receipt, no ledger
    assert not (cache / "llamacpp").exists() and not (cache / "weights").exists()  # no reference, no weights


def test_round_run_refuses_an_installed_plugin_whose_code_is_no_commit_of_this_repository(tmp_path):
    """Its arms would all run the one installed copy: the round names --engine-repo instead."""
    path = lock_for_engine(tmp_path / "reference.lock", "outside")
    registry.inject("outside", "some_plugin.engine:Outside")
    try:
        with pytest.raises(InputError) as exc:
            run_round(RoundOptions(target="k3-mini-cpu", lock_path=path, rounds_dir=tmp_path / "rounds",
                                   cache_dir=tmp_path / "cache", require_calibration=False))
    finally:
        registry.uninject("outside")
    assert "engine 'outside' is installed (some_plugin.engine), not part of this repository's engines/" in \
        exc.value.message
    assert "--engine-repo" in exc.value.hint
    assert not (tmp_path / "rounds").exists()
