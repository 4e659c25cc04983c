"""A plugin in a git repository of its own is compared across its own commits (`--engine-repo PATH`).

Fast rounds of the toy engines (tests/toy_engine.py): the candidate toy is a throwaway plugin repository whose
package lives at src/toyplug (not engines/) and whose pyproject.toml declares the entry point; the registry maps
"toy" to it (as an installed copy would), and every arm imports the package exported from its own commit, in the
real sandbox. The real-engine version (a sparkinfer subclass installed editable, calibrated, main and PR rounds on
k3-mini-cpu) is tests/test_plugin_e2e.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import tomlkit
import toy_engine
from receipt_factory import zero_slots
from sandbox_fixtures import git

from scoreboard import registry
from scoreboard.errors import InputError
from scoreboard.history.verify import verify as verify_all
from scoreboard.lockfile import load_lock
from scoreboard.round.run import RoundOptions, run_round
from scoreboard.weights.verify import ensure_generated

REPO = Path(__file__).resolve().parent.parent
TARGET = "toy-cpu"
PYPROJECT = """\
[project]
name = "toyplug"
version = "0.1.0"

[project.entry-points."scoreboard.engines"]
toy = "{spec}"

[tool.setuptools.packages.find]
where = ["src"]
"""


@pytest.fixture(autouse=True)
def toy_engines():
    """"toy" as an installed plugin would register it (the rounds read each commit's own pyproject instead)."""
    registry.inject("toy", "toyplug.engine:ToyEngine")
    registry.inject_options("toy", toy_engine.ToyOptions)
    registry.inject("toy-ref", toy_engine.ToyReference)
    yield
    registry.uninject("toy")
    registry.uninject("toy-ref")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cache")
    ensure_generated(load_lock(REPO / "reference.lock"), "k3-mini", root)
    return root


@pytest.fixture
def lock(tmp_path: Path) -> Path:
    from test_round_fast import TOY_TARGET

    doc = zero_slots(tomlkit.parse((REPO / "reference.lock").read_text()))
    doc["targets"][TARGET] = tomlkit.parse(TOY_TARGET)["targets"][TARGET]
    path = tmp_path / "reference.lock"
    path.write_text(tomlkit.dumps(doc))
    load_lock(path)
    return path


def write_plugin(repo: Path, module: str = "engine", spec: str = "toyplug.engine:ToyEngine", salt: str = "") -> None:
    """The toy candidate as src/toyplug/<module>.py, registered by pyproject.toml as `spec`; `salt` != "" makes its
    logits another model's (a wrong engine)."""
    pkg = repo / "src" / "toyplug"
    if pkg.exists():
        shutil.rmtree(pkg)
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    text = Path(toy_engine.__file__).read_text()
    if salt:
        text = text.replace("return Prepared(ident, handle=b\"wrong\" if mode == \"wrong_logits\" else b\"\")",
                            f"return Prepared(ident, handle={salt.encode()!r})")
        assert salt.encode().decode() in text
    (pkg / f"{module}.py").write_text(text)
    (repo / "pyproject.toml").write_text(PYPROJECT.format(spec=spec))


def commit(repo: Path, message: str) -> str:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")


@pytest.fixture
def plugin(tmp_path: Path) -> Path:
    """The plugin's repository: main holds the correct toy engine at src/toyplug/engine.py; origin is a bare clone."""
    repo = tmp_path / "toyplug"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    write_plugin(repo)
    (repo / ".gitignore").write_text("__pycache__/\n")
    commit(repo, "toy plugin")
    git(tmp_path, "clone", "-q", "--bare", str(repo), str(tmp_path / "origin.git"))
    git(repo, "remote", "add", "origin", str(tmp_path / "origin.git"))
    return repo


def _round(lock: Path, plugin: Path, cache: Path, tmp_path: Path, **kw):
    base = dict(target=TARGET, lock_path=lock, rounds_dir=tmp_path / "rounds", cache_dir=cache, seed=5,
                engine_repo=plugin, require_calibration=False)
    return run_round(RoundOptions(**{**base, **kw}))


def test_a_main_round_runs_the_plugins_commit_in_the_sandbox_not_its_working_tree(lock, plugin, cache, tmp_path):
    head = git(plugin, "rev-parse", "HEAD")
    # the working tree no longer imports: only the commit's export can pass the gate
    (plugin / "src" / "toyplug" / "engine.py").write_text("raise ImportError('the working tree, not the commit')\n")
    out = _round(lock, plugin, cache, tmp_path)
    r = out.receipt
    assert r["status"] == "verdict", r["aborted"]
    assert r["gate"]["pass"] and r["verdict"]["label"] == "BASELINE"
    assert r["environment"]["isolation"]["tool"] == "bwrap"
    assert r["candidate"]["commit"] == head and r["candidate"]["is_main"] and r["candidate"]["dirty"]
    repo = r["provenance"]["engine_repo"]
    assert repo["path"] == str(plugin.resolve()) and repo["url"] == str(tmp_path / "origin.git")
    assert repo["engine"] == "toy"
    assert repo["arms"] == [{"arm": "candidate", "commit": head, "entry_point": "toyplug.engine:ToyEngine",
                             "package": "src/toyplug", "package_tree": git(plugin, "rev-parse", "HEAD:src/toyplug")}]
    assert out.path is not None and verify_all(lock, tmp_path / "rounds").ok


def test_a_pr_round_compares_two_commits_each_with_the_entry_point_its_own_pyproject_declares(
        lock, plugin, cache, tmp_path):
    main = git(plugin, "rev-parse", "HEAD")
    git(plugin, "checkout", "-q", "-b", "pr")
    write_plugin(plugin, module="engine2", spec="toyplug.engine2:ToyEngine")  # the module moved in the PR
    pr = commit(plugin, "move the engine module")
    git(plugin, "checkout", "-q", "main")
    out = _round(lock, plugin, cache, tmp_path, candidate=pr)
    r = out.receipt
    assert r["status"] == "verdict", r["aborted"]
    assert r["gate"]["pass"] and r["candidate"]["commit"] == pr and r["main"]["commit"] == main
    arms = {a["arm"]: a for a in r["provenance"]["engine_repo"]["arms"]}
    assert arms["candidate"]["entry_point"] == "toyplug.engine2:ToyEngine"
    assert arms["main"]["entry_point"] == "toyplug.engine:ToyEngine" and arms["main"]["commit"] == main
    dec = next(m for m in r["speed"]["metrics"] if m["role"] == "scored")
    assert set(dec["arms"]) == {"reference", "candidate", "main"}


def test_a_pr_commit_whose_engine_is_wrong_is_rejected_while_main_is_its_own_commit(lock, plugin, cache, tmp_path):
    git(plugin, "checkout", "-q", "-b", "pr")
    write_plugin(plugin, salt="another model")
    pr = commit(plugin, "faster, and wrong")
    git(plugin, "checkout", "-q", "main")
    out = _round(lock, plugin, cache, tmp_path, candidate=pr)
    r = out.receipt
    assert r["verdict"]["label"] == "REJECT" and not r["gate"]["pass"] and out.exit_code == 2
    assert r["candidate"]["commit"] == pr


def test_a_pr_commit_whose_engine_does_not_import_is_its_own_recorded_failure(lock, plugin, cache, tmp_path):
    git(plugin, "checkout", "-q", "-b", "pr")
    (plugin / "src" / "toyplug" / "engine.py").write_text("import not_installed_dep_xyz\n")
    pr = commit(plugin, "a dependency the box lacks")
    git(plugin, "checkout", "-q", "main")
    out = _round(lock, plugin, cache, tmp_path, candidate=pr, seal=False)
    r = out.receipt
    assert r["status"] == "aborted" and r["aborted"]["stage"] == "preflight" and out.exit_code == 1
    assert (f"the candidate ({pr}) arm's engine 'toy' (toyplug.engine:ToyEngine) cannot run: import toyplug.engine: "
            "ModuleNotFoundError: No module named 'not_installed_dep_xyz'") in r["aborted"]["reason"]
    assert "the candidate's own code" in r["aborted"]["reason"]


@pytest.mark.parametrize("case, says", [
    ("no repo", "--engine-repo {p}: not a git repository with a commit"),
    ("no such rev", "--candidate 'nope' is neither 'main' nor a git revision of --engine-repo"),
    ("undeclared", "declares no engine 'toy' (it declares ['other'])"),
    ("no package", "the entry point's package 'elsewhere' is not a directory of the commit"),
    ("harness package", "engine 'toy' lives in the package 'engines', the harness's own name"),
    ("off main", "is not on its main branch refs/heads/main"),
])
def test_bad_input_is_refused_naming_the_path_and_the_fix_with_nothing_written(case, says, lock, plugin, cache,
                                                                                tmp_path):
    kw: dict = {}
    repo = plugin
    if case == "no repo":
        repo = tmp_path / "not-a-repo"
        repo.mkdir()
    elif case == "no such rev":
        kw["candidate"] = "nope"
    elif case in ("undeclared", "no package", "harness package"):
        spec = {"undeclared": "toyplug.engine:ToyEngine", "no package": "elsewhere.engine:ToyEngine",
                "harness package": "engines.toy.engine:ToyEngine"}[case]
        (plugin / "pyproject.toml").write_text(PYPROJECT.format(spec=spec).replace(
            "toy = ", "other = " if case == "undeclared" else "toy = "))
        kw["candidate"] = commit(plugin, case)
    else:
        git(plugin, "checkout", "-q", "-b", "side")
        (plugin / "NOTE").write_text("x\n")
        commit(plugin, "off main")
    with pytest.raises(InputError) as exc:
        _round(lock, repo, cache, tmp_path, **kw)
    assert says.format(p=repo) in exc.value.message, exc.value.message
    assert exc.value.hint
    assert not (tmp_path / "rounds").exists()


def test_a_main_round_re_measures_the_plugin_commit_that_set_the_frontier(lock, plugin, cache, tmp_path):
    """A BASELINE of the plugin's main moves its frontier slot (sealed, calibrated, sandboxed); the next main round
    re-measures that commit of the plugin's repository as its frontier arm."""
    from scoreboard import environment
    from scoreboard.calibrate import write_record
    from calibration_fixtures import synthetic

    if environment.fingerprint().get("harness", {}).get("dirty"):
        pytest.skip("this checkout is dirty (engines/ or scoreboard/): its main round sets no frontier")
    rounds = tmp_path / "rounds"
    write_record(synthetic(lock, target=TARGET), rounds)  # the toy target's bars, separated (a synthetic record)
    first = git(plugin, "rev-parse", "HEAD")
    out = _round(lock, plugin, cache, tmp_path, require_calibration=True)
    assert out.receipt["verdict"]["label"] == "BASELINE", out.receipt.get("aborted") or out.receipt["verdict"]
    assert {ch.commit for ch in out.frontier_change if ch.kind == "frontier"} == {first}
    (plugin / "NOTE").write_text("a later main commit\n")
    second = commit(plugin, "later main")
    again = _round(lock, plugin, cache, tmp_path, require_calibration=True, seed=6)
    r = again.receipt
    assert r["status"] == "verdict", r["aborted"]
    assert r["candidate"]["commit"] == second and r["speed"]["frontier_arm"]["commit"] == first
    scored = next(m for m in r["speed"]["metrics"] if m["role"] == "scored")
    assert set(scored["arms"]) == {"reference", "candidate", "frontier"}
    arms = {a["arm"]: a["commit"] for a in r["provenance"]["engine_repo"]["arms"]}
    assert arms == {"candidate": second, "frontier": first}
    assert r["verdict"]["basis"] == "frontier-same-round"
    assert verify_all(lock, rounds).ok


def test_a_pr_commits_code_never_runs_outside_the_sandbox_not_even_to_check_its_entry_point(
        lock, plugin, cache, tmp_path):
    """The hostile commit writes a file on import (where the harness's check imports it first). The entry point's
    check runs in the sandbox like its workers, so the host's file system never sees the write."""
    escaped = tmp_path / "escaped-on-import"
    git(plugin, "checkout", "-q", "-b", "pr")
    engine = plugin / "src" / "toyplug" / "engine.py"
    # in the sandbox the write fails or lands in its own /tmp (the dropped uid may not create under the bound
    # paths' parents); an attacker swallows the error so that the import, and the round, go on
    attack = (f"import os as _os\ntry:\n    _os.makedirs({str(tmp_path)!r}, exist_ok=True)\n"
              f"    open({str(escaped)!r}, 'w').write('out')\nexcept OSError:\n    pass\n")
    engine.write_text(engine.read_text().replace("import hashlib\n", "import hashlib\n" + attack, 1))
    pr = commit(plugin, "writes on import")
    git(plugin, "checkout", "-q", "main")
    out = _round(lock, plugin, cache, tmp_path, candidate=pr, seal=False)
    assert out.receipt["status"] == "verdict", out.receipt["aborted"]  # it ran, inside the sandbox
    assert not escaped.exists()
