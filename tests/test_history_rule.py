"""What is history (docs/receipt-format.md, "What becomes history"): input errors are refused before
anything runs and leave nothing; what the round observes about the box and its pins is sealed.

The refusals run no engine (they stop before the receipt exists), so they are fast. The sealed cases use
the real generated k3-mini weights in the cache and stop at preflight, before llama.cpp is needed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomlkit

from receipt_factory import zero_slots
from scoreboard.errors import InputError, NonCompliant
from scoreboard.lockfile import load_lock
from scoreboard.round.run import RoundOptions, run_round
from scoreboard.weights.verify import default_cache, weights_dir

REPO = Path(__file__).resolve().parent.parent
TARGET = "k3-mini-cpu"
FLAGSHIP = "kimi-k3-h200x8-iq1s"


def _lock(tmp_path: Path, edit=None) -> Path:
    doc = zero_slots(tomlkit.parse((REPO / "reference.lock").read_text(encoding="utf-8")))
    if edit:
        edit(doc)
    p = tmp_path / "reference.lock"
    p.write_text(tomlkit.dumps(doc), encoding="utf-8")
    return p


def _opts(lock: Path, tmp_path: Path, **kw) -> RoundOptions:
    base = dict(target=TARGET, lock_path=lock, rounds_dir=tmp_path / "rounds", cache_dir=default_cache(), seed=7,
                require_calibration=False)  # the history rule, not the calibration, is under test here
    base.update(kw)
    return RoundOptions(**base)


@pytest.fixture
def nothing_runs(monkeypatch):
    """Refusals must come before the round starts: preflight (the first thing that touches the box) fails
    the test if it is reached."""
    import scoreboard.round.run as run_mod

    def boom(rnd):
        raise AssertionError("preflight ran: the input error was not refused up front")

    monkeypatch.setattr(run_mod, "preflight", boom)


def _nothing_written(tmp_path: Path) -> None:
    rounds = tmp_path / "rounds"
    assert not rounds.exists() or not [p for p in rounds.iterdir() if p.name != "ledger.jsonl"]
    ledger = rounds / "ledger.jsonl"
    assert not ledger.exists() or ledger.read_bytes() == b""


def _mistype_shard(doc) -> None:
    doc["weights"]["k3-mini"]["files"][1]["path"] = "k3-mini-00002-of-0003.gguf"


def _unknown_engine(doc) -> None:
    doc["targets"][TARGET]["candidate_engine"] = "sparkinferr"
    for name in [n for n in doc["slots"] if "_SPARKINFER_" in n and n.startswith("K3_MINI_CPU")]:
        del doc["slots"][name]  # slot names derive from the engine: keep the lock otherwise valid


@pytest.mark.parametrize("kw,edit,match", [
    ({"candidate": "deadbeef1234"}, None, "--candidate 'deadbeef1234' is neither"),
    ({"candidate": "no-such-branch"}, None, "--candidate 'no-such-branch' is neither"),
    ({"candidate": "EMPTYDIR"}, None, "no engines/ directory there"),
    ({"seed": -1}, None, "--seed -1: must be an integer from 0"),
    ({"blocks": 2}, None, "--blocks 2: must be at least 4"),
    ({"reps": 0}, None, "--reps 0: must be at least 1"),
    ({}, _unknown_engine, "targets.k3-mini-cpu.candidate_engine: unknown engine 'sparkinferr'"),
    ({}, _mistype_shard, "weights.k3-mini.files: spec k3-mini writes"),
    ({"target": FLAGSHIP}, None, "scoreboard pin weights --target kimi-k3-h200x8-iq1s"),
    ({"target": "k3-mini-cpx"}, None, "unknown target 'k3-mini-cpx'"),
])
def test_input_errors_are_refused_before_anything_runs(tmp_path, kw, edit, match, nothing_runs):
    lock = _lock(tmp_path, edit)
    before = lock.read_bytes()
    if kw.get("candidate") == "EMPTYDIR":
        (tmp_path / "not-a-checkout").mkdir()
        kw = {**kw, "candidate": str(tmp_path / "not-a-checkout")}
    with pytest.raises(InputError) as info:
        run_round(_opts(lock, tmp_path, **kw))
    assert match in info.value.message + (info.value.hint or "")
    _nothing_written(tmp_path)
    assert lock.read_bytes() == before


def test_a_broken_ledger_is_refused_before_anything_runs(tmp_path, nothing_runs):
    lock = _lock(tmp_path)
    rounds = tmp_path / "rounds"
    rounds.mkdir()
    (rounds / "ledger.jsonl").write_text('{"kind": "round"}\n', encoding="utf-8")  # no chain, wrong keys
    with pytest.raises((NonCompliant, InputError), match="ledger chain is broken"):
        run_round(_opts(lock, tmp_path))
    assert sorted(p.name for p in rounds.iterdir()) == ["ledger.jsonl"]


def test_the_cli_refuses_a_typo_with_exit_1_and_writes_nothing(tmp_path):
    lock = _lock(tmp_path)
    env_py = [sys.executable, "-m", "scoreboard"]
    out = subprocess.run([*env_py, "round", "run", "--lock", str(lock), "--rounds", str(tmp_path / "rounds"),
                          "--candidate", "deadbeef1234"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 1, out.stderr
    assert "--candidate 'deadbeef1234'" in " ".join(out.stderr.split())
    _nothing_written(tmp_path)


def _have_k3_mini() -> bool:
    lk = load_lock(REPO / "reference.lock")
    root = weights_dir("k3-mini", default_cache())
    return all((root / f.path).is_file() for f in lk.weights["k3-mini"].files)


needs_weights = pytest.mark.skipif(not _have_k3_mini(), reason="k3-mini not generated in the cache yet "
                                   "(`scoreboard weights generate k3-mini --out ~/.cache/scoreboard/weights/k3-mini`)")


def _sealed_abort(tmp_path: Path, out) -> dict:
    r = out.receipt
    assert r["status"] == "aborted" and out.exit_code == 1
    assert out.path is not None and out.path.is_file()
    sealed = json.loads(out.path.read_text(encoding="utf-8"))
    assert sealed["seal"]["sha256"]
    lines = (tmp_path / "rounds" / "ledger.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(x)["round_id"] for x in lines] == [r["round_id"]]
    return sealed


@needs_weights
def test_a_shard_that_does_not_match_its_pin_is_sealed(tmp_path):
    """The box's copy of a shard differs from the lock: an observation about the box, sealed as aborted."""
    def edit(doc):
        doc["weights"]["k3-mini"]["files"][0]["sha256"] = "0" * 64

    lock = _lock(tmp_path, edit)
    sealed = _sealed_abort(tmp_path, run_round(_opts(lock, tmp_path)))
    assert sealed["aborted"]["stage"] == "preflight" and "sha256" in sealed["aborted"]["reason"]


def test_a_box_of_another_node_class_is_refused_before_anything_is_written(tmp_path, nothing_runs):
    """A target whose node class this box is not (a target typed for another box) is an input error: no receipt,
    no ledger line, the lock untouched."""
    def edit(doc):
        doc["nodes"]["cpu-x86_64"]["gpu_count"] = 1

    lock = _lock(tmp_path, edit)
    before = lock.read_bytes()
    with pytest.raises(InputError, match="this box is not of node class 'cpu-x86_64'"):
        run_round(_opts(lock, tmp_path))
    _nothing_written(tmp_path)
    assert lock.read_bytes() == before


def test_unpinned_weights_without_seal_are_not_refused_for_sealing(tmp_path, nothing_runs):
    """--no-seal is the trial path for unpinned weights: not refused for the seal; the CPU box then fails the
    flagship's node class before anything runs, and nothing is written."""
    lock = _lock(tmp_path)
    with pytest.raises(InputError, match="node class 'h200x8'"):
        run_round(_opts(lock, tmp_path, target=FLAGSHIP, seal=False))
    _nothing_written(tmp_path)



def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True,
                          env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                               "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"}).stdout.strip()


@needs_weights
def test_a_reference_ref_that_moved_is_sealed(tmp_path):
    """The pinned reference ref was pushed past its commit (a local repo standing in for the fork): the
    round observes it at preflight and seals that, with the old and new commits in the reason."""
    upstream = tmp_path / "llama.cpp"
    upstream.mkdir()
    _git(upstream, "init", "-q", "-b", "main")
    (upstream / "a.txt").write_text("a\n")
    _git(upstream, "add", "a.txt")
    _git(upstream, "commit", "-q", "-m", "pinned")
    pinned = _git(upstream, "rev-parse", "HEAD")
    (upstream / "a.txt").write_text("b\n")
    _git(upstream, "commit", "-q", "-am", "pushed later")
    moved = _git(upstream, "rev-parse", "HEAD")

    def edit(doc):
        ref = tomlkit.table()
        ref.update({"kind": "git", "repo": str(upstream), "ref": "refs/heads/main", "commit": pinned,
                    "base_commit": pinned})
        doc["references"]["local-moved"] = ref
        doc["targets"][TARGET]["reference"] = "local-moved"

    lock = _lock(tmp_path, edit)
    sealed = _sealed_abort(tmp_path, run_round(_opts(lock, tmp_path, cache_dir=tmp_path / "cache")))
    assert sealed["aborted"]["stage"] == "preflight"
    assert "force-pushed or moved" in sealed["aborted"]["reason"] and moved in sealed["aborted"]["reason"]
