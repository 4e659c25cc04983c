"""llamacpp CUDA builds without a GPU: the plan carries the nvcc flags that make objects reproducible, a pin cannot
override them, and (where nvcc is installed) a CMake CUDA library built twice from scratch is byte-identical."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from llamacpp_fixtures import pinned_sdist_reference

from engines.llamacpp import build
from scoreboard.errors import EngineError, InputError

FLAG = "-DCMAKE_CUDA_FLAGS=--objdir-as-tempdir"


def _fake_cuda_tools(monkeypatch, bin_dir: Path) -> None:
    """An nvcc that only reports its version and an nvidia-smi that reports one compute-capability-9.0 device."""
    bin_dir.mkdir()
    for name, out in (("nvcc", "Cuda compilation tools, release 13.0, V13.0.88"), ("nvidia-smi", "9.0")):
        tool = bin_dir / name
        tool.write_text(f"#!/bin/sh\necho '{out}'\n")
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")


def test_the_cuda_plan_carries_the_nvcc_flags_and_they_are_part_of_the_key(monkeypatch, tmp_path):
    _fake_cuda_tools(monkeypatch, tmp_path / "bin")
    _, ref = pinned_sdist_reference()
    plan = build.plan_build(ref, "cuda", "x")
    assert plan.cuda_arch == "90" and plan.toolchain.nvcc == str(tmp_path / "bin" / "nvcc")
    assert plan.cmake_flags[-4:] == ("-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90",
                                     f"-DCMAKE_CUDA_COMPILER={tmp_path / 'bin' / 'nvcc'}", FLAG)
    assert FLAG in plan.key_inputs()["cmake_flags"]
    without = dataclasses.replace(plan, cmake_flags=tuple(f for f in plan.cmake_flags if f != FLAG))
    assert without.key() != plan.key()  # a build made before the flag existed is a different build key


def test_the_cuda_configure_flags_give_the_host_compiler_each_roots_map_outside_the_key(monkeypatch, tmp_path):
    _fake_cuda_tools(monkeypatch, tmp_path / "bin")
    _, ref = pinned_sdist_reference()
    plan = build.plan_build(ref, "cuda", "x")
    roots = [build.build_root(tmp_path / name, plan) for name in ("a", "b")]
    assert roots[0].name == roots[1].name == plan.key()
    for root in roots:
        flags = build.configure_flags(plan, root)
        host = f"-ffile-prefix-map={root}={build.LOCATION_PREFIX}"
        assert flags[:-2] == [f if f != FLAG else f"{FLAG} -Xcompiler={host}" for f in plan.cmake_flags]
        assert flags[-2:] == [f"-DCMAKE_C_FLAGS={host}", f"-DCMAKE_CXX_FLAGS={host}"]
        assert [f for f in flags if f.startswith("-DCMAKE_CUDA_FLAGS")] == [f"{FLAG} -Xcompiler={host}"]
    assert FLAG in plan.cmake_flags and "prefix-map" not in str(plan.key_inputs())  # the key keeps the bare flag


def test_a_root_with_a_comma_is_refused_for_cuda_only(monkeypatch, tmp_path):
    _fake_cuda_tools(monkeypatch, tmp_path / "bin")
    _, ref = pinned_sdist_reference()
    plan = build.plan_build(ref, "cuda", "x")
    root = build.build_root(tmp_path / "a,b", plan)
    with pytest.raises(EngineError, match="nvcc splits -Xcompiler lists at commas"):
        build.configure_flags(plan, root)
    cpu = build.plan_build(ref, "cpu", "x")
    assert f"-DCMAKE_C_FLAGS=-ffile-prefix-map={root}={build.LOCATION_PREFIX}" in build.configure_flags(cpu, root)


def test_the_cpu_plan_has_no_cuda_flags():
    _, ref = pinned_sdist_reference()
    assert not [f for f in build.plan_build(ref, "cpu", "x").cmake_flags if "CUDA" in f]


@pytest.mark.parametrize("flag", ["-DCMAKE_CUDA_FLAGS=-lineinfo", "-DCMAKE_CUDA_FLAGS:STRING=-G"])
def test_a_pin_that_sets_the_cuda_flags_is_refused(flag):
    _, ref = pinned_sdist_reference()
    bad = ref.model_copy(update={"cmake_flags": ("-DGGML_NATIVE=ON", flag)})
    with pytest.raises(InputError) as exc:
        build.plan_build(bad, "cpu", "x")
    assert str(exc.value) == (f"references.x.cmake_flags[1]: {flag!r} is set by the llamacpp engine "
                              "(build stamp, shared libs, compilers, CUDA)")
    assert exc.value.hint == "remove it from reference.lock"


# ----------------------------------------------------------------------------------------------
# a real nvcc through CMake, the way the engine configures llama.cpp (no GPU needed to compile)

KERNELS = """\
#include <cstdio>
namespace {
__device__ int hits;
__global__ void bump(int * out) { out[threadIdx.x] = atomicAdd(&hits, 1); }
}
static __device__ float gain = 2.0f;
static __global__ void twice(float * x) { x[threadIdx.x] *= gain; }
static const int announced = std::printf("");  // a static initializer: g++ names it after the input file
void launch(int * o, float * f) { bump<<<1, 32>>>(o); twice<<<1, 32>>>(f); (void) announced; }
"""
PROJECT = """\
cmake_minimum_required(VERSION 3.18)
project(repro CUDA)
add_library(repro SHARED kernels.cu)
"""


def _build_library(src: Path, build_dir: Path, nvcc: str, cuda_flags: list[str]) -> bytes:
    """Configure and build the one-library project from scratch in `build_dir`; the bytes of the library."""
    shutil.rmtree(build_dir, ignore_errors=True)
    configure = ["cmake", "-S", str(src), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                 "-DCMAKE_CUDA_ARCHITECTURES=90", f"-DCMAKE_CUDA_COMPILER={nvcc}", *cuda_flags]
    for cmd in (configure, ["cmake", "--build", str(build_dir)]):
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
    return (build_dir / "librepro.so").read_bytes()


def test_a_cuda_library_rebuilt_from_scratch_is_byte_identical_with_the_engine_flags(tmp_path):
    nvcc = build.find_nvcc()
    if nvcc is None or shutil.which("cmake") is None:
        pytest.skip("needs nvcc (CUDA toolkit) and cmake; no GPU needed")
    src = tmp_path / "src"
    src.mkdir()
    (src / "kernels.cu").write_text(KERNELS)
    (src / "CMakeLists.txt").write_text(PROJECT)
    engine = [f"-DCMAKE_CUDA_FLAGS={' '.join(build.CUDA_FLAGS)}"]
    first = _build_library(src, tmp_path / "build", nvcc, engine)
    second = _build_library(src, tmp_path / "build", nvcc, engine)
    assert hashlib.sha256(first).hexdigest() == hashlib.sha256(second).hexdigest()
    assert b"kernels.cu.o.cudafe1.cpp" in first and b"tmpxft_" not in first
    # without the flag the host intermediate is a pid-named temporary, and its name is in the library
    assert b"tmpxft_" in _build_library(src, tmp_path / "build", nvcc, [])


LOCATED = """\
#include <cstdio>
__device__ void nowhere(const char * file, int line) { printf("%s:%d\\n", file, line); }
__global__ void kern(int * x) { if (!x) { nowhere(__FILE__, __LINE__); } x[threadIdx.x] = 1; }
const char * host_file() { return __FILE__; }
void launch(int * x) { kern<<<1, 32>>>(x); }
"""
# an internal-linkage device entity: cudafe++ names it after the translation unit's module id
# (_INTERNAL_<hash>_<len>_<file>_<hash>), whose first hash is of the .cu file's absolute path
INTERNAL = """\
namespace { __device__ int hits; }
__global__ void bump(int * x) { x[threadIdx.x] = atomicAdd(&hits, 1); }
void launch(int * x) { bump<<<1, 32>>>(x); }
"""


def _at_two_roots(tmp_path: Path, kernels: str, mapped: bool = True) -> tuple[Path, list[bytes]]:
    """The one-library CUDA project built at two cache roots with the engine's CUDA flags (and, if `mapped`, the
    root's prefix map from location_flags): (the second root, the two libraries)."""
    nvcc = build.find_nvcc()
    if nvcc is None or shutil.which("cmake") is None:
        pytest.skip("needs nvcc (CUDA toolkit) and cmake; no GPU needed")
    _, ref = pinned_sdist_reference()
    plan = dataclasses.replace(build.plan_build(ref, "cpu", "x"), device="cuda")
    libs = []
    for name in ("cache-a", "other-cache-b"):
        root = tmp_path / name / "llamacpp" / "build" / plan.key()
        (root / "src").mkdir(parents=True, exist_ok=True)
        (root / "src" / "kernels.cu").write_text(kernels)
        (root / "src" / "CMakeLists.txt").write_text(PROJECT)
        words = [*build.CUDA_FLAGS, *([build.location_flags(plan, root)["CMAKE_CUDA_FLAGS"]] if mapped else [])]
        libs.append(_build_library(root / "src", root / "build", nvcc, [f"-DCMAKE_CUDA_FLAGS={' '.join(words)}"]))
    return root, libs


def test_a_cuda_library_built_at_two_roots_with_the_configure_flags_is_byte_identical(tmp_path):
    """__FILE__ in host and in device code: nvcc hands -Xcompiler flags to the host compiler's preprocessing of
    both sides, so the map reaches both (measured with nvcc 13.0.88: --dryrun shows it on both g++ -E runs)."""
    _, libs = _at_two_roots(tmp_path, LOCATED)
    assert hashlib.sha256(libs[0]).hexdigest() == hashlib.sha256(libs[1]).hexdigest()
    assert str(tmp_path).encode() not in libs[0] and b"/llama.cpp/src/kernels.cu" in libs[0]
    root, unmapped = _at_two_roots(tmp_path / "unmapped", LOCATED, mapped=False)  # without the map: the root
    assert f"{root}/src/kernels.cu".encode() in unmapped[1] and unmapped[0] != unmapped[1]


@pytest.mark.xfail(strict=True, reason="known: cudafe++'s module id hashes the .cu file's absolute path, which no "
                   "-ffile-prefix-map reaches (nvcc 13.0.88); ggml-cuda's argsort.cu.o differs so between roots")
def test_a_cuda_library_with_an_internal_device_symbol_is_byte_identical_at_two_roots(tmp_path):
    _, libs = _at_two_roots(tmp_path, INTERNAL)
    assert libs[0] == libs[1]
