"""The reference build's evidence is anchored in sealed history, not in the cache's own manifest.json.

A real (cached) llama.cpp build is copied into a temp cache; the first sealed receipt for its build key is the
anchor; then each attack a process with write access to the cache could make is tried on a fresh copy: a
library planted in a subdirectory of build/bin (the loader searches glibc-hwcaps/ before $ORIGIN), a binary
rewritten together with manifest.json, a file removed together with its manifest entry. Each is a pin error
naming the file, before the reference runs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engines.llamacpp import build
from llamacpp_fixtures import prepared_reference
from receipt_factory import make_receipt
from scoreboard.errors import NonCompliant, PinError
from scoreboard.history.records import write_receipt
from scoreboard.round.evidence import check_reference_build, sealed_anchor

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return prepared_reference(tmp_path_factory.mktemp("llamacpp"))


def _copy_build(b: build.Build, cache: Path) -> Path:
    root = cache / "llamacpp" / "build" / b.root.name
    shutil.copytree(b.bin_dir, root / "build" / "bin", symlinks=True)
    for inc in ("include", "ggml/include"):
        shutil.copytree(b.root / "src" / inc, root / "src" / inc)
    shutil.copy2(b.root / "manifest.json", root / "manifest.json")
    return root


def _rewrite_manifest(root: Path) -> None:
    """What an attacker with write access to the cache does: re-record every file under build/bin."""
    m = json.loads((root / "manifest.json").read_text())
    scan = build.scan_build(root / "build" / "bin")
    m["binaries"], m["links"] = scan["files"], scan["links"]
    (root / "manifest.json").write_text(json.dumps(m, indent=2, sort_keys=True) + "\n")


def _seal(rounds: Path, identity: dict, n: int, status: str = "verdict") -> str:
    r = make_receipt(created_at=f"2026-11-29T14:1{n}:00Z", round_hex=f"{n:08x}", status=status)
    r["reference"]["identity"] = identity
    write_receipt(r, rounds, forbidden_roots=[])
    return r["round_id"]


@pytest.fixture
def anchored(prepared, tmp_path):
    """(engine, target, cache, rounds, first round id): a copy of the real build, anchored by one sealed round."""
    engine, target, p = prepared
    cache, rounds = tmp_path / "cache", tmp_path / "rounds"
    _copy_build(p.handle.build, cache)
    first = engine.prepare(target, cache)
    assert first.notes["cache_hit"], first.notes
    ident = first.identity.as_dict()
    assert check_reference_build(ident, rounds) == {"status": "first-use", "round": None}
    rid = _seal(rounds, ident, 1)
    again = engine.prepare(target, cache).identity.as_dict()
    assert check_reference_build(again, rounds) == {"status": "matched", "round": rid}
    return engine, target, cache, rounds, rid


def _bin(cache: Path, engine, target) -> Path:
    return build.build_root(cache, engine._plan(target)) / "build" / "bin"


def test_a_library_planted_in_a_subdirectory_with_a_rewritten_manifest_is_refused(anchored):
    engine, target, cache, rounds, rid = anchored
    bin_dir = _bin(cache, engine, target)
    hw = bin_dir / "glibc-hwcaps" / "x86-64-v4"
    hw.mkdir(parents=True)
    shutil.copy2(bin_dir / "libggml-base.so.0.25.3", hw / "libggml-base.so.0")
    assert build.verify_binaries(bin_dir, build.read_manifest(bin_dir.parent.parent)) == [
        "glibc-hwcaps/x86-64-v4/libggml-base.so.0: not recorded in the manifest"]  # found without a manifest edit
    _rewrite_manifest(bin_dir.parent.parent)
    p = engine.prepare(target, cache)  # the cache's own check passes: its manifest was rewritten too
    assert p.notes["cache_hit"] and "glibc-hwcaps/x86-64-v4/libggml-base.so.0" in p.identity.binaries
    ident = p.identity.as_dict()
    with pytest.raises(PinError, match=rf"glibc-hwcaps/x86-64-v4/libggml-base.so.0: not recorded in the receipt "
                                       rf"of round {rid}"):
        check_reference_build(ident, rounds)
    assert ident["extra"]["build_anchor"]["status"] == "mismatch"
    # the aborted round that found it is sealed too, and is never taken as the anchor
    _seal(rounds, ident, 2, status="aborted")
    assert sealed_anchor(rounds, ident["extra"]["build_key"]).round_id == rid


def test_a_binary_rewritten_together_with_the_manifest_is_refused(anchored):
    engine, target, cache, rounds, rid = anchored
    bench = _bin(cache, engine, target) / "llama-bench"
    bench.write_bytes(bench.read_bytes() + b"\0forged")
    _rewrite_manifest(bench.parent.parent.parent)
    ident = engine.prepare(target, cache).identity.as_dict()
    with pytest.raises(PinError, match=rf"llama-bench: sha256 {build.sha256_file(bench)} != recorded [0-9a-f]{{64}} "
                                       rf"\(the receipt of round {rid}\)"):
        check_reference_build(ident, rounds)
    # the operator's deliberate escape hatch is recorded with every difference
    rec = check_reference_build(engine.prepare(target, cache).identity.as_dict(), rounds, renew=True)
    assert rec["status"] == "renewed" and rec["round"] == rid and rec["differences"][0].startswith("llama-bench:")


def test_a_file_removed_together_with_its_manifest_entry_is_refused(anchored):
    engine, target, cache, rounds, rid = anchored
    lib = _bin(cache, engine, target) / "libllama-quantize-impl.so"
    lib.unlink()
    _rewrite_manifest(lib.parent.parent.parent)
    with pytest.raises(PinError, match=rf"libllama-quantize-impl.so: missing \(the receipt of round {rid}\)"):
        check_reference_build(engine.prepare(target, cache).identity.as_dict(), rounds)


def test_an_edited_anchor_receipt_is_an_error_not_a_first_use(anchored):
    engine, target, cache, rounds, rid = anchored
    path = rounds / f"{rid}.json"
    path.write_text(path.read_text().replace('"llama-bench"', '"llama-bench2"', 1))
    with pytest.raises(NonCompliant, match="differ from its ledger line"):
        check_reference_build(engine.prepare(target, cache).identity.as_dict(), rounds)
