"""llamacpp builds: toolchain refusals, build keys, failures that mark nothing good, the hash check of a cached
build (cache hit, tamper -> rebuild), and the one real build of the pinned sdist shared by all llamacpp tests."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from llamacpp_fixtures import (
    BareRemote,
    pinned_sdist_reference,
    prepared_reference,
    test_cache_dir,
)

from engines.llamacpp import build, source
from engines.llamacpp.engine import prepare_build
from scoreboard.errors import EngineError, InputError
from scoreboard.lockfile import GitReference, SdistReference

PR = "refs/pull/48/head"
REPO = Path(__file__).resolve().parent.parent


def _git_source(tmp_path: Path, files: dict[str, str]) -> GitReference:
    r = BareRemote(tmp_path / "git")
    base = r.commit({"README": "base\n"}, "base")
    head = r.commit(files, "head", parent=base)
    r.push(head, PR)
    return GitReference(kind="git", repo=r.url, ref=PR, commit=head, base_commit=base,
                        cmake_flags=("-DCMAKE_BUILD_TYPE=Release",))


# ----------------------------------------------------------------------------------------------
# toolchain and plan (no build)

def test_missing_cmake_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory
    monkeypatch.delenv("CMAKE", raising=False)
    with pytest.raises(EngineError, match="step 'toolchain': cmake not found") as exc:
        build.detect_toolchain()
    assert "install CMake" in exc.value.hint


def test_missing_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(EngineError, match=r"step 'toolchain': no C\+\+ compiler found"):
        build.detect_toolchain()


def test_cuda_without_a_gpu_is_refused(monkeypatch, tmp_path):
    if shutil.which("nvidia-smi"):
        pytest.skip("this box has nvidia-smi")
    fake_nvcc = tmp_path / "nvcc"
    fake_nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.0'\n")
    fake_nvcc.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    _, ref = pinned_sdist_reference()
    with pytest.raises(EngineError, match="the target runs on cuda but nvidia-smi was not found"):
        build.plan_build(ref, "cuda")


def test_engine_owned_flags_in_the_pin_are_refused():
    _, ref = pinned_sdist_reference()
    bad = ref.model_copy(update={"cmake_flags": ("-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF")})
    with pytest.raises(InputError, match=r"references.x.cmake_flags\[1\]: '-DBUILD_SHARED_LIBS=OFF' is set by"):
        build.plan_build(bad, "cpu", "x")


def test_build_key_follows_every_input():
    _, ref = pinned_sdist_reference()
    plan = build.plan_build(ref, "cpu", "x")
    assert plan.key() == build.plan_build(ref, "cpu", "x").key()  # deterministic
    assert f"-DLLAMA_BUILD_COMMIT={source.build_stamp(ref)}" in plan.cmake_flags
    assert "-DBUILD_SHARED_LIBS=ON" in plan.cmake_flags and "-DGGML_NATIVE=ON" in plan.cmake_flags
    other_flags = build.plan_build(ref.model_copy(update={"cmake_flags": ("-DGGML_NATIVE=OFF",)}), "cpu", "x")
    other_src = build.plan_build(SdistReference(**{**ref.model_dump(), "sha256": "1" * 64}), "cpu", "x")
    import dataclasses
    other_cc = dataclasses.replace(plan, toolchain=dataclasses.replace(plan.toolchain, compiler="gcc 99"))
    other_cpu = dataclasses.replace(plan, cpu={**plan.cpu, "flags_sha256": "0" * 64})
    keys = {p.key() for p in (plan, other_flags, other_src, other_cc, other_cpu)}
    assert len(keys) == 5


# ----------------------------------------------------------------------------------------------
# location independence: the root's prefix map is a configure flag, never part of the key

def test_the_key_is_the_same_at_two_roots_and_the_configure_flags_map_each_root(tmp_path):
    _, ref = pinned_sdist_reference()
    plan = build.plan_build(ref, "cpu", "x")
    roots = [build.build_root(tmp_path / name, plan) for name in ("a", "b")]
    assert roots[0].name == roots[1].name == plan.key()  # one key: nothing of the root is in it
    assert "prefix-map" not in json.dumps(plan.key_inputs()) and str(tmp_path) not in json.dumps(plan.key_inputs())
    for root in roots:
        flags = build.configure_flags(plan, root)
        want = f"-ffile-prefix-map={root}={build.LOCATION_PREFIX}"
        assert flags == [*plan.cmake_flags, f"-DCMAKE_C_FLAGS={want}", f"-DCMAKE_CXX_FLAGS={want}"]
        cmd = build.dumper_command(plan, root, root / "build" / "bin" / "out")
        assert want in cmd and f"-ffile-prefix-map={build.DUMPER_SOURCE.parent}={build.DUMPER_PREFIX}" in cmd
        assert cmd[-1] == "-Wl,-rpath,$ORIGIN" and not [c for c in cmd if "rpath" in c and str(root) in c]
    assert build.configure_flags(plan, roots[0]) != build.configure_flags(plan, roots[1])


def test_a_pinned_compiler_flag_string_gets_the_map_appended(tmp_path):
    _, ref = pinned_sdist_reference()
    pinned = ref.model_copy(update={"cmake_flags": ("-DCMAKE_BUILD_TYPE=Release", "-DCMAKE_C_FLAGS:STRING=-O1 -g",
                                                    "-DCMAKE_CXX_FLAGS=")})
    plan = build.plan_build(pinned, "cpu", "x")
    root = build.build_root(tmp_path, plan)
    want = f"-ffile-prefix-map={root}={build.LOCATION_PREFIX}"
    flags = build.configure_flags(plan, root)
    assert flags[:3] == ["-DCMAKE_BUILD_TYPE=Release", f"-DCMAKE_C_FLAGS:STRING=-O1 -g {want}",
                         f"-DCMAKE_CXX_FLAGS={want}"]
    assert [f for f in flags if "CMAKE_C_FLAGS" in f or "CMAKE_CXX_FLAGS" in f] == flags[1:3]  # merged, not added


def test_a_symlinked_root_maps_both_spellings(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    maps = build.prefix_maps(tmp_path / "link" / "k", "/x")
    assert maps == [f"-ffile-prefix-map={tmp_path / 'link' / 'k'}=/x",
                    f"-ffile-prefix-map={tmp_path / 'real' / 'k'}=/x"]


@pytest.mark.parametrize("name", ["with space", "a=b", "quo'te", "dollar$x"])
def test_a_root_the_map_cannot_carry_is_refused_before_anything_is_wiped(tmp_path, name):
    _, ref = pinned_sdist_reference()
    plan = build.plan_build(ref, "cpu", "x")
    root = build.build_root(tmp_path / name, plan)
    (root / "build" / "bin").mkdir(parents=True)
    (root / "build" / "bin" / "keep").write_text("x")
    with pytest.raises(EngineError, match="cannot carry to the compiler") as exc:
        build.full_build(plan, root, tmp_path / name)
    assert "SCOREBOARD_CACHE" in exc.value.hint
    assert (root / "build" / "bin" / "keep").read_text() == "x"
    # the dumper runs without a shell: only '=' stops its map
    if name != "a=b":
        assert build.prefix_maps(root, "/x", through_cmake=False) == [f"-ffile-prefix-map={root}=/x"]


LOCATED = {
    "CMakeLists.txt": "cmake_minimum_required(VERSION 3.14)\nproject(located C CXX)\n"
                      "include(CheckCCompilerFlag)\ncheck_c_compiler_flag(-Wall HAVE_WALL)\n"  # a try_compile
                      'configure_file(gen.h.in "${CMAKE_BINARY_DIR}/gen.h")\n'
                      "add_library(located SHARED a.c b.cpp)\n"
                      'target_include_directories(located PRIVATE "${CMAKE_BINARY_DIR}")\n',
    "gen.h.in": "static const char *gen_file(void) { return __FILE__; }\n",
    "a.c": '#include "gen.h"\nconst char *a_file(void) { return __FILE__; }\n'
           "const char *a_gen(void) { return gen_file(); }\n",
    "b.cpp": 'extern "C" const char *b_file() { return __builtin_FILE(); }\n',
}


def _build_located(plan: build.BuildPlan, root: Path) -> bytes:
    for name, text in LOCATED.items():
        (root / "src" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "src" / name).write_text(text)
    tc = plan.toolchain
    cmds = [[tc.cmake, "-S", str(root / "src"), "-B", str(root / "build"), "-G", tc.generator,
             *build.configure_flags(plan, root)], [tc.cmake, "--build", str(root / "build")]]
    for cmd in cmds:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
    return (root / "build" / "liblocated.so").read_bytes()


def test_a_cmake_library_built_at_two_roots_with_the_configure_flags_is_byte_identical(tmp_path, monkeypatch):
    """The engine's configure flags through a real CMake (compiler checks, a try_compile, a generated header in
    build/): the same bytes at two roots, no root in them. Seconds, where the llama.cpp build takes minutes
    (bench/build_reproducible.py is that check)."""
    _, ref = pinned_sdist_reference()
    plan = build.plan_build(ref, "cpu", "x")
    roots = [build.build_root(tmp_path / name, plan) for name in ("cache-a", "other-cache-b")]
    libs = [_build_located(plan, root) for root in roots]
    assert libs[0] == libs[1]
    assert b"/llama.cpp/src/a.c" in libs[0] and b"/llama.cpp/build/gen.h" in libs[0]
    assert b"/llama.cpp/src/b.cpp" in libs[0] and str(tmp_path).encode() not in libs[0]
    # without the map the root is in the bytes (what format-1 builds did)
    monkeypatch.setattr(build, "location_flags", lambda plan, root: {})
    unmapped = build.build_root(tmp_path / "unmapped", plan)
    assert f"{unmapped}/src/a.c".encode() in _build_located(plan, unmapped)


def test_the_two_root_bench_refuses_one_root_and_an_unknown_reference(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_reproducible", REPO / "bench" / "build_reproducible.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main([str(tmp_path / "a"), str(tmp_path / "a")]) == 2
    assert "the two roots are the same directory" in capsys.readouterr().err
    assert bench.main([str(tmp_path / "a"), str(tmp_path / "b"), "--reference", "nope"]) == 2
    assert "no git or pypi-sdist reference 'nope'" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # refused before building anything


# ----------------------------------------------------------------------------------------------
# failures mark nothing good

def test_configure_failure_names_the_step_and_the_log(tmp_path):
    ref = _git_source(tmp_path, {"CMakeLists.txt": 'cmake_minimum_required(VERSION 3.14)\nproject(x C)\n'
                                                   'message(FATAL_ERROR "boom from the pinned source")\n'})
    plan = build.plan_build(ref, "cpu", "bad")
    with pytest.raises(EngineError) as exc:
        build.ensure_build(plan, tmp_path / "cache")
    root = build.build_root(tmp_path / "cache", plan)
    log = root / "logs" / "configure.log"
    assert "failed at step 'configure'" in str(exc.value) and str(log) in str(exc.value)
    assert "boom from the pinned source" in str(exc.value)  # the log's tail is shown
    assert "boom from the pinned source" in log.read_text()
    assert not (root / "manifest.json").exists()


def test_compile_failure_names_the_build_step(tmp_path):
    cml = ("cmake_minimum_required(VERSION 3.14)\nproject(x C)\nadd_library(llama SHARED bad.c)\n"
           + "".join(f"add_executable({t} bad.c)\n" for t in build.TOOLS))
    ref = _git_source(tmp_path, {"CMakeLists.txt": cml, "bad.c": "int main( { syntax error\n"})
    plan = build.plan_build(ref, "cpu", "bad")
    with pytest.raises(EngineError, match=r"failed at step 'build' \(exit \d+\); log: .*build\.log"):
        build.ensure_build(plan, tmp_path / "cache")
    assert not (build.build_root(tmp_path / "cache", plan) / "manifest.json").exists()


# ----------------------------------------------------------------------------------------------
# cache hit, tamper detection and rebuild, with a stand-in for the expensive full-build step

def _fake_builder(calls: list[Path]):
    def builder(plan, root, cache_dir, progress=None, pip_args=None):
        calls.append(root)
        if root.exists():
            shutil.rmtree(root)
        bin_dir = root / "build" / "bin"
        bin_dir.mkdir(parents=True)
        for name in (*build.TOOLS, build.DUMPER, "libllama.so.0.5.0"):
            (bin_dir / name).write_bytes(f"{name} built {len(calls)}".encode())
        (bin_dir / "libllama.so").symlink_to("libllama.so.0.5.0")
        return {"source": {"fake": True}, "dumper": {"source_sha256": build.sha256_file(build.DUMPER_SOURCE)}}
    return builder


def test_cache_hit_rehashes_and_tampering_triggers_a_clean_rebuild(tmp_path):
    _, ref = pinned_sdist_reference()
    plan = build.plan_build(ref, "cpu", "x")
    calls: list[Path] = []
    first = build.ensure_build(plan, tmp_path, builder=_fake_builder(calls))
    assert first.rebuilt == "full" and len(calls) == 1
    hit = build.ensure_build(plan, tmp_path, builder=_fake_builder(calls))
    assert hit.rebuilt == "" and len(calls) == 1 and hit.checks["problems"] == []
    assert hit.checks["rehashed"] == len(first.manifest["binaries"]) == 6
    assert hit.tool("llama-quantize") == first.root / "build" / "bin" / "llama-quantize"

    for tamper in (lambda b: (b / "llama-bench").write_bytes(b"evil"),
                   lambda b: (b / "libextra.so").write_bytes(b"new"),
                   lambda b: ((b / "libllama.so").unlink(), (b / "libllama.so").symlink_to("llama-bench"))):
        tamper(first.bin_dir)
        assert build.verify_binaries(first.bin_dir, first.manifest)  # detected
        again = build.ensure_build(plan, tmp_path, builder=_fake_builder(calls))
        assert again.rebuilt == "full" and calls[-1] == first.root and again.checks["problems"]
        assert build.verify_binaries(again.bin_dir, again.manifest) == []


def test_tampered_build_is_unmarked_before_the_rebuild_starts(tmp_path):
    _, ref = pinned_sdist_reference()
    plan = build.plan_build(ref, "cpu", "x")
    good = build.ensure_build(plan, tmp_path, builder=_fake_builder([]))
    (good.bin_dir / "llama-imatrix").write_bytes(b"evil")

    def failing(plan, root, cache_dir, progress=None, pip_args=None):
        assert not (root / "manifest.json").exists()  # no longer marked good while rebuilding
        raise EngineError("llama.cpp build failed at step 'build' (stand-in)")

    with pytest.raises(EngineError, match="stand-in"):
        build.ensure_build(plan, tmp_path, builder=failing)
    assert build.read_manifest(good.root) is None
    with pytest.raises(EngineError, match="has no tool"):
        good.tool("llama-server")


# ----------------------------------------------------------------------------------------------
# the real build (pinned sdist), shared with test_llamacpp_engine.py

@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return prepared_reference(tmp_path_factory.mktemp("llamacpp"))


@pytest.mark.slow
def test_real_build_records_every_binary_and_the_stamp(prepared):
    _engine, target, p = prepared
    b = p.handle.build
    m = b.manifest
    assert m["build_commit"] == source.build_stamp(target.reference)
    assert f"-DLLAMA_BUILD_COMMIT={m['build_commit']}" in m["cmake_flags"]
    for tool in (*build.TOOLS, build.DUMPER):
        assert b.tool(tool).is_file() and m["binaries"][tool] == build.sha256_file(b.tool(tool))
    assert any(name.startswith("libllama.so") for name in m["binaries"])
    assert build.verify_binaries(b.bin_dir, m) == []
    assert p.identity.binaries == m["binaries"] and p.identity.source["sha256"] == target.reference.sha256
    assert (b.root / "logs" / "build.log").is_file() and (b.root / "logs" / "configure.log").is_file()
    assert m["source"]["dropped_dot_git"] is True
    on_disk = json.loads((b.root / "manifest.json").read_text())
    assert on_disk["key"] == b.root.name == build.plan_build(target.reference, "cpu").key()


@pytest.mark.slow
def test_second_prepare_is_a_cache_hit_that_rehashes_in_seconds(prepared):
    engine, target, first = prepared
    t0 = time.monotonic()
    again = engine.prepare(target, test_cache_dir())
    elapsed = time.monotonic() - t0
    assert again.notes["cache_hit"] is True and again.notes["rebuilt"] == ""
    assert again.notes["checks"]["rehashed"] == len(first.handle.build.manifest["binaries"])
    assert elapsed < 20, f"warm prepare took {elapsed:.1f} s"
    assert again.identity == first.identity


def _copy_build(b: build.Build, cache: Path) -> Path:
    """The parts of a good build a re-verify and a dumper rebuild need, under another cache dir."""
    root = cache / "llamacpp" / "build" / b.root.name
    shutil.copytree(b.bin_dir, root / "build" / "bin", symlinks=True)
    for inc in ("include", "ggml/include"):
        shutil.copytree(b.root / "src" / inc, root / "src" / inc)
    shutil.copy2(b.root / "manifest.json", root / "manifest.json")
    return root


@pytest.mark.slow
def test_tampered_dumper_in_a_copy_is_detected_and_rebuilt_clean(prepared, tmp_path):
    _engine, target, p = prepared
    root = _copy_build(p.handle.build, tmp_path)
    dumper = root / "build" / "bin" / build.DUMPER
    dumper.write_bytes(dumper.read_bytes() + b"\0tampered")
    tampered = build.sha256_file(dumper)
    plan = build.plan_build(target.reference, "cpu")
    assert build.verify_binaries(root / "build" / "bin", build.read_manifest(root)) == [
        f"{build.DUMPER}: sha256 {build.sha256_file(dumper)} != recorded {p.handle.build.binaries[build.DUMPER]}"]
    rebuilt = build.ensure_build(plan, tmp_path, builder=lambda *a, **k: pytest.fail("full rebuild not expected"))
    assert rebuilt.rebuilt == "dumper" and rebuilt.root == root
    assert build.sha256_file(dumper) == rebuilt.binaries[build.DUMPER] != tampered
    # rebuilt at another cache root, the dumper is the original's bytes (location-independent: KEY_FORMAT 2)
    assert rebuilt.binaries == p.handle.build.binaries
    assert build.verify_binaries(rebuilt.bin_dir, rebuilt.manifest) == []


@pytest.mark.slow
def test_tampered_library_in_a_copy_forces_a_full_rebuild(prepared, tmp_path):
    _engine, target, p = prepared
    root = _copy_build(p.handle.build, tmp_path)
    lib = next(f for f in sorted((root / "build" / "bin").iterdir())
               if f.name.startswith("libllama.so.") and not f.is_symlink())
    lib.write_bytes(lib.read_bytes()[:-1] + b"\x01")
    plan = build.plan_build(target.reference, "cpu")
    seen: list[Path] = []

    def builder(plan, root, cache_dir, progress=None, pip_args=None):
        seen.append(root)
        assert build.read_manifest(root) is None
        raise EngineError("stand-in: the full rebuild would run here")

    with pytest.raises(EngineError, match="stand-in"):
        build.ensure_build(plan, tmp_path, builder=builder)
    assert seen == [root] and not (root / "manifest.json").exists()


@pytest.mark.slow
def test_prepare_build_gives_the_tools_without_a_model(prepared):
    _, target, p = prepared
    b = prepare_build(target.reference, test_cache_dir(), "cpu", target.options["reference_id"])
    assert b.rebuilt == "" and b.root == p.handle.build.root
    for name in ("llama-quantize", "llama-imatrix", "llama-gguf-split", "llama-bench", build.DUMPER):
        path = b.tool(name)
        assert path.parent == b.bin_dir and os.access(path, os.X_OK)
