"""`run_round` end to end in seconds: toy engines (tests/toy_engine.py) injected through the registry.

The reference toy runs in the round's process (an injected factory); the candidate toy runs in the round's
fresh worker processes, which never read the parent's registry: the candidate's commit (a throwaway git
repository, `RoundOptions.repo`) holds it as `engines/toy/engine.py`, the registry maps "toy" to that entry
point, and the worker request carries the entry point the parent resolved. Everything else is the real
round: lock loading, history, preflight on generated k3-mini weights (in a private cache), the gate, the
interleaved speed blocks with the parent's clock, the verdict, the seal and the ledger.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import tomlkit
import toy_engine
from receipt_factory import zero_slots
from sandbox_fixtures import git

from scoreboard import registry
from scoreboard.engine import EngineTarget, Geometry
from scoreboard.errors import EngineError, InputError
from scoreboard.history.receipt import parse_receipt
from scoreboard.history.verify import verify as verify_all
from scoreboard.lockfile import load_lock
from scoreboard.round.launch import run_worker
from scoreboard.round.run import RoundOptions, run_round
from scoreboard.tiers import verdict_from_receipt
from scoreboard.weights.verify import ensure_generated
from scoreboard.worker.protocol import LogitsOp, LogitsRows

REPO = Path(__file__).resolve().parent.parent
TARGET = "toy-cpu"
TOY_TARGET = """
[targets.toy-cpu]
description = "toy engines on the generated k3-mini weights: fast orchestration tests"
model = "toy"
weights = "k3-mini"
quant = "F32"
node = "cpu-x86_64"
reference = "llama-cpp-python-0-3-36"
reference_engine = "toy-ref"
candidate_engine = "toy"
device = "cpu"
geometry = { n_ctx = 256, n_batch = 128, n_ubatch = 128, n_threads = 1 }
metrics = [
  { phase = "decode", depth = 64, n_tokens = 4, role = "scored" },
  { phase = "prefill", depth = 0, n_tokens = 64, role = "guard" },
]
gate = { depths = [32, 64], rows_per_depth = 4, top1_min = 0.95, kl_max = 0.001, kl_prefer = 0.0001, kl_p99_max = 0.01 }
tiers = { buckets = { XS = 0.02, S = 0.035, M = 0.06, L = 0.10, XL = 0.18 }, max_ci_width = 0.5, guard_tolerance = 0.05, min_blocks = 2, bootstrap_resamples = 200 }
speed = { warmup_reps = 1, reps = 2, blocks = 2, timeout_s = 60 }
fit = { scratch_gib = 1, plan = "one process on the host: every weight resident in RAM" }
"""


@pytest.fixture(autouse=True)
def toy_engines():
    """"toy" by entry point (its module lives in the candidate's engines/), "toy-ref" as a factory."""
    registry.inject("toy", "engines.toy.engine:ToyEngine")
    registry.inject_options("toy", toy_engine.ToyOptions)
    registry.inject("toy-ref", toy_engine.ToyReference)
    yield
    registry.uninject("toy")
    registry.uninject("toy-ref")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """A private cache with the generated k3-mini weights (preflight re-hashes them against the lock)."""
    root = tmp_path_factory.mktemp("cache")
    ensure_generated(load_lock(REPO / "reference.lock"), "k3-mini", root)
    return root


@pytest.fixture
def candidate_repo(tmp_path: Path) -> Path:
    """A git repository whose main commit holds the toy candidate as engines/toy/engine.py."""
    repo = tmp_path / "repo"
    (repo / "engines" / "toy").mkdir(parents=True)
    (repo / "engines" / "__init__.py").write_text("")
    (repo / "engines" / "toy" / "__init__.py").write_text("")
    shutil.copyfile(Path(toy_engine.__file__), repo / "engines" / "toy" / "engine.py")
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "toy main")
    return repo


@pytest.fixture
def lock(tmp_path: Path) -> Path:
    doc = zero_slots(tomlkit.parse((REPO / "reference.lock").read_text()))
    doc["targets"][TARGET] = tomlkit.parse(TOY_TARGET)["targets"][TARGET]
    path = tmp_path / "reference.lock"
    path.write_text(tomlkit.dumps(doc))
    load_lock(path)
    return path


def _round(lock: Path, repo: Path, cache: Path, tmp_path: Path, **kw):
    opts = RoundOptions(target=TARGET, lock_path=lock, rounds_dir=tmp_path / "rounds", cache_dir=cache, seed=5,
                        repo=repo, isolation="none", require_calibration=False, **kw)
    return run_round(opts)


def test_a_main_round_of_toy_engines_is_a_sealed_baseline(lock, candidate_repo, cache, tmp_path):
    out = _round(lock, candidate_repo, cache, tmp_path)
    r = out.receipt
    assert r["status"] == "verdict", r["aborted"]
    assert r["gate"]["pass"], r["gate"]["reasons"]
    assert r["verdict"]["label"] == "BASELINE" and out.exit_code == 0
    assert r["candidate"]["identity"]["engine"] == "toy" and r["reference"]["identity"]["engine"] == "toy-ref"
    speed = r["speed"]
    assert speed["handshake"]["reps"] == speed["n_variants"] == 3  # warm-up + 2 reps: one variant each
    for m in speed["metrics"]:
        assert m["timed_output_ok"] and m["plausible"]
        blocks = m["arms"]["candidate"]["blocks"]
        assert [b["block"] for b in blocks] == [0, 1] and all(len(b["samples_ns"]) == 2 for b in blocks)
        assert all(b["clock"] == "harness" and b["command"][-2:] == ["-m", "scoreboard.worker"] for b in blocks)
        assert all(sum(b["samples_ns"]) < b["wall_ns"] for b in blocks)
    assert [c[-1] for c in r["commands"] if c[-1].startswith("<")] == ["<gate>", "<timed>"]
    assert [p["rank"] for p in r["environment"]["peak_memory"]] == [0]
    assert out.path is not None and out.path.exists()
    assert verify_all(lock, tmp_path / "rounds").ok
    ledger = [json.loads(x) for x in (tmp_path / "rounds" / "ledger.jsonl").read_text().splitlines()]
    assert ledger[-1]["round_id"] == r["round_id"]


def test_a_candidate_with_wrong_logits_is_rejected_before_timing(lock, candidate_repo, cache, tmp_path):
    out = _round(lock, candidate_repo, cache, tmp_path, candidate_options={"mode": "wrong_logits"})
    r = out.receipt
    assert r["status"] == "verdict" and r["verdict"]["label"] == "REJECT" and out.exit_code == 2
    assert not r["gate"]["pass"] and r["speed"] is None
    assert any("kl" in x.lower() for x in r["gate"]["reasons"]), r["gate"]["reasons"]
    assert out.path is not None and verify_all(lock, tmp_path / "rounds").ok


def test_an_engine_whose_identity_changes_between_launches_is_aborted(lock, candidate_repo, cache, tmp_path):
    """An engine that picks its code path per launch (a kernel that compiles in one worker and not the next)
    would be timed running other code than the gate judged: the first later launch that says so aborts."""
    out = _round(lock, candidate_repo, cache, tmp_path, candidate_options={"mode": "path_by_launch"})
    r = out.receipt
    assert r["status"] == "aborted" and out.exit_code == 1 and r["verdict"] is None
    reason = r["aborted"]["reason"]
    assert "reported another identity in a later launch" in reason and "extra.pid" in reason, r["aborted"]
    assert "What was timed would not be what was judged" in reason


@pytest.mark.parametrize("mode, says", [
    ("raise_in_prepare", "toy (gate) failed: RuntimeError: the toy engine's prepare crashed"),
    ("exit_in_prepare", "toy worker (gate) crashed with exit 7 and no result"),
    ("forge_result", ("toy worker (gate) wrote a malformed result: worker result: rank: Input should be a "
                      "valid integer")),
])
def test_an_engine_crash_in_prepare_is_a_sealed_aborted_receipt(mode, says, lock, candidate_repo, cache, tmp_path):
    out = _round(lock, candidate_repo, cache, tmp_path, candidate_options={"mode": mode})
    r = out.receipt
    assert r["status"] == "aborted" and out.exit_code == 1 and r["verdict"] is None
    assert r["aborted"]["stage"] == "gate" and says in r["aborted"]["reason"], r["aborted"]
    assert r["reference"]["identity"]["engine"] == "toy-ref"  # who was going to run is still recorded
    assert out.path is not None and out.path.exists()  # an engine crash is sealed
    assert verify_all(lock, tmp_path / "rounds").ok


def test_an_engine_injected_as_a_factory_cannot_reach_a_worker(cache):
    target = EngineTarget("toy", Path("/nonexistent.gguf"), (), "cpu", Geometry(64, 64, 64, 1))
    op = LogitsOp(requests=(LogitsRows.of([1], [0]),))
    with pytest.raises(InputError, match="'toy-ref' is injected as a factory, which no worker process can import"):
        run_worker("toy-ref", REPO, target, cache, op, 30, isolation="none")
    # the entry point resolves, but this import root's engines/ has no toy: the worker itself says so
    with pytest.raises(EngineError, match=r"toy \(logits\) failed: engine 'toy' could not be imported "
                                          r"\(engines\.toy\.engine:ToyEngine\)"):
        run_worker("toy", REPO, target, cache, op, 30, isolation="none")



SHAPE = REPO / "tests" / "golden" / "toy-round-shape.json"


def receipt_shape(obj, path: str = "", out: dict | None = None, types: bool = True) -> dict:
    """Every key path of a receipt (list items merged under "[]") with the JSON types seen there; under
    `environment` the paths only (the box's fingerprint values are the box's, not the round's)."""
    out = {} if out is None else out
    kind = {dict: "object", list: "array", str: "string", bool: "bool", int: "int", float: "float",
            type(None): "null"}[type(obj)]
    out.setdefault(path, set()).add(kind if types else "any")
    if isinstance(obj, dict):
        for k, v in obj.items():
            receipt_shape(v, f"{path}.{k}" if path else k, out, types and not (path == "" and k == "environment"))
    elif isinstance(obj, list):
        for v in obj:
            receipt_shape(v, f"{path}[]", out, types)
    return out


def pr_commit(repo: Path) -> str:
    """A PR commit on a branch of the toy candidate's repository (the same engine: its round has a main arm)."""
    (repo / "engines" / "toy" / "NOTE").write_text("a PR\n")
    git(repo, "checkout", "-q", "-b", "pr")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "a PR")
    sha = git(repo, "rev-parse", "HEAD")
    git(repo, "checkout", "-q", "main")
    return sha


def varying_main(repo: Path, lock: Path, vary: str) -> str:
    """main's commit decodes differently on every other launch (engines/toy/VARY), the PR's does not; the
    toy target's top-1 bar at 0.7, so that one flipped token of a 4-token decode (0.75) still passes."""
    (repo / "engines" / "toy" / "VARY").write_text(vary + "\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", f"main decodes by launch ({vary})")
    (repo / "engines" / "toy" / "VARY").unlink()
    sha = pr_commit(repo)
    doc = tomlkit.parse(lock.read_text())
    doc["targets"][TARGET]["gate"]["top1_min"] = 0.7
    lock.write_text(tomlkit.dumps(doc))
    assert load_lock(lock).target(TARGET).gate.top1_min == 0.7
    return sha


@pytest.mark.parametrize("vary", ["last", "all"])
def test_a_comparison_arm_that_is_not_deterministic_is_its_commits_fault_never_the_candidates(
        vary, lock, candidate_repo, cache, tmp_path):
    """The H200 ladder of 2026-12-01 sealed two REJECTs of a correct, deterministic candidate because the
    frontier commit's own decode varied across blocks (an atomic sum order). The other arm is another commit
    in its own sandbox: the candidate cannot touch it. Outputs that vary but each pass the reference are a
    note and the round is scored; outputs that fail the reference leave no sound basis: inconclusive."""
    sha = varying_main(candidate_repo, lock, vary)
    # the two arms run the same code: a loaded box's noise must not read as a regression (exit 2) or a guard's
    # REJECT, which would hide the labels under test
    doc = tomlkit.parse(lock.read_text())
    doc["targets"][TARGET]["tiers"]["guard_tolerance"] = 0.5
    doc["targets"][TARGET]["tiers"]["max_ci_width"] = 2.0
    lock.write_text(tomlkit.dumps(doc))
    out = _round(lock, candidate_repo, cache, tmp_path, candidate=sha)
    r = out.receipt
    assert r["status"] == "verdict" and r["gate"]["pass"], r["aborted"]
    dec = next(m for m in r["speed"]["metrics"] if m["phase"] == "decode")
    assert dec["timed_output_ok"]  # the candidate reproduced its checked run in every timed rep
    check = dec["arms"]["main"]["output_check"]
    assert any("different outputs across blocks" in n for n in check["notes"]), check
    v = r["verdict"]
    assert v["label"] != "REJECT" and out.exit_code == 0, v
    if vary == "last":
        assert check["ok"] and check["reasons"] == []
        assert not v["flags"] and any("outputs varied across blocks" in x for x in v["reasons"]), v
    else:
        assert not check["ok"] and "fails the reference check" in check["reasons"][0]
        assert v["label"] == "inconclusive" and any("no sound basis" in f for f in v["flags"]), v
        assert "The candidate is not at fault" in v["explanation"]
    assert verdict_from_receipt(parse_receipt(json.loads(out.path.read_text()))).as_dict() == v


def sealed_round(kind: str, lock: Path, repo: Path, cache: Path, tmp_path: Path):
    """A toy round of `kind` ("main": a BASELINE; "pr": a PR against main in the same round), and its sealed file."""
    out = _round(lock, repo, cache, tmp_path, **({"candidate": pr_commit(repo)} if kind == "pr" else {}))
    assert out.path is not None, out.receipt["aborted"]
    return out, json.loads(out.path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("kind", ["main", "pr"])
def test_a_rounds_sealed_receipt_keeps_the_golden_key_set_types_and_gate(kind, lock, candidate_repo, cache, tmp_path):
    """The sealed file of a toy round against one the round wrote before its sections were typed: the same
    key paths with the same JSON types and, with the seed and the engines fixed, the same gate section."""
    out, sealed = sealed_round(kind, lock, candidate_repo, cache, tmp_path)
    golden = json.loads(SHAPE.read_text(encoding="utf-8"))[kind]
    got = {k: sorted(v) for k, v in receipt_shape(sealed).items()}
    missing = sorted(set(golden["shape"]) - set(got))
    extra = sorted(set(got) - set(golden["shape"]))
    assert not missing and not extra, (missing, extra)
    assert {k: v for k, v in got.items() if v != golden["shape"][k]} == {}
    assert sealed["gate"] == golden["gate"]
    assert out.receipt == {k: v for k, v in sealed.items() if k != "seal"}  # the outcome is the sealed body
    # tiers scores the parsed Receipt to the verdict the round scored from its typed sections
    assert verdict_from_receipt(parse_receipt(sealed)).as_dict() == sealed["verdict"]


def test_a_path_taken_only_when_timed_is_rejected_even_when_its_tokens_agree(lock, candidate_repo, cache, tmp_path):
    """A candidate that computes a cheaper, slightly wrong step only when the clock's FIFOs exist (an expert
    dropped, say) gives the honest greedy ids, so a check of tokens alone passes it; its timed log-probs are
    not the checked run's, and the round REJECTs it."""
    out = _round(lock, candidate_repo, cache, tmp_path, candidate_options={"mode": "lossy_when_timed"})
    r = out.receipt
    assert r["status"] == "verdict" and r["gate"]["pass"], (r["aborted"], r["gate"]["reasons"])
    dec = next(m for m in r["speed"]["metrics"] if m["phase"] == "decode")
    want = r["gate"]["checked"][f"decode@{dec['depth']}"]["outputs"]
    blocks = dec["arms"]["candidate"]["blocks"]
    assert all(ids == want[v] for b in blocks for v, ids in zip(b["variants"], b["token_ids"]))  # tokens agree
    assert not dec["timed_output_ok"] and dec["timed_logprob_dev"] > 1e-2, dec["timed_logprob_dev"]
    assert r["verdict"]["label"] == "REJECT" and out.exit_code == 2, r["verdict"]
    assert any("timed outputs differ from the checked run" in x for x in r["verdict"]["reasons"]), r["verdict"]


def test_a_decode_only_bug_is_caught_by_the_decode_paths_own_logits(lock, candidate_repo, cache, tmp_path):
    """A decode step whose logits are wrong while every argmax is right (here: the right rows x 1.5; on the GPU a
    one-token MLA step whose mask dropped the token's own key passed a gate of prefill logits with KL 9.5e-11):
    the prefill logits pass, the greedy ids agree with the reference, and the gate still fails on the rows the
    decode step itself produced, at the decode metric's depth."""
    out = _round(lock, candidate_repo, cache, tmp_path, candidate_options={"mode": "decode_scaled"})
    r = out.receipt
    g = r["gate"]
    assert all(d["pass"] for d in g["depths"]) and all(c["pass"] for c in g["greedy_check"]), g
    path = g["decode_path"]
    assert [p["metric"] for p in path] == ["decode@64"] and not path[0]["pass"], path
    assert not g["pass"] and any(x.startswith("decode path gate depth 64: KL mean") for x in g["reasons"]), g["reasons"]
    assert r["verdict"]["label"] == "REJECT" and r["speed"] is None and out.exit_code == 2


def test_a_decode_reveals_at_least_40_bits(lock, candidate_repo, cache, tmp_path):
    """One revealed token of a ~500-token vocabulary could be enumerated in an untimed begin(): every decode
    variant reveals the prompt's last K tokens, K the fewest that hold speed.reveal_bits (40) bits, and the
    workload begin() saw held only the first depth - K."""
    out = _round(lock, candidate_repo, cache, tmp_path, gate_only=True)
    g = out.receipt["gate"]
    dec = g["checked"]["decode@64"]
    k = dec["reveal_len"]
    assert k >= 2 and dec["reveal_bits"] >= 40 and all(len(v) == k for v in dec["revealed"]), dec
    assert dec["known_len"] == 64 - k
    assert len({tuple(v) for v in dec["revealed"]}) == len(dec["revealed"])


def test_a_pr_that_makes_the_engine_slower_is_a_sealed_regression_and_exits_2(lock, candidate_repo, cache, tmp_path):
    """A PR commit whose decode takes twice as long as main's, measured beside main in the same round: the scored
    metric's whole CI lies below -guard_tolerance, so the round is a regression (exit 2), not none (exit 0)."""
    (candidate_repo / "engines" / "toy" / "SLOW").write_text("4\n")
    doc = tomlkit.parse(lock.read_text())
    doc["targets"][TARGET]["tiers"]["max_ci_width"] = 2.0  # regression or none is under test, not a loaded box's noise
    # a 4x slower decode reads -75% (log-ratio -1.39): its CI stays below -0.3 even at the block spread a loaded
    # 2-core box gives 4 blocks (sd 0.24 of the log-ratios, t(3) half-width ~0.38; at 2x, -0.69, it did not once),
    # while the prefill guard (unchanged code) cannot be convicted by a loaded box's noise (a guard's conviction
    # is a REJECT, which would hide the label under test)
    doc["targets"][TARGET]["tiers"]["guard_tolerance"] = 0.3
    lock.write_text(tomlkit.dumps(doc))
    git(candidate_repo, "checkout", "-q", "-b", "slow")
    git(candidate_repo, "add", "-A")
    git(candidate_repo, "commit", "-q", "-m", "a slower decode")
    sha = git(candidate_repo, "rev-parse", "HEAD")
    git(candidate_repo, "checkout", "-q", "main")
    out = _round(lock, candidate_repo, cache, tmp_path, candidate=sha, blocks=4)
    r = out.receipt
    assert r["status"] == "verdict" and r["gate"]["pass"], r["aborted"]
    v = r["verdict"]
    assert (v["label"], v["basis"], out.exit_code) == ("regression", "main-same-round", 2), v
    assert v["gain_ci"][1] < -0.05 and any("(guard_tolerance)" in x for x in v["reasons"])
    assert out.path is not None and verify_all(lock, tmp_path / "rounds").ok  # sealed and on the ledger
    assert verdict_from_receipt(parse_receipt(json.loads(out.path.read_text()))).as_dict() == v
