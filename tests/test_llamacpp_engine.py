"""The llamacpp engine end to end on a tiny Kimi K3: describe, logits through the dumper, llama-bench timing,
and the clear errors for a model that does not load, a broken llama-bench and binaries changed after prepare."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from llamacpp_fixtures import prepared_reference, tiny_target

from engines.llamacpp import bench, build, logits
from engines.llamacpp.engine import LlamaCppEngine, LlamaCppHandle
from scoreboard import registry
from scoreboard.engine import Geometry, LogitsRequest, Prepared, Workload
from scoreboard.errors import EngineError, InputError, TransientError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return prepared_reference(tmp_path_factory.mktemp("llamacpp"))


def _tokens(n: int, vocab: int, seed: int = 1) -> tuple[int, ...]:
    return tuple(int(x) for x in np.random.default_rng(seed).integers(0, vocab - 2, n))


def test_entry_point_and_describe(prepared):
    engine, target, p = prepared
    assert isinstance(registry.load("llamacpp"), LlamaCppEngine)
    assert engine.clock == "reference-tool" and engine.name == "llamacpp"
    import dataclasses

    from llamacpp_fixtures import test_cache_dir

    described = dataclasses.replace(target, options={**target.options, "cache_dir": str(test_cache_dir())})
    ident = engine.describe(described)
    assert ident == engine.describe(described) == p.identity  # deterministic, and what prepare verified
    want = {**target.reference.identity(), "upstream": target.reference.upstream}
    assert {k: ident.source[k] for k in want} == want  # the pin, plus the tree it was checked against
    assert set(ident.source) - set(want) <= {"tree", "tree_exclude"}
    assert "-DGGML_NATIVE=ON" in ident.build_flags and ident.compiler and ident.device == "cpu"
    assert ident.binaries == p.handle.build.manifest["binaries"]  # the cached build is described
    assert ident.extra["run_flags"] == ["-t", "2", "-fa", "1", "-ngl", "0", "-sm", "layer"]


def test_logits_shape_dtype_finite_and_repeatable(prepared):
    engine, target, p = prepared
    vocab = p.handle.n_vocab
    ids = _tokens(300, vocab)
    req = LogitsRequest(token_ids=ids, positions=(5, 64, 299, 64), geometry=target.geometry)
    a = engine.logits(p, req)
    b = engine.logits(p, req)
    assert a.logits.dtype == np.float32 and a.logits.shape == (4, vocab)
    assert np.isfinite(a.logits).all() and a.logits.std() > 0
    assert np.array_equal(a.logits, b.logits)  # bit-identical run to run
    assert np.array_equal(a.logits[1], a.logits[3])  # a repeated position gives the same row
    assert a.geometry == Geometry(n_ctx=2048, n_batch=512, n_ubatch=128, n_threads=2)
    assert a.command[0].endswith(build.DUMPER) and "--n-ubatch" in a.command
    # each row is the distribution after its own prefix: a different later token leaves row 5 unchanged
    changed = ids[:200] + tuple((t + 1) % (vocab - 2) for t in ids[200:])  # ubatch 128: rows 5, 64 untouched
    c = engine.logits(p, LogitsRequest(token_ids=changed, positions=(5, 64, 299, 64), geometry=target.geometry))
    assert np.array_equal(c.logits[0], a.logits[0]) and not np.array_equal(c.logits[2], a.logits[2])


def test_logits_bad_requests_are_input_errors(prepared):
    engine, target, p = prepared
    with pytest.raises(InputError, match="positions \\[10\\] outside the 10 token ids"):
        engine.logits(p, LogitsRequest(token_ids=(1,) * 10, positions=(10,), geometry=target.geometry))
    with pytest.raises(InputError, match="token ids \\[1000000\\] outside the vocabulary"):
        engine.logits(p, LogitsRequest(token_ids=(10**6,), positions=(0,), geometry=target.geometry))
    # the dumper refuses it on its own too (exit 2), when the Python side does not know the vocabulary
    with pytest.raises(EngineError, match="logits dumper failed \\(exit 2\\)"):
        logits.run_dumper(p.handle.tool(build.DUMPER), Path(target.model_path),
                          LogitsRequest(token_ids=(10**6,), positions=(0,), geometry=target.geometry),
                          p.handle.settings, p.handle.runs_dir / "bad-id.log")


def test_several_requests_in_one_dumper_run_give_each_its_own_rows(prepared):
    """The gate teacher-forces every decode variant through the reference: the variants share the prompt up to
    depth - K, so one dumper run loads the model once, decodes the shared prefix once and restores its saved
    state for each (as llama-bench -d restores its depth); each request's rows are bit for bit the rows a run of
    it alone gives, and a request set that shares nothing is answered too."""
    engine, target, p = prepared
    vocab = p.handle.n_vocab
    shared = _tokens(1100, vocab, seed=3)
    reqs = [LogitsRequest(token_ids=shared + _tokens(40 + 7 * v, vocab, seed=10 + v),
                          positions=tuple(range(1099, 1100 + 30 + v)), geometry=target.geometry) for v in range(3)]
    alone = [engine.logits(p, r).logits for r in reqs]
    many = engine.logits_many(p, reqs)
    assert [m.logits.shape for m in many] == [a.shape for a in alone]
    assert all(np.array_equal(m.logits, a) for m, a in zip(many, alone))
    log = p.handle.runs_dir / "many.log"
    out = logits.run_dumper_many(p.handle.tool(build.DUMPER), Path(target.model_path).resolve(), reqs,
                                 p.handle.settings, log, n_vocab=vocab)
    import json

    echo = json.loads(log.read_text().split("--- stdout\n")[1].splitlines()[0])
    assert echo["n_sequences"] == 3 and echo["shared_prefix"] == 1024 and echo["restored"] == 2, echo
    assert all(np.array_equal(o.logits, a) for o, a in zip(out, alone))
    unrelated = [LogitsRequest(token_ids=_tokens(70, vocab, seed=s), positions=(3, 69), geometry=target.geometry)
                 for s in (20, 21)]
    got = engine.logits_many(p, unrelated)
    assert all(np.array_equal(g.logits, engine.logits(p, r).logits) for g, r in zip(got, unrelated))


def test_timed_decode_at_depth_and_prefill_report_raw_samples(prepared):
    engine, _target, p = prepared
    # decode at depth 64 revealing 5 tokens: 59 in the cache untimed, then the 5 ingested and 8 generated, timed
    decode = Workload(phase="decode", depth=64, n_tokens=8, prompt_ids=(), reveal=5)
    reps = engine.timed(p, decode, 3)
    assert len(reps) == 3 and all(r.ns > 0 and r.n_tokens == 8 and r.clock == "reference-tool" for r in reps)
    cmd = reps[0].command
    assert cmd[cmd.index("-p") + 1] == "0" and cmd[cmd.index("-n") + 1] == "0" and cmd[cmd.index("-d") + 1] == "59"
    assert cmd[cmd.index("-pg") + 1] == "5,8"
    assert cmd[cmd.index("-r") + 1] == "3" and cmd[cmd.index("-ub") + 1] == "128" and "-o" in cmd
    rec = p.handle.last_record
    assert [r.ns for r in reps] == rec["samples_ns"] and rec["n_depth"] == 59
    assert rec["n_prompt"] == 5 and rec["n_gen"] == 8
    assert rec["build_commit"] == p.handle.build.manifest["build_commit"]

    prefill = Workload(phase="prefill", depth=32, n_tokens=128, prompt_ids=())
    reps = engine.timed(p, prefill, 2)
    assert len(reps) == 2 and all(r.n_tokens == 128 for r in reps)
    cmd = reps[0].command
    assert cmd[cmd.index("-p") + 1] == "128" and cmd[cmd.index("-n") + 1] == "0" and cmd[cmd.index("-d") + 1] == "32"
    assert cmd[cmd.index("-sm") + 1] == "layer" and p.handle.last_record["split_mode"] == "layer"


def test_split_mode_reaches_both_tools_and_is_checked(prepared):
    """llama.cpp's -sm goes to llama-bench and the dumper and comes back in both outputs (on a CPU build it
    places nothing, but the flag is pinned and echoed like the rest); an unknown mode is refused early."""
    import dataclasses

    from llamacpp_fixtures import test_cache_dir

    engine, target, _p = prepared
    t = dataclasses.replace(target, options={**target.options, "split_mode": "none"})
    p = engine.prepare(t, test_cache_dir())
    res = engine.logits(p, LogitsRequest(token_ids=(1, 2, 3), positions=(2,), geometry=t.geometry))
    assert res.command[-2:] == ["--split-mode", "none"]
    reps = engine.timed(p, Workload(phase="decode", depth=0, n_tokens=2, prompt_ids=()), 1)
    assert reps[0].command[reps[0].command.index("-sm") + 1] == "none" and p.handle.last_record["split_mode"] == "none"
    with pytest.raises(InputError, match="options.split_mode must be none, layer or row"):
        engine.describe(dataclasses.replace(target, options={**target.options, "split_mode": "rows"}))


def test_bench_output_that_does_not_match_the_request_is_refused():
    w = Workload(phase="decode", depth=65, n_tokens=8, prompt_ids=())  # reveals 1: 64 untimed, then 1 + 8 timed
    g = Geometry(n_ctx=2048, n_batch=512, n_ubatch=128, n_threads=2)
    s = bench.RunSettings(threads=2, flash_attn=1, n_gpu_layers=0)
    rec = {"n_prompt": 1, "n_gen": 8, "n_depth": 64, "n_batch": 512, "n_ubatch": 128, "n_threads": 2,
           "flash_attn": 1, "n_gpu_layers": 0, "split_mode": "layer", "build_commit": "abc", "samples_ns": [5, 6],
           "avg_ts": 1e9}
    import json

    assert bench.parse_bench_json(json.dumps([rec]), w, g, s, 2, "abc")["samples_ns"] == [5, 6]
    with pytest.raises(EngineError, match="n_depth=0 \\(asked 64\\)"):
        bench.parse_bench_json(json.dumps([{**rec, "n_depth": 0}]), w, g, s, 2, "abc")
    with pytest.raises(EngineError, match="split_mode='row' \\(asked 'layer'\\)"):
        bench.parse_bench_json(json.dumps([{**rec, "split_mode": "row"}]), w, g, s, 2, "abc")
    with pytest.raises(EngineError, match="build_commit='abc' \\(asked 'other'\\)"):
        bench.parse_bench_json(json.dumps([rec]), w, g, s, 2, "other")
    with pytest.raises(EngineError, match="samples_ns must hold 3"):
        bench.parse_bench_json(json.dumps([rec]), w, g, s, 3, "abc")
    with pytest.raises(EngineError, match="exactly one test record"):
        bench.parse_bench_json(json.dumps([rec, rec]), w, g, s, 2, "abc")


def test_a_model_that_does_not_load_is_a_clear_error(prepared, tmp_path):
    engine, target, p = prepared
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(Path(target.model_path).read_bytes()[:4096])  # truncated
    bad = Prepared(identity=p.identity, handle=LlamaCppHandle(
        build=p.handle.build, target=tiny_target(broken), settings=p.handle.settings, runs_dir=tmp_path / "runs",
        n_vocab=None))
    with pytest.raises(EngineError, match="llama-bench could not load model .*broken.gguf") as exc:
        engine.timed(bad, Workload(phase="decode", depth=0, n_tokens=4, prompt_ids=()), 1)
    log = Path(str(exc.value).split("log: ")[1].split("\n")[0])
    assert log.is_file() and "failed to load model" in log.read_text()  # kept on failure
    with pytest.raises(EngineError, match="logits dumper could not load model .*broken.gguf"):
        engine.logits(bad, LogitsRequest(token_ids=(1, 2), positions=(1,), geometry=target.geometry))
    assert not isinstance(exc.value, TransientError)


def test_prepare_refuses_a_missing_model(prepared, tmp_path):
    engine, _target, _p = prepared
    from llamacpp_fixtures import test_cache_dir

    with pytest.raises(InputError, match="model file\\(s\\) not found"):
        engine.prepare(tiny_target(tmp_path / "absent.gguf"), test_cache_dir())


def test_prebuild_needs_no_model_and_gives_the_build_prepare_uses(prepared, tmp_path):
    engine, _target, p = prepared
    from llamacpp_fixtures import test_cache_dir

    b = engine.prebuild(tiny_target(tmp_path / "absent.gguf"), test_cache_dir())  # prepare refuses this target
    assert b.root == p.handle.build.root and b.rebuilt == ""  # the same keyed build, found and re-hashed
    assert b.tool(build.DUMPER).is_file()


def test_binaries_changed_after_prepare_are_refused_before_use(prepared, tmp_path):
    engine, target, p = prepared
    b = p.handle.build
    copy_root = tmp_path / "copy"
    shutil.copytree(b.bin_dir, copy_root / "build" / "bin", symlinks=True)
    copied = build.Build(root=copy_root, manifest=b.manifest)
    (copied.bin_dir / "llama-bench").write_bytes(b"#!/bin/sh\necho '[]'\n")
    h = LlamaCppHandle(build=copied, target=target, settings=p.handle.settings, runs_dir=tmp_path / "runs")
    with pytest.raises(EngineError, match="changed since prepare: llama-bench: sha256"):
        engine.timed(Prepared(identity=p.identity, handle=h), Workload("decode", 0, 4, ()), 1)


def test_a_failing_llama_bench_is_a_clear_error(prepared, tmp_path):
    _engine, target, p = prepared
    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\necho 'llama_bench: error: something broke' >&2\nexit 3\n")
    fake.chmod(0o755)
    w = Workload(phase="decode", depth=0, n_tokens=4, prompt_ids=())
    with pytest.raises(EngineError, match=r"(?s)llama-bench failed \(exit 3\); log: .*something broke"):
        bench.run_bench(fake, Path(target.model_path), w, target.geometry, p.handle.settings, 1, "x",
                        tmp_path / "bench.log")
    assert "something broke" in (tmp_path / "bench.log").read_text()


def test_logits_file_reader_checks_shape_and_vocab(prepared, tmp_path):
    _engine, target, p = prepared
    h = p.handle
    req = LogitsRequest(token_ids=_tokens(70, h.n_vocab), positions=(3, 69), geometry=target.geometry)
    out = logits.run_dumper(h.tool(build.DUMPER), Path(target.model_path), req, h.settings, tmp_path / "l.log")
    assert out.header["n_vocab"] == h.n_vocab == logits.gguf_vocab_size(Path(target.model_path))
    with pytest.raises(EngineError, match=f"vocab {h.n_vocab} != the model's {h.n_vocab + 1}"):
        logits.run_dumper(h.tool(build.DUMPER), Path(target.model_path), req, h.settings, tmp_path / "l.log",
                          n_vocab=h.n_vocab + 1)
    f = tmp_path / "x.bin"
    raw = bytearray(logits.HEADER.itemsize)
    raw[:8] = b"NOTLOGIT"
    f.write_bytes(bytes(raw))
    with pytest.raises(EngineError, match="not a version-1 logits file"):
        logits.read_logits_file(f)
