"""The clock is the harness's: real worker processes over the FIFO handshake, the parent's readings as samples.

Candidate trees are written here and imported the way a PR's tree is (its `engines/` first on the path);
no model is needed, so these run in seconds.
"""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import pytest

from scoreboard.ceiling import implausible
from scoreboard.engine import EngineTarget, Geometry, Workload
from scoreboard.errors import EngineError
from scoreboard.worker.handshake import PROTOCOL, decode, encode
from scoreboard.worker.nullengine import expected_output
from scoreboard.round.reveal import block_order, derived
from scoreboard.round.launch import run_worker
from scoreboard.worker.protocol import TimedOp
from scoreboard.round.clock import SessionPlan, run_session

GEOM = Geometry(n_ctx=64, n_batch=16, n_ubatch=16, n_threads=1)
WL = Workload("decode", 4, 3, (5, 6, 7))
REVEALS = [(0, (11,)), (1, (12,)), (2, (13,)), (3, (14,))]

# A toy "model" both sides know: the greedy continuation of a revealed token t is t+1, t+2, ...
HEAD = '''
import os, sys, threading, time
from scoreboard.engine import Engine, EngineIdentity, LogitsResult, Prepared


class SparkInferEngine(Engine):
    name = "sparkinfer"
    clock = "harness"

    def describe(self, target):
        return EngineIdentity(engine="sparkinfer", version="hostile", source={"stub": True})

    def prepare(self, target, cache_dir, progress=None):
        return Prepared(self.describe(target))

    def logits(self, prepared, request):
        raise NotImplementedError

    def begin(self, prepared, workload):
        return workload

    def step(self, prepared, workload, revealed):
        time.sleep(0.05)
        return [revealed[0] + i + 1 for i in range(workload.n_tokens)]
'''

HOSTILE = {
    # replaces every clock a worker-side timer could read, and the harness's own timing module, at import
    "patch_clock": '''
import time as _time
import scoreboard.round.clock as _timing
_fake = iter(range(0, 10**18, 1000))
_time.perf_counter_ns = lambda: next(_fake)
_time.perf_counter = lambda: next(_fake) / 1e9
_timing.run_session = lambda *a, **k: [[]]
_timing.in_process_reps = lambda *a, **k: []
''',
    # does the work in the untimed begin(): it must guess the secret token (here: the last known one)
    "precompute": '''
_step = SparkInferEngine.step
def _begin(self, prepared, workload):
    guess = workload.prompt_ids[-1]
    return workload, [guess + i + 1 for i in range(workload.n_tokens)]
def _cached(self, prepared, state, revealed):
    return state[1]
SparkInferEngine.begin = _begin
SparkInferEngine.step = _cached
''',
    # answers at once and keeps "working" in a thread after the output went out
    "background_thread": '''
def _fast(self, prepared, workload, revealed):
    threading.Thread(target=time.sleep, args=(0.3,), daemon=True).start()
    return [revealed[0] + i + 1 for i in range(workload.n_tokens)]
SparkInferEngine.step = _fast
''',
    # leaves a process behind that would outlive the launch
    "orphan": '''
import subprocess
def _leave(self, prepared, workload, revealed):
    p = subprocess.Popen(["sleep", "300"])
    open(os.path.join(os.getcwd(), "orphan.pid"), "w").write(str(p.pid))
    return [revealed[0] + i + 1 for i in range(workload.n_tokens)]
SparkInferEngine.step = _leave
''',
    # writes its own bytes into the clock FIFO (a forged, instant output message)
    "forge_message": '''
def _forge(self, prepared, workload, revealed):
    with open("clock.from-worker", "wb", buffering=0) as f:
        f.write(b'{"protocol":"scoreboard-clock/0","type":"output"}\\n')
    return [revealed[0] + i + 1 for i in range(workload.n_tokens)]
SparkInferEngine.step = _forge
''',
}


def _tree(tmp_path: Path, mode: str | None) -> Path:
    root = tmp_path / f"cand-{mode}"
    pkg = root / "engines" / "sparkinfer"
    pkg.mkdir(parents=True)
    (root / "engines" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "engine.py").write_text(textwrap.dedent(HEAD) + textwrap.dedent(HOSTILE.get(mode or "", "")))
    return root


def _timed(root: Path, tmp_path: Path, plan: SessionPlan | None = None, harness_engine: str | None = None,
           isolation: str = "bwrap"):
    plan = plan or SessionPlan([WL], [REVEALS], warmup=1)
    target = EngineTarget("stub", Path("/nonexistent.gguf"), (), "cpu", GEOM)
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    op = TimedOp.of(plan.workloads, [len(r) for r in plan.reveals])
    return run_worker("sparkinfer", root, target, tmp_path / "cache", op, 60, workdir=work,
                      session=lambda ch: run_session(ch, plan), isolation=isolation, harness_engine=harness_engine)


def _want(revealed: tuple[int, ...]) -> list[int]:
    return [revealed[0] + i + 1 for i in range(WL.n_tokens)]


def test_honest_session_samples_come_from_the_parent_and_cover_the_step(tmp_path):
    res = _timed(_tree(tmp_path, None), tmp_path)
    reps = res.session[0]
    assert [r.variant for r in reps] == [1, 2, 3]  # the warm-up rep (variant 0) is discarded
    assert all(r.token_ids == _want(REVEALS[r.variant][1]) for r in reps)
    assert all(r.ns >= 50_000_000 for r in reps)  # the step's sleep is inside the parent's interval
    assert all(r.worker_ns is not None and r.worker_ns <= r.ns for r in reps)
    assert sum(r.ns for r in reps) < res.wall_ns


def test_a_worker_that_patches_every_clock_in_its_process_changes_no_sample(tmp_path):
    """(a) The engine module replaces time.perf_counter_ns and scoreboard.round.clock in the worker: the samples
    are still the parent's readings around the real 50 ms step."""
    reps = _timed(_tree(tmp_path, "patch_clock"), tmp_path).session[0]
    assert len(reps) == 3 and all(r.ns >= 50_000_000 for r in reps)
    assert all(r.token_ids == _want(REVEALS[r.variant][1]) for r in reps)
    assert any(r.worker_ns is not None and r.worker_ns < 50_000_000 for r in reps)  # its own claim: only recorded


def test_work_done_in_begin_cannot_know_the_revealed_token(tmp_path):
    """(b) begin() computes the whole decode from what it saw; the revealed token makes that output wrong."""
    reps = _timed(_tree(tmp_path, "precompute"), tmp_path).session[0]
    assert all(r.token_ids != _want(REVEALS[r.variant][1]) for r in reps)


def test_a_background_thread_cannot_end_the_sample_before_the_output(tmp_path):
    """(d) The sample ends when the complete output line arrived, and the output must be right; work a thread
    keeps doing afterwards cannot contribute to an output already sent (here it only sleeps). What holds:
    the parent never stops its clock on anything but the output message."""
    reps = _timed(_tree(tmp_path, "background_thread"), tmp_path).session[0]
    assert all(r.token_ids == _want(REVEALS[r.variant][1]) for r in reps)


def test_a_process_left_behind_dies_with_the_launch(tmp_path):
    # unsandboxed, so that the child's pid is a host pid (in the sandbox its pid namespace ends with the launch,
    # tests/test_exploits_sandbox.py); the launch's process group is killed after the worker exits
    res = _timed(_tree(tmp_path, "orphan"), tmp_path, isolation="none")
    assert res.session[0]
    pid = int(next((tmp_path / "work").glob("sb-worker-*/orphan.pid")).read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the worker's child {pid} outlived the launch")


def test_a_forged_message_in_the_fifo_ends_the_session_with_an_error(tmp_path):
    with pytest.raises(EngineError, match="protocol 'scoreboard-clock/0', expected 'scoreboard-clock/2'"):
        _timed(_tree(tmp_path, "forge_message"), tmp_path)


def test_the_null_engine_measures_the_handshake_itself(tmp_path):
    """The harness's own null engine through the same launch: no work, so its samples are the round trip."""
    empty = tmp_path / "empty"
    (empty / "engines").mkdir(parents=True)  # no candidate code: the sandbox binds an empty engines/
    plan = SessionPlan([WL], [REVEALS], warmup=0)
    reps = _timed(empty, tmp_path, plan, harness_engine="null").session[0]
    assert len(reps) == 4 and all(r.token_ids == expected_output(WL, REVEALS[r.variant][1]) for r in reps)
    assert all(0 < r.ns < 2_000_000_000 for r in reps)  # generous: a loaded box, never seconds


def test_the_lock_cannot_name_the_null_engine():
    from scoreboard import registry
    from scoreboard.errors import InputError

    with pytest.raises(InputError):
        registry.load("scoreboard-null")


def test_messages_are_versioned_and_checked():
    msg = encode("ready", workload=0, rep=1)
    assert decode(msg.strip(), "ready", workload=0, rep=1)["protocol"] == PROTOCOL
    with pytest.raises(EngineError, match="expected"):
        decode(msg.strip(), "ready", workload=0, rep=2)
    with pytest.raises(EngineError, match="unreadable"):
        decode(b"not json", "output")


def test_reveals_are_a_separate_derivation_and_every_launch_sees_each_variant_once():
    assert derived(7, "decode@1024") != derived(7, "order", "candidate", 0, "decode@1024")
    assert derived(7, "x") != derived(8, "x")
    orders = {tuple(block_order(7, "candidate", b, "decode@1024", 4, 4)) for b in range(6)}
    assert all(sorted(o) == [0, 1, 2, 3] for o in orders) and len(orders) > 1


def test_workload_withholds_the_secret_part():
    w, revealed = Workload.split("decode", 4, 3, (1, 2, 3, 9, 8))
    assert w.prompt_ids == (1, 2, 3) and revealed == (9,)
    w, revealed = Workload.split("prefill", 2, 3, (1, 2, 3, 4, 5, 6))
    assert w.prompt_ids == (1, 2) and revealed == (3, 4, 5) and w.output_len == 1
    with pytest.raises(ValueError, match="exactly 3 prompt ids"):
        Workload("decode", 4, 3, (1, 2, 3, 9))
    with pytest.raises(ValueError, match="decode at depth 0 cannot reveal 1 token"):
        Workload.split("decode", 0, 3, (1, 2))
    # K revealed tokens: begin() sees depth - K, step() the K
    w, revealed = Workload.split("decode", 5, 2, (1, 2, 3, 9, 8, 7), reveal=3)
    assert w.prompt_ids == (1, 2) and revealed == (3, 9, 8) and w.reveal_len == 3 and w.known_len == 2
    with pytest.raises(ValueError, match="needs depth >= 3"):
        Workload("decode", 2, 1, (1,), reveal=3)


def test_ceiling_refuses_a_rate_above_the_bound():
    ceiling = {"decode_max_tok_s": 1000.0, "memory_bandwidth_gbs": 1, "devices": 1, "decode_bytes_per_token": 10**6}
    assert implausible(ceiling, "decode", 32, [40_000_000, 33_000_000]) is None  # 970 tok/s
    assert "above the physical ceiling" in implausible(ceiling, "decode", 32, [40_000_000, 31_000_000])
    assert implausible(ceiling, "prefill", 32, [1]) is None  # no prefill bound
    assert implausible(None, "decode", 32, [1]) is None


def test_the_ceiling_at_depth_counts_the_cache_rows_a_token_attends_over():
    """At depth d a decoded token reads d latent rows of every MLA layer too (one byte per value at least): a
    rate honest at depth 0 is impossible at depth 10^6 on the same box."""
    from scoreboard.ceiling import max_tok_s_at

    ceiling = {"memory_bandwidth_gbs": 1, "devices": 1, "decode_bytes_per_token": 10**6,
               "kv_floor_bytes_per_row": 1000, "kv_bytes_per_row_f16": 2000}
    assert max_tok_s_at(ceiling, 0) == 1000.0 and max_tok_s_at(ceiling, 1000) == 500.0
    assert max_tok_s_at(ceiling, 1000, f16_kv=True) == pytest.approx(1e9 / 3e6)
    assert implausible(ceiling, "decode", 32, [40_000_000]) is None  # 800 tok/s at depth 0
    why = implausible(ceiling, "decode", 32, [40_000_000], depth=1000)
    assert "above the physical ceiling 500 tok/s" in why and "1,000,000 B of cache rows at depth 1000" in why


def test_the_k3_mini_ceiling_counts_active_weights_only(lock_path):
    from scoreboard.ceiling import decode_bytes
    from scoreboard.lockfile import load_lock
    from scoreboard.models.k3 import load_k3_config
    from scoreboard.weights.verify import default_cache, ensure_generated

    shards = ensure_generated(load_lock(lock_path), "k3-mini", default_cache())
    cfg = load_k3_config(shards[0])
    total, parts = decode_bytes(shards, cfg)
    assert parts["routed_experts_used"] * cfg.n_expert == parts["routed_experts_all"] * cfg.n_expert_used
    assert total < sum(p.stat().st_size for p in shards)
    assert total == parts["non_expert"] + parts["embedding_row"] + parts["routed_experts_used"]
