"""Synthetic receipts (docs/receipt-format.md 1.0) and a tiny test target, for tests of sealing, the
ledger, the frontier and verify. Shared: other tests may import it (`from receipt_factory import ...`).

- `lock_with_test_target(tmp_path)`: a copy of the repo's reference.lock plus target `rcpt-test`
  (generated, fully pinned weights; CPU node; decode@512 scored, prefill 256 guard).
- `make_receipt(...)`: an unsealed, valid receipt for that target. Samples are deterministic: rep r of
  block b of an arm at `tps` tok/s takes n_tokens / tps seconds, scaled by a +-1% pattern, so the
  arm value (median of block medians) is exactly `tps` rounded to the slot's 4 decimals.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import tomlkit

from scoreboard.lockfile import Target
from scoreboard.history.receipt import FORMAT_VERSION

REPO = Path(__file__).resolve().parent.parent
TARGET = "rcpt-test"
MAIN_COMMIT = "1" * 40
PR_COMMIT = "2" * 40

_SHA = "ab" * 32
TEST_TOML = f"""
[references.rcpt-test-ref]
kind = "pypi-sdist"
package = "llama-cpp-python"
version = "0.3.36"
sha256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
subdir = "vendor/llama.cpp"

[weights.rcpt-test-w]
repo = "generated"
spec = "k3-mini"
seed = 1
quant = "Q8_0"
files = [{{ path = "rcpt-test-00001-of-00001.gguf", size = 1234, sha256 = "{_SHA}" }}]

[nodes.rcpt-test-cpu]
gpu_count = 0

[targets.rcpt-test]
model = "rcpt-mini"
weights = "rcpt-test-w"
quant = "Q8_0"
node = "rcpt-test-cpu"
reference = "rcpt-test-ref"
reference_engine = "llamacpp"
candidate_engine = "sparkinfer"
device = "cpu"
geometry = {{ n_ctx = 1024, n_batch = 256, n_ubatch = 256 }}
metrics = [
  {{ phase = "decode", depth = 512, n_tokens = 32, role = "scored" }},
  {{ phase = "prefill", depth = 0, n_tokens = 256, role = "guard" }},
]
gate = {{ depths = [512], rows_per_depth = 4, top1_min = 0.9, kl_max = 0.05, kl_prefer = 0.02, kl_p99_max = 0.5 }}
speed = {{ warmup_reps = 1, reps = 3, blocks = 3, timeout_s = 60 }}

[targets.rcpt-test.tiers]
buckets = {{ XS = 0.02, S = 0.035, M = 0.06, L = 0.10, XL = 0.18 }}
max_ci_width = 0.04
guard_tolerance = 0.01
"""

# slot names, as Target.slot derives them for the test target
SCORED_SLOT = "RCPT_MINI_RCPT_TEST_CPU_Q80_SPARKINFER_DECODE_512"
GUARD_SLOT = "RCPT_MINI_RCPT_TEST_CPU_Q80_SPARKINFER_PREFILL_256"
REF_SCORED_SLOT = "RCPT_MINI_RCPT_TEST_CPU_Q80_LLAMACPP_DECODE_512"
REF_GUARD_SLOT = "RCPT_MINI_RCPT_TEST_CPU_Q80_LLAMACPP_PREFILL_256"


def target_table() -> dict[str, Any]:
    """The test target as `Target.model_dump(mode="json")` (what a round stores in lock_target)."""
    doc = tomlkit.parse(TEST_TOML).unwrap()
    return Target.model_validate(doc["targets"][TARGET]).model_dump(mode="json")


def zero_slots(doc: Any) -> Any:
    """A fresh history: every slot back to 0 with no provenance (the repo's own sealed rounds are not
    in a test's rounds/ directory, so its measured slots would not be backed there), and the test session's
    signing key pinned (signer_fixtures), so that what the test seals is trusted under this lock."""
    from signer_fixtures import pin_signer

    for name in list(doc.get("slots", {})):
        doc["slots"][name]["value"] = 0.0
        for k in ("round", "commit", "measured_at", "reps"):
            doc["slots"][name].pop(k, None)
    return pin_signer(doc)


def shrunk_lock(dest: Path, target: str = "k3-mini-cpu", *, blocks: int = 2, reps: int = 1,
                warmup_reps: int | None = 1) -> Path:
    """The repo's reference.lock written to `dest` (a file path) with a fresh history (slots zeroed) and
    `target`'s speed policy shrunk to test size (warmup_reps None: left as the lock has it); validated."""
    from scoreboard.lockfile import load_lock

    doc = zero_slots(tomlkit.parse((REPO / "reference.lock").read_text(encoding="utf-8")))
    speed = doc["targets"][target]["speed"]
    speed["blocks"], speed["reps"] = blocks, reps
    if warmup_reps is not None:
        speed["warmup_reps"] = warmup_reps
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(tomlkit.dumps(doc), encoding="utf-8")
    load_lock(dest)
    return dest


def lock_with_test_target(dest_dir: Path) -> Path:
    """Copy the repo's reference.lock into dest_dir (slots zeroed) and add the test target's tables."""
    path = Path(dest_dir) / "reference.lock"
    shutil.copyfile(REPO / "reference.lock", path)
    doc = zero_slots(tomlkit.parse(path.read_text(encoding="utf-8")))  # the session's signer pinned
    extra = tomlkit.parse(TEST_TOML)
    for section in ("references", "weights", "nodes", "targets"):
        for name, table in extra[section].items():
            doc[section][name] = table
    path.write_text(tomlkit.dumps(doc), encoding="utf-8")
    return path


_JITTER = (1.0, 0.99, 1.01)  # per-rep scale of the time; the median rep is the unscaled one
_BLOCK_DRIFT = (1.0, 1.004, 0.997, 1.002, 0.999)  # per-block scale (block_drift=True): block values a real box gives


def _blocks(tps: float, n_tokens: int, blocks: int, reps: int, tokens: bool,
            drift: bool = False) -> list[dict[str, Any]]:
    out = []
    for b in range(blocks):
        scale = _BLOCK_DRIFT[b % len(_BLOCK_DRIFT)] if drift else 1.0
        ns = [round(n_tokens / tps * 1e9 * _JITTER[r % 3] * scale) for r in range(reps)]
        blk: dict[str, Any] = {"block": b, "samples_ns": ns, "n_tokens": [n_tokens] * reps,
                               "wall_ns": sum(ns) + 1000, "command": ["worker", "--block", str(b)]}
        if tokens:
            blk["token_ids"] = [[7] * min(n_tokens, 4) for _ in range(reps)]
        out.append(blk)
    return out


def _side(commit: str, label: str, is_main: bool) -> dict[str, Any]:
    return {"engine": "sparkinfer", "label": label, "commit": commit, "dirty": False, "is_main": is_main,
            "identity": {"engine": "sparkinfer", "version": "0.1.0", "source": {"commit": commit},
                         "build_flags": [], "compiler": "", "binaries": {}, "device": "cpu", "extra": {}}}


def make_receipt(*, is_main: bool = True, label: str = "S", gate_pass: bool = True,
                 candidate_tps: float = 50.0, reference_tps: float = 40.0, guard_tps: float = 900.0,
                 ref_guard_tps: float = 800.0, blocks: int = 3, reps: int = 3, status: str = "verdict",
                 created_at: str = "2026-11-29T14:15:00Z", round_hex: str = "3f9a1c2e", claim: bool = False,
                 commit: str | None = None, frontier_at_start: float = 0.0, guard_frontier_at_start: float = 0.0,
                 baselines_at_start: tuple[float, float] | None = None, block_drift: bool = False) -> dict[str, Any]:
    """An unsealed receipt for the test target. `status="aborted"` gives an aborted round (no verdict).
    `*_at_start`: the slots as the round read them at its start (the scored and guard frontier; the two
    reference baselines, receipt 1.3, absent when None). `block_drift`: block values that differ (else every
    block of an arm is the same, which the verdict flags as zero variance)."""
    stamp = created_at.replace("-", "").replace(":", "")
    commit = commit if commit is not None else (MAIN_COMMIT if is_main else PR_COMMIT)
    arms = ["reference", "candidate"] + ([] if is_main else ["main"])
    speed = None
    if status == "verdict" and gate_pass:
        metrics = []
        for phase, depth, n, slot, cand, ref in (("decode", 512, 32, SCORED_SLOT, candidate_tps, reference_tps),
                                                 ("prefill", 0, 256, GUARD_SLOT, guard_tps, ref_guard_tps)):
            arm_tps = {"reference": ref, "candidate": cand, "main": cand}
            metrics.append({"phase": phase, "depth": depth, "n_tokens": n,
                            "role": "scored" if phase == "decode" else "guard", "slot": slot,
                            "frontier": frontier_at_start if phase == "decode" else guard_frontier_at_start,
                            "arms": {a: {"blocks": _blocks(arm_tps[a], n, blocks, reps, a != "reference",
                                                           block_drift)} for a in arms},
                            "timed_output_ok": True})
            if baselines_at_start is not None:
                metrics[-1]["baseline"] = baselines_at_start[0 if phase == "decode" else 1]
        speed = {"schedule": [arms if b % 2 == 0 else arms[::-1] for b in range(blocks)], "metrics": metrics}
    gate = None
    if status == "verdict":
        gate = {"prompt": {"corpus_sha256": _SHA, "offset": 0, "n_tokens": 600, "token_ids_sha256": _SHA},
                "depths": [{"depth": 512, "rows": 4, "positions": [509, 510, 511, 512], "kl_mean": 1e-4,
                            "kl_p99": 5e-4, "kl_max": 9e-4, "top1": 1.0, "ratchet_baseline": None,
                            "ratchet_ok": True, "pass": gate_pass, "reasons": []}],
                "worst": {"kl_mean": 1e-4, "kl_p99": 5e-4, "top1": 1.0},
                "greedy": {"decode@512": [7, 7, 7, 7]}, "pass": gate_pass, "flagged": False,
                "reasons": [] if gate_pass else ["kl_mean 0.9 > 0.05 at depth 512"]}
    verdict = None
    if status == "verdict":
        verdict = {"label": label if gate_pass else "REJECT", "gain": None, "gain_ci": None, "basis": "none",
                   "frontier": None, "value": candidate_tps, "speed_label": None, "reasons": [],
                   "explanation": "synthetic", "claim": claim}
    return {
        "format_version": FORMAT_VERSION,
        "round_id": f"{stamp}-{TARGET}-{round_hex}",
        "created_at": created_at,
        "status": status,
        "target": TARGET,
        "lock_sha256": _SHA,
        "lock_target": target_table(),
        "candidate": _side(commit, "main" if is_main else "pr-7", is_main),
        "main": None if is_main else _side(MAIN_COMMIT, "main", True),
        "reference": {"engine": "llamacpp", "identity": {
            "engine": "llamacpp", "version": "0.3.36",
            "source": {"kind": "pypi-sdist", "package": "llama-cpp-python", "version": "0.3.36",
                       "sha256": "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"},
            "build_flags": ["-DCMAKE_BUILD_TYPE=Release"], "compiler": "gcc 12", "binaries": {"llama-bench": _SHA},
            "device": "cpu", "extra": {}}},
        "weights": {"id": "rcpt-test-w", "files": [{"path": "rcpt-test-00001-of-00001.gguf", "size": 1234,
                                                    "sha256": _SHA}], "fully_pinned": True},
        "environment": {"cpu": "test", "python": "3.11"},
        "seed": 1234567,
        "geometry": {"n_ctx": 1024, "n_batch": 256, "n_ubatch": 256},
        "gate": gate,
        "speed": speed,
        "verdict": verdict,
        "aborted": {"stage": "preflight", "reason": "synthetic abort", "transient": False}
        if status == "aborted" else None,
        "retries": [],
        "commands": [["worker", "--arm", "candidate"]],
        "stage_seconds": {"preflight": 1.5, "gate": 2.0, "speed": 3.25},
        "provenance": {"host": "test-box"},
    }
