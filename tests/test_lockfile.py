"""reference.lock: loader errors (verbatim), schema gate, comment-preserving rewrite, slot derivation."""

from __future__ import annotations

import re

import pytest

from scoreboard.errors import LockError
from scoreboard.lockfile import load_lock, parse_lock, set_slot, update_lock
from scoreboard.slots import ctx_axis, quant_axis, slot_name

GOOD = '''\
schema = 1  # keep me

[references.ref-a]
kind = "git"
repo = "file:///tmp/x.git"
ref = "refs/pull/1/head"
commit = "0123456789abcdef0123456789abcdef01234567"
base_commit = "89abcdef0123456789abcdef0123456789abcdef"

[weights.w]
repo = "generated"
spec = "k3-mini"
seed = 7
quant = "F16"
files = [{ path = "m-00001-of-00001.gguf", size = 10, sha256 = "%s" }]

[nodes.cpu]
gpu_count = 0

[targets.t]
model = "k3-mini"
weights = "w"
quant = "F16"
node = "cpu"
reference = "ref-a"
reference_engine = "llamacpp"
candidate_engine = "sparkinfer"
device = "cpu"
geometry = { n_ctx = 2048, n_batch = 512, n_ubatch = 512 }
metrics = [
  { phase = "decode", depth = 1024, n_tokens = 32, role = "scored" },
  { phase = "prefill", depth = 0, n_tokens = 512, role = "guard" },
]
gate = { depths = [256, 1024], rows_per_depth = 8, top1_min = 0.95, kl_max = 0.05, kl_prefer = 0.02, kl_p99_max = 0.5 }
tiers = { buckets = { XS = 0.02, S = 0.035, M = 0.06, L = 0.10, XL = 0.18 }, max_ci_width = 0.04, guard_tolerance = 0.01 }
speed = { warmup_reps = 1, reps = 3, blocks = 4, timeout_s = 600 }

[slots]
# history comment
K3_MINI_CPU_F16_SPARKINFER_DECODE_1K = { value = 0.0, kind = "frontier" }
''' % ("a" * 64)


def problems(text: str) -> list[str]:
    with pytest.raises(LockError) as info:
        parse_lock(text)
    return info.value.problems


def test_good_lock_parses_and_derives_slots():
    lock = parse_lock(GOOD)
    t = lock.target("t")
    assert t.scored.depth == 1024
    assert t.slot("sparkinfer", t.scored) == "K3_MINI_CPU_F16_SPARKINFER_DECODE_1K"
    assert t.slot("llamacpp", t.guards[0]) == "K3_MINI_CPU_F16_LLAMACPP_PREFILL_512"


def test_committed_lock_is_valid(lock_path):
    lock = load_lock(lock_path)
    flagship = lock.target("kimi-k3-h200x8-iq1s")
    assert flagship.slot("llamacpp", flagship.scored) == "KIMI_K3_H200X8_IQ1S_LLAMACPP_DECODE_128K"
    assert not lock.weights[flagship.weights].fully_pinned  # can run, cannot seal
    assert len(lock.weights[flagship.weights].files) == 14
    assert all(s.value == 0 for n, s in lock.slots.items() if n.startswith("KIMI_K3"))


def test_bad_sha_length():
    text = GOOD.replace('commit = "0123456789abcdef0123456789abcdef01234567"', 'commit = "0123456789abcdef"')
    assert problems(text) == [
        "references.ref-a.commit: a git commit must be 40 lowercase hex characters, got 16: '0123456789abcdef'"]


def test_unknown_reference():
    text = GOOD.replace('reference = "ref-a"', 'reference = "llamacpp-pr-48"')
    assert problems(text) == ["targets.t.reference: unknown reference 'llamacpp-pr-48'"]


def test_duplicate_slot():
    text = GOOD + 'K3_MINI_CPU_F16_SPARKINFER_DECODE_1K = { value = 1.0, kind = "frontier" }\n'
    (msg,) = problems(text)
    assert msg.startswith("not valid TOML: Key \"K3_MINI_CPU_F16_SPARKINFER_DECODE_1K\" already exists.")


def test_missing_required_key():
    text = GOOD.replace('quant = "F16"\nnode = "cpu"', 'node = "cpu"')
    assert problems(text) == ["targets.t.quant: required key is missing"]


def test_wrong_type():
    text = GOOD.replace("rows_per_depth = 8", 'rows_per_depth = "eight"')
    assert problems(text) == [
        "targets.t.gate.rows_per_depth: must be an integer, got str 'eight'"]


@pytest.mark.parametrize("old,new,problem", [
    ("kl_max = 0.05", 'kl_max = "0.001"',
     "targets.t.gate.kl_max: must be a number, got str '0.001' (write it without quotes: kl_max = 0.001)"),
    ("blocks = 4", "blocks = 4.0",
     "targets.t.speed.blocks: must be an integer, got float 4.0 (write a whole number: blocks = 4)"),
    ("rows_per_depth = 8", "rows_per_depth = true",
     "targets.t.gate.rows_per_depth: must be an integer, got bool True (true/false is not a number)"),
])
def test_the_lock_is_strictly_typed(old, new, problem):
    """No coercion: a quoted number or a float where an integer belongs is a typo, named with its fix."""
    assert old in GOOD
    assert problems(GOOD.replace(old, new)) == [problem]


def test_a_lock_that_is_not_utf8_is_a_lock_error(tmp_path):
    from scoreboard.lockfile import load_lock

    p = tmp_path / "reference.lock"
    p.write_bytes(GOOD.encode("utf-8") + b"# caf\xe9 (latin-1)\n")
    with pytest.raises(LockError) as info:
        load_lock(p)
    assert "not UTF-8" in info.value.message and "save" in info.value.hint


def test_unknown_schema_major():
    with pytest.raises(LockError) as info:
        parse_lock(GOOD.replace("schema = 1", "schema = 2"))
    assert info.value.problems == ["schema: unknown major version 2; this scoreboard reads schema 1"]
    assert "update your scoreboard checkout" in info.value.hint and "pip install -U scoreboard" not in info.value.hint


def test_frontier_without_provenance():
    text = GOOD.replace('{ value = 0.0, kind = "frontier" }', '{ value = 12.5, kind = "frontier" }')
    assert problems(text) == [
        "slots.K3_MINI_CPU_F16_SPARKINFER_DECODE_1K: a non-zero frontier needs provenance: round, commit and "
        "measured_at"]


def test_negative_value():
    text = GOOD.replace('{ value = 0.0, kind = "frontier" }', '{ value = -1.0, kind = "frontier" }')
    assert problems(text) == [
        "slots.K3_MINI_CPU_F16_SPARKINFER_DECODE_1K.value: Input should be greater than or equal to 0"]


def test_hand_typed_slot_name_is_refused():
    text = GOOD + 'K3_MINI_CPU_F16_SPARKINFER_DECODE_128K = { value = 0.0, kind = "frontier" }\n'
    (msg,) = problems(text)
    assert msg.startswith("slots.K3_MINI_CPU_F16_SPARKINFER_DECODE_128K: no target defines this slot")


def test_all_problems_reported_at_once():
    text = GOOD.replace('reference = "ref-a"', 'reference = "nope"').replace("rows_per_depth = 8", "rows_per_depth = 0")
    assert problems(text) == ["targets.t.gate.rows_per_depth: Input should be greater than or equal to 1",
                              "targets.t.reference: unknown reference 'nope'"]
    text2 = GOOD.replace('reference = "ref-a"', 'reference = "nope"').replace('node = "cpu"', 'node = "gpu"')
    assert problems(text2) == ["targets.t.reference: unknown reference 'nope'", "targets.t.node: unknown node class 'gpu'"]


def test_gate_must_include_scored_depth():
    text = GOOD.replace("depths = [256, 1024]", "depths = [256]")
    assert problems(text) == ["targets.t: gate.depths [256] must include the scored depth 1024"]


def test_unknown_reference_kind():
    text = GOOD.replace('kind = "git"', 'kind = "svn"')
    (msg,) = problems(text)
    assert msg.startswith("references.ref-a:") and "svn" in msg


def test_rewrite_preserves_comments_and_is_atomic(tmp_path):
    p = tmp_path / "reference.lock"
    p.write_text(GOOD)
    update_lock(p, lambda doc: set_slot(doc, "K3_MINI_CPU_F16_SPARKINFER_DECODE_1K", {
        "value": 12.5, "round": "r1", "commit": "c" * 40, "measured_at": "2026-11-29T00:00:00Z", "reps": 12}))
    text = p.read_text()
    assert "# keep me" in text and "# history comment" in text
    assert load_lock(p).slots["K3_MINI_CPU_F16_SPARKINFER_DECODE_1K"].value == 12.5
    # an invalid edit is refused and leaves the file untouched
    before = p.read_bytes()
    with pytest.raises(LockError):
        update_lock(p, lambda doc: set_slot(doc, "K3_MINI_CPU_F16_SPARKINFER_DECODE_1K", {"value": -3.0}))
    assert p.read_bytes() == before
    assert not [x for x in tmp_path.iterdir() if x.name != "reference.lock"]  # no temp files left


@pytest.mark.parametrize("quant,axis", [("UD-IQ1_S", "IQ1S"), ("Q8_0", "Q80"), ("F16", "F16"), ("UD-Q2_K_XL", "Q2KXL")])
def test_quant_axis(quant, axis):
    assert quant_axis(quant) == axis


@pytest.mark.parametrize("ctx,axis", [(131072, "128K"), (1048576, "1M"), (32768, "32K"), (512, "512"), (1000, "1000")])
def test_ctx_axis(ctx, axis):
    assert ctx_axis(ctx) == axis


def test_slot_name_carries_every_axis():
    name = slot_name("kimi-k3", "h200x8", "UD-IQ1_S", "llamacpp", "decode", 131072)
    assert name == "KIMI_K3_H200X8_IQ1S_LLAMACPP_DECODE_128K"
    assert re.fullmatch(r"[A-Z0-9_]+", name)
    assert slot_name("kimi-k3", "h200x8", "UD-IQ1_M", "llamacpp", "decode", 131072) != name
    assert slot_name("kimi-k3", "h200x8", "UD-IQ1_S", "llamacpp", "prefill", 131072) != name
