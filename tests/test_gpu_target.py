"""One H200 as a first-class target: the lock's GPU targets load, their candidate options are typed by the
candidate engine (unknown or mistyped ones are path-qualified lock errors), the options reach the engine and
are sealed in the receipt, and a round on this (GPU-less) box is refused by the node-class check."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomlkit

from engines.sparkinfer import options as spark_options
from receipt_factory import zero_slots
from scoreboard.errors import EngineError, InputError, LockError
from scoreboard.lockfile import load_lock, parse_lock
from scoreboard.round.run import RoundOptions, check_inputs, run_round
from scoreboard.weights.verify import default_cache

REPO = Path(__file__).resolve().parent.parent
GPU_TARGETS = ("k3-gpu-h200", "k3-wide-h200")


def _lock_text(edit) -> str:
    doc = tomlkit.parse((REPO / "reference.lock").read_text())
    edit(doc)
    return tomlkit.dumps(doc)


def test_the_gpu_targets_load_on_a_one_h200_node_class():
    lock = load_lock(REPO / "reference.lock")
    node = lock.nodes["h200x1"]
    assert (node.gpu_model, node.gpu_count, node.gpu_memory_gib, node.cpu_arch, node.min_cpu_cores) == (
        "H200", 1, 139.5, "x86_64", 16)
    for tid in GPU_TARGETS:
        t = lock.targets[tid]
        assert t.node == "h200x1" and t.device == "cuda" and t.parallel.ranks == 1
        assert t.candidate_options == {"dtype": "float16", "cuda_graph": True}
        assert t.scored.depth in t.gate.depths and t.weights in lock.weights


@pytest.mark.parametrize("options, problem", [
    ('{ dtype = "float16", cuda_graph = "yes" }', r"targets\.k3-gpu-h200\.candidate_options\.cuda_graph: Input "
                                                  r"should be a valid boolean, got 'yes'"),
    ('{ dtype = 16 }', r"targets\.k3-gpu-h200\.candidate_options\.dtype: Input should be 'float32', 'bfloat16', "
                       r"'float16' or 'float64', got 16"),
    ('{ dtpye = "float16" }', r"targets\.k3-gpu-h200\.candidate_options\.dtpye: unknown sparkinfer option \(known: "
                              r"dtype, cuda_graph\); remove it or check its spelling"),
    ('{ faults = ["mla_as_mqa"] }', r"targets\.k3-gpu-h200\.candidate_options\.faults: sparkinfer reads this "
                                    r"option, but only tests and calibration set it"),
])
def test_unknown_or_mistyped_candidate_options_are_path_qualified_lock_errors(options, problem):
    """The lock loads (its loader loads no engine); the round's input check refuses the options by their path."""
    text = (REPO / "reference.lock").read_text().replace(
        'candidate_options = { dtype = "float16", cuda_graph = true }', f"candidate_options = {options}", 1)
    lock = parse_lock(text)
    with pytest.raises(LockError, match=problem) as exc:
        check_inputs(RoundOptions(target="k3-gpu-h200"), lock)
    assert len(exc.value.problems) == 1


def test_the_engine_itself_refuses_what_the_lock_would():
    assert spark_options.parse({"dtype": "bfloat16", "faults": "mla_as_mqa"}).faults == ("mla_as_mqa",)
    with pytest.raises(EngineError, match=r"options\.dtpye: Extra inputs are not permitted"):
        spark_options.parse({"dtpye": "float16"})
    with pytest.raises(EngineError, match=r"options\.faults: .*unknown fault\(s\) \['nope'\]"):
        spark_options.parse({"faults": ["nope"]})


@pytest.fixture
def lock(tmp_path: Path) -> Path:
    def edit(doc):
        zero_slots(doc)
        t = doc["targets"]["k3-mini-cpu"]
        t["speed"]["blocks"] = 2
        t["speed"]["reps"] = 1
        t["candidate_options"] = {"dtype": "bfloat16"}

    p = tmp_path / "reference.lock"
    p.write_text(_lock_text(edit))
    load_lock(p)
    return p


def test_a_gpu_round_on_this_box_is_refused_by_the_node_class_before_any_receipt(lock, tmp_path):
    """A target typed for another box is an input error: nothing is written, sealed or not (a new user's
    `round run --target k3-gpu-h200` on a CPU box sealed an ABORTED receipt and a ledger line)."""
    for seal in (False, True):
        with pytest.raises(InputError, match="this box is not of node class 'h200x1'") as exc:
            run_round(RoundOptions(target="k3-gpu-h200", lock_path=lock, rounds_dir=tmp_path / "rounds",
                                   cache_dir=default_cache(), seal=seal, seed=1, require_calibration=False))
        assert "gpu.count: node class wants 1, this box has 0" in exc.value.message
        assert exc.value.hint == "run `scoreboard env --target k3-gpu-h200` and use a matching box"
        assert not (tmp_path / "rounds").exists()
    # the options such a round would run with (what its receipt's provenance records on the H200)
    from scoreboard.round.run import candidate_options

    opts = RoundOptions(target="k3-gpu-h200", lock_path=lock)
    assert candidate_options(load_lock(lock).target("k3-gpu-h200"), opts, "k3-gpu-h200") == \
        {"dtype": "float16", "cuda_graph": True}


def test_round_overrides_are_checked_before_anything_runs(lock, tmp_path):
    with pytest.raises(LockError, match=r"targets\.k3-mini-cpu\.candidate_options\.faults: .*unknown fault"):
        run_round(RoundOptions(target="k3-mini-cpu", lock_path=lock, rounds_dir=tmp_path / "rounds",
                               cache_dir=default_cache(), candidate_options={"faults": ["nope"]},
                               require_calibration=False))
    with pytest.raises(InputError, match=r"candidate_options\.cuda_graph: Input should be a valid boolean"):
        run_round(RoundOptions(target="k3-mini-cpu", lock_path=lock, rounds_dir=tmp_path / "rounds",
                               cache_dir=default_cache(), candidate_options={"cuda_graph": "on"},
                               require_calibration=False))
    assert not (tmp_path / "rounds").exists()


@pytest.mark.slow
def test_lock_options_reach_the_engine_and_round_overrides_win_key_by_key(lock, tmp_path):
    """The lock pins dtype = bfloat16 for the cpu target; a test adds a fault: both reach the engine worker."""
    out = run_round(RoundOptions(target="k3-mini-cpu", lock_path=lock, rounds_dir=tmp_path / "rounds",
                                 cache_dir=default_cache(), seal=False, gate_only=True, seed=3,
                                 candidate_options={"faults": ["mla_as_mqa"]}, require_calibration=False))
    r = out.receipt
    extra = r["candidate"]["identity"]["extra"]
    assert extra["dtype"] == "bfloat16" and extra["faults"] == ["mla_as_mqa"] and extra["cuda_graph"] is False
    assert r["provenance"]["candidate_options"] == {
        "lock": {"dtype": "bfloat16"}, "round_overrides": {"faults": ["mla_as_mqa"]},
        "effective": {"dtype": "bfloat16", "faults": ["mla_as_mqa"]}}
    assert not r["gate"]["pass"]  # the fault bites: the options really ran


def test_the_cli_runs_the_gpu_target_and_refuses_it_until_it_is_calibrated(lock, tmp_path):
    """From the CLI the GPU target loads and its options validate; on this CPU box the node class refuses it
    first, and on a box of the class the round refuses it until `scoreboard gate calibrate k3-gpu-h200` has
    sealed a calibration of its bars (nothing written either way)."""
    import subprocess
    import sys

    from scoreboard.calibrate import check_calibration

    out = subprocess.run([sys.executable, "-m", "scoreboard.cli.main", "round", "run", "--target", "k3-gpu-h200",
                          "--lock", str(lock), "--rounds", str(tmp_path / "rounds"), "--no-seal", "--json"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 1, out.stdout + out.stderr
    err = " ".join(out.stderr.split())
    assert "not of node class 'h200x1'" in err and "scoreboard env --target k3-gpu-h200" in err
    with pytest.raises(InputError) as exc:
        check_calibration(load_lock(lock), "k3-gpu-h200", tmp_path / "rounds")
    text = exc.value.message + " " + (exc.value.hint or "")
    assert "'k3-gpu-h200' has no calibration" in text and "scoreboard gate calibrate k3-gpu-h200" in text
    assert not (tmp_path / "rounds").exists()


def test_every_node_class_gives_the_decode_ceiling_a_bandwidth():
    """A node without memory_bandwidth_gbs leaves its rounds without the physical bound on decode rates (the
    receipt's speed.ceiling is null): every node class in the lock must carry one."""
    lock = load_lock(REPO / "reference.lock")
    missing = [name for name, node in lock.nodes.items() if node.memory_bandwidth_gbs is None]
    assert not missing, f"nodes without memory_bandwidth_gbs: {missing}"
