"""Multi-process candidates driven by the harness: torchrun launch, rank-0 clock around barriers, agreement,
fingerprints of every rank, teardown on failure, and a whole round of the expert-parallel sparkinfer.

Real parts: torchrun (torch.distributed.run) with gloo, the harness's worker module, the bundled sparkinfer
on the generated k3-mini, llama.cpp as the reference. The misbehaving candidates are small engine trees
written here and imported exactly the way a PR's candidate tree is (its `engines/` first on the path).
"""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import tomlkit

from receipt_factory import zero_slots
from scoreboard.worker.distributed import launch_command, rank_problems, visible_devices
from scoreboard.engine import EngineTarget, Geometry, Workload
from scoreboard.errors import EngineError
from scoreboard.lockfile import LockError, load_lock, parse_lock
from scoreboard.round.candidate import HARNESS_ROOT
from scoreboard.round.run import RoundOptions, run_round
from scoreboard.round.launch import run_worker
from scoreboard.worker.protocol import CheckedOp, CheckedRun, LogitsOp, LogitsRows, TimedOp
from scoreboard.round.clock import SessionPlan, run_session
from scoreboard.history.verify import verify as verify_all
from scoreboard.weights.verify import default_cache, ensure_generated

REPO = Path(__file__).resolve().parent.parent
TARGET = "k3-mini-cpu"
GEOM = Geometry(n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=1)


# ----------------------------------------------------------------------------------------------
# the lock: parallel policy

def _lock_text(**parallel) -> str:
    doc = tomlkit.parse((REPO / "reference.lock").read_text())
    t = doc["targets"][TARGET]
    t["geometry"]["n_threads"] = 1
    if parallel:
        t["parallel"] = parallel
    return tomlkit.dumps(doc)


def test_parallel_defaults_to_one_process_and_layer_split():
    lock = load_lock(REPO / "reference.lock")
    for t in lock.targets.values():
        assert t.parallel.ranks == 1 or t.device == "cuda"
    assert lock.targets["kimi-k3-h200x8-iq1s"].parallel.ranks == 8
    assert lock.targets["kimi-k3-h200x8-iq1s"].parallel.reference_split_mode == "layer"
    assert parse_lock(_lock_text(ranks=2)).targets[TARGET].parallel.ranks == 2


def test_oversubscribed_cpu_ranks_are_refused_naming_the_field():
    doc = tomlkit.parse(_lock_text(ranks=2))
    doc["targets"][TARGET]["geometry"]["n_threads"] = 2
    with pytest.raises(LockError) as exc:
        parse_lock(tomlkit.dumps(doc))
    assert "targets.k3-mini-cpu.parallel.ranks" in str(exc.value) and "2 cpu ranks x 2 thread(s)" in str(exc.value)


def test_more_ranks_than_gpus_is_refused():
    doc = tomlkit.parse((REPO / "reference.lock").read_text())
    doc["targets"]["kimi-k3-h200x8-iq1s"]["parallel"]["ranks"] = 16
    with pytest.raises(LockError) as exc:
        parse_lock(tomlkit.dumps(doc))
    assert "targets.kimi-k3-h200x8-iq1s.parallel.ranks: 16 ranks need 16 GPUs" in str(exc.value)


def test_unknown_split_mode_is_refused():
    with pytest.raises(LockError) as exc:
        parse_lock(_lock_text(ranks=1, reference_split_mode="rows"))
    assert "targets.k3-mini-cpu.parallel.reference_split_mode" in str(exc.value)


def test_fit_prices_the_lock_s_ranks_and_cpu_ranks_share_the_host(tmp_path):
    from scoreboard.fit import fit_budget

    one = fit_budget(parse_lock(_lock_text()), TARGET, usable_gib=None)
    two = fit_budget(parse_lock(_lock_text(ranks=2)), TARGET)
    assert (one.ranks, two.ranks) == (1, 2)
    assert two.usable_gib == pytest.approx(one.usable_gib / 2) and "shared by 2 ranks" in two.usable_source
    assert fit_budget(load_lock(REPO / "reference.lock"), "kimi-k3-h200x8-iq1s", detect=False).ranks == 8


def test_launch_command_is_torchrun_standalone():
    cmd = launch_command(4, "scoreboard.worker", ["req.json", "res.json"])
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert "--nproc-per-node=4" in cmd and "--max-restarts=0" in cmd
    assert cmd[-4:] == ["-m", "scoreboard.worker", "req.json", "res.json"]


def test_both_sides_get_the_same_first_gpus():
    assert visible_devices(4, {}) == "0,1,2,3"
    assert visible_devices(2, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == "4,5"
    with pytest.raises(EngineError) as exc:
        visible_devices(8, {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert "leaves 2 GPU(s), the target runs 8 rank(s)" in exc.value.message


def _fp(rank: int, **kw) -> dict:
    base = {"cpu": {"arch": "x86_64"}, "kernel": "6", "python": "3.12", "packages": {"torch": "2"}, "harness": {},
            "rank": {"rank": rank, "device": f"cuda:{rank}", "device_uuid": f"GPU-{rank}", "device_name": "NVIDIA H200"}}
    base.update(kw)
    return base


def test_rank_problems_name_each_broken_world():
    assert rank_problems([_fp(0), _fp(1)], 2, "cuda", "H200") == []
    assert any("expected 0..2" in p for p in rank_problems([_fp(0), _fp(1)], 3, "cuda", "H200"))
    shared = _fp(1)
    shared["rank"]["device_uuid"] = "GPU-0"
    assert any("share a GPU" in p for p in rank_problems([_fp(0), shared], 2, "cuda", "H200"))
    wrong = _fp(1)
    wrong["rank"]["device_name"] = "NVIDIA A100"
    assert any("not a H200" in p for p in rank_problems([_fp(0), wrong], 2, "cuda", "H200"))
    assert any("differ in packages" in p for p in rank_problems([_fp(0), _fp(1, packages={"torch": "3"})], 2,
                                                                 "cuda", "H200"))


# ----------------------------------------------------------------------------------------------
# the launch, on misbehaving candidates

STUB = '''
import os, time
import numpy as np
import torch.distributed as dist
from scoreboard.engine import Engine, EngineIdentity, LogitsResult, Prepared
from scoreboard.errors import EngineError


class SparkInferEngine(Engine):
    name = "sparkinfer"
    clock = "harness"
    max_ranks = 8

    def describe(self, target):
        return EngineIdentity(engine="sparkinfer", version="stub", source={"stub": True})

    def prepare(self, target, cache_dir, progress=None):
        rank, mode = dist.get_rank(), target.options.get("stub")
        if rank == 1 and mode == "raise":
            raise EngineError("rank one cannot load its band", "fix rank one")
        if rank == 1 and mode == "die":
            os._exit(9)
        if rank == 1 and mode == "hang":
            time.sleep(3600)
        return Prepared(self.describe(target), handle={"rank": rank, "mode": mode})

    def logits(self, prepared, request):
        h = prepared.handle
        fill = float(h["rank"]) if h["mode"] == "diverge" else 0.5
        return LogitsResult(np.full((len(request.positions), 8), fill, np.float32), request.geometry)

    def begin(self, prepared, workload):
        return workload

    def step(self, prepared, workload, revealed):
        h = prepared.handle
        if h["mode"] == "slow_rank" and h["rank"] == 1:
            time.sleep(0.5)
        return [7] * workload.n_tokens
'''


@pytest.fixture
def stub_root(tmp_path: Path) -> Path:
    root = tmp_path / "candidate"
    pkg = root / "engines" / "sparkinfer"
    pkg.mkdir(parents=True)
    (root / "engines" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "engine.py").write_text(textwrap.dedent(STUB))
    return root


def _stub_target(mode: str, ranks: int = 2) -> EngineTarget:
    return EngineTarget("stub", Path("/nonexistent.gguf"), (), "cpu", GEOM, options={"stub": mode}, ranks=ranks)


def _run_stub(stub_root: Path, tmp_path: Path, mode: str, op: str = "logits", timeout_s: float = 120, ranks: int = 2):
    wl = Workload("decode", 1, 3, ())
    payload = {"logits": LogitsOp(requests=(LogitsRows.of([1, 2, 3], [2]),)),
               "checked": CheckedOp(checked=(CheckedRun.of(wl, [[1]]),)),
               "timed": TimedOp.of([wl], [3])}[op]
    plan = SessionPlan([wl], [[(0, (1,)), (1, (2,)), (2, (3,))]], warmup=1)
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return run_worker("sparkinfer", stub_root, _stub_target(mode, ranks), tmp_path / "cache", payload, timeout_s,
                      workdir=work, session=(lambda ch: run_session(ch, plan)) if op == "timed" else None)


def _rank_pids(tmp_path: Path) -> list[int]:
    return [int(p.read_text()) for p in (tmp_path / "work").glob("sb-worker-*/result.rank*.pid")]


def _gone(pids: list[int], tmp_path: Path | None = None) -> bool:
    """No rank left: inside the sandbox the recorded pids are the pid namespace's own (never signalled or probed
    from outside), so look for any host process whose command line names this test's scratch directory. A killed
    process can take a moment to be reaped on a loaded box: poll for up to 10 s (a leaked rank stays forever)."""
    if tmp_path is not None:
        deadline = time.monotonic() + 10
        while processes_naming(tmp_path / "work") and time.monotonic() < deadline:
            time.sleep(0.2)
        return not processes_naming(tmp_path / "work")
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


def processes_naming(path: Path) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if str(path).encode() in (d / "cmdline").read_bytes():
                out.append(int(d.name))
        except OSError:
            continue
    return out


def test_two_ranks_agree_and_report_every_fingerprint(stub_root, tmp_path):
    res = _run_stub(stub_root, tmp_path, "ok")
    body = res.result
    assert body.ok and body.identity["source"] == {"stub": True}
    fps = body.ranks
    assert [fp["rank"]["rank"] for fp in fps] == [0, 1]
    assert len({fp["rank"]["pid"] for fp in fps}) == 2 and all(fp["rank"]["backend"] == "gloo" for fp in fps)
    assert np.load(body.logits[0].path).shape == (1, 8)
    assert "torch.distributed.run" in res.command
    assert len(_rank_pids(tmp_path)) == 2 and _gone([], tmp_path)


def test_a_rank_that_raises_is_named_and_no_rank_survives(stub_root, tmp_path):
    with pytest.raises(EngineError) as exc:
        _run_stub(stub_root, tmp_path, "raise")
    assert "on rank 1 of 2" in exc.value.message and "rank one cannot load its band" in exc.value.message
    assert exc.value.hint == "fix rank one"
    pids = _rank_pids(tmp_path)
    assert len(pids) == 2 and _gone(pids, tmp_path)


def test_a_rank_that_dies_silently_is_a_crash_and_no_rank_survives(stub_root, tmp_path):
    with pytest.raises(EngineError) as exc:
        _run_stub(stub_root, tmp_path, "die")
    assert "failed on rank 1 of 2: rank 1 ended without a result (exit code 9)" in exc.value.message
    pids = _rank_pids(tmp_path)
    assert len(pids) == 2 and _gone(pids, tmp_path)


def test_a_hung_rank_hits_the_timeout_and_every_rank_is_stopped(stub_root, tmp_path):
    t0 = time.monotonic()
    with pytest.raises(EngineError) as exc:
        _run_stub(stub_root, tmp_path, "hang", timeout_s=15)
    assert "exceeded the 15 s timeout" in exc.value.message and "every process was stopped" in exc.value.message
    assert time.monotonic() - t0 < 15 + 30
    pids = _rank_pids(tmp_path)
    assert len(pids) == 2 and _gone(pids, tmp_path)


def test_ranks_that_disagree_on_logits_are_refused(stub_root, tmp_path):
    with pytest.raises(EngineError) as exc:
        _run_stub(stub_root, tmp_path, "diverge")
    assert "ranks [1] disagree with rank 0 on the logits" in exc.value.message


def test_rank_zero_clock_waits_for_the_slowest_rank(stub_root, tmp_path):
    """Rank 1 sleeps 0.5 s in step(), rank 0 returns at once: rank 0's reps must still cover rank 1's step."""
    fast = _run_stub(stub_root, tmp_path, "ok", op="timed").session[0]
    slow = _run_stub(stub_root, tmp_path, "slow_rank", op="timed").session[0]
    assert len(slow) == 2 and all(r.ns >= 500_000_000 for r in slow)  # the parent's clock, around rank 0's answer
    assert all(r.ns < 400_000_000 for r in fast)
    assert [r.variant for r in slow] == [1, 2] and all(r.token_ids == [7, 7, 7] for r in slow)


def test_an_engine_without_ranks_is_refused(tmp_path):
    """llamacpp splits inside one process (-sm); launching it as ranks is refused by the harness."""
    with pytest.raises(EngineError) as exc:
        run_worker("llamacpp", HARNESS_ROOT, _stub_target("ok"), tmp_path,
                   LogitsOp(requests=(LogitsRows.of([1], [0]),)), 120, workdir=tmp_path)
    assert "runs as at most 1 process(es)" in exc.value.message


# ----------------------------------------------------------------------------------------------
# the real expert-parallel sparkinfer through the harness's launch

@pytest.fixture(scope="module")
def shards() -> tuple[Path, ...]:
    return tuple(ensure_generated(load_lock(REPO / "reference.lock"), "k3-mini", default_cache()))


def _k3_target(shards, ranks: int) -> EngineTarget:
    return EngineTarget(TARGET, shards[0], shards, "cpu", GEOM, ranks=ranks)


@pytest.mark.slow
def test_expert_parallel_logits_through_torchrun_equal_the_single_process(shards, tmp_path):
    ids = list(range(1, 200))
    req = LogitsOp(requests=(LogitsRows.of(ids, [0, 63, 150, 198]),))
    one = run_worker("sparkinfer", HARNESS_ROOT, _k3_target(shards, 1), default_cache(), req, 300,
                     workdir=tmp_path).result
    two = run_worker("sparkinfer", HARNESS_ROOT, _k3_target(shards, 2), default_cache(), req, 300,
                     workdir=tmp_path).result
    a, b = np.load(one.logits[0].path), np.load(two.logits[0].path)
    assert np.array_equal(a, b)  # top-2 routing: at most two non-zero expert terms, any order is exact
    par = two.identity["extra"]["parallel"]
    assert par["world"] == 2 and par["backend"] == "gloo"
    assert [b[0] for b in par["plan"]["bands"]] == [0, par["plan"]["n_expert"] // 2]
    assert "parallel" not in one.identity["extra"]


@pytest.fixture
def ep2_lock(tmp_path: Path) -> Path:
    doc = tomlkit.parse(_lock_text(ranks=2))
    t = doc["targets"][TARGET]
    t["speed"]["blocks"] = 2
    t["speed"]["reps"] = 1
    zero_slots(doc)
    p = tmp_path / "reference.lock"
    p.write_text(tomlkit.dumps(doc))
    load_lock(p)
    return p


@pytest.mark.slow
def test_a_sealed_round_of_the_two_rank_candidate(ep2_lock, tmp_path):
    # geometry.n_threads = 1 is another target definition than the calibrated one: a test round without it
    out = run_round(RoundOptions(target=TARGET, lock_path=ep2_lock, rounds_dir=tmp_path / "rounds",
                                 cache_dir=default_cache(), seed=5, require_calibration=False))
    r = out.receipt
    assert r["status"] == "verdict", r.get("aborted")
    assert r["gate"]["pass"], r["gate"]["reasons"]
    assert max(d["kl_mean"] for d in r["gate"]["depths"]) < 1e-8
    assert r["environment"]["parallel"] == {"ranks": 2, "backend": "gloo", "launcher": "torchrun --standalone",
                                            "reference_split_mode": "layer", "visible_devices": ""}
    assert [fp["rank"]["rank"] for fp in r["environment"]["ranks"]] == [0, 1]
    assert r["environment"]["rank_problems"] == []
    peaks = r["environment"]["peak_memory"]  # measured per rank, next to the fit check's prediction
    assert [p["rank"] for p in peaks] == [0, 1] and all(0.05 < p["host_rss_gib"] < 8 for p in peaks)
    assert r["environment"]["fit"]["ranks"] == 2 and r["environment"]["fit"]["need_gib_per_rank"] > 0
    assert r["candidate"]["identity"]["extra"]["parallel"]["world"] == 2
    assert any("torch.distributed.run" in c for c in r["commands"])
    assert any("-sm" in c and "layer" in c for c in r["commands"])
    for m in r["speed"]["metrics"]:
        assert m["timed_output_ok"]
        assert len(m["arms"]["candidate"]["blocks"]) == 2
    assert r["verdict"]["label"] == "BASELINE"
    assert verify_all(ep2_lock, tmp_path / "rounds").ok


# torchrun's summary when rank 0 is the first failure it observed (it aborted on its peer's death) and rank 1 the
# rank that died: the log line before the summary names "local_rank: 0" too (a CI run on 2026-12-02 under load)
_SUMMARY_ROOT_0 = """\
E1202 20:28:18.339000 2 site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -6) \
local_rank: 0 (pid: 7) of binary: /usr/bin/python3
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
scoreboard.worker FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-02_20:28:18
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 9 (pid: 8)
  error_file: <N/A>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-02_20:28:18
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -6 (pid: 7)  (SIGABRT)
  error_file: <N/A>
============================================================
"""


def test_each_rank_gets_its_own_exit_code_from_torchruns_summary():
    """The pattern once paired torchrun's "local_rank: 0" log line with rank 1's exit code, so a dead rank 1 read
    "no exit code reported" whenever rank 0 happened to be the first failure torchrun observed."""
    from scoreboard.round.launch import _TORCHRUN_FAILURE

    assert {int(r): int(c) for r, c in _TORCHRUN_FAILURE.findall(_SUMMARY_ROOT_0)} == {1: 9, 0: -6}
    root = _TORCHRUN_FAILURE.search(_SUMMARY_ROOT_0, _SUMMARY_ROOT_0.find("Root Cause"))
    assert root is not None and (root.group(1), root.group(2)) == ("0", "-6")
