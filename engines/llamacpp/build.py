"""Clean, cache-keyed llama.cpp builds: one directory per (source, flags, toolchain, CPU/GPU arch), hashes re-checked.

Layout (under ``<cache>/llamacpp/build/<key>/``)::

    src/            a fresh copy of the pinned source, materialized for this build only
    build/          the CMake binary dir; build/bin holds every binary and shared library
    logs/           configure.log, build.log, dumper.log (kept; their tail is shown on failure)
    manifest.json   written last, atomically, after a successful build and hash: the "good" marker

Manifest format history (``format``): 1 — this version.

A build is "good" only while ``manifest.json`` exists and every file under ``build/bin`` (recursively: the
loader searches its subdirectories) re-hashes to the recorded sha256 (a candidate running as root could tamper
with a persisted reference). The manifest sits in the same writable cache, so it is not the anchor of trust: the
round compares the fresh hashes with the ones its sealed history recorded for the same build key
(scoreboard.round.evidence). Anything else is
rebuilt clean: the whole tree, or only the logits dumper when that is the one binary that differs (the
dumper is a single translation unit compiled straight to its binary, so its rebuild is clean too).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from scoreboard.engine import GitReference, SdistReference, atomic_write_text, compare_scans
from scoreboard.errors import EngineError, InputError

from . import source

Progress = Callable[[str, "float | None"], None]

MANIFEST_FORMAT = 1
# Bump to invalidate every cached build. 2: the compilers and the dumper build map the build root to
# LOCATION_PREFIX (configure_flags, build_dumper). Format-1 builds embedded the absolute path of their cache
# directory, so two builds of one key at two cache roots were different builds: __FILE__ strings in every library
# and tool (GGML_ASSERT/GGML_ABORT messages, e.g. "<cache>/llamacpp/build/<key>/src/ggml/src/ggml.c"; 9 under
# libggml-base, 155 under libllama) and the dumper's RUNPATH. A round on a new cache root aborted at preflight
# because every file differed from the anchor. The bump keeps such an entry from being reused (or anchored
# against) as though it had been built with the maps. (A CUDA build keeps one root-dependent part: location_flags.)
KEY_FORMAT = 2
DEFAULT_CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF",
                       "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF")
TARGETS = ("llama", "llama-bench", "llama-quantize", "llama-gguf-split", "llama-imatrix")
TOOLS = ("llama-bench", "llama-quantize", "llama-gguf-split", "llama-imatrix")
DUMPER = "scoreboard-dump-logits"
DUMPER_SOURCE = Path(__file__).with_name("cpp") / "dump_logits.cpp"
DUMPER_FLAGS = ("-O2", "-std=c++17", "-Wall")
# nvcc's host-side intermediate is a pid-named temporary (tmpxft_<pid>_00000000-6_<name>.cudafe1.cpp) and g++
# records its name in the object's symbol table (the STT_FILE entry; _GLOBAL__sub_I_<name> where the file has a
# static initializer), so each clean CUDA build gave a different libggml-cuda.so. --objdir-as-tempdir names the
# intermediates after the object file instead. Measured with nvcc 13.0.88 and g++ 12.2 on ggml-cuda's arange.cu,
# clamp.cu and argsort.cu (sm_90, ggml's CMake flags): two from-scratch builds in the same directory gave
# different objects without it and byte-identical objects with it (bench/nvcc-reproducibility.md).
# CMAKE_CUDA_FLAGS reaches every .cu compile of every target (and, set here, replaces $CUDAFLAGS from the caller).
CUDA_FLAGS = ("--objdir-as-tempdir",)
# Where the build root appears in the built files, in place of its real path (<cache>/llamacpp/build/<key>):
# src/ and build/ become /llama.cpp/src and /llama.cpp/build in every __FILE__ and (were there any) debug path.
LOCATION_PREFIX = "/llama.cpp"
# The same for the directory of the dumper's source (it is wherever the harness is installed).
DUMPER_PREFIX = "/scoreboard/cpp"
_ENGINE_SET = ("LLAMA_BUILD_COMMIT", "LLAMA_BUILD_NUMBER", "BUILD_SHARED_LIBS", "CMAKE_BUILD_RPATH_USE_ORIGIN", "CMAKE_C_COMPILER",
               "CMAKE_CXX_COMPILER", "CMAKE_CUDA_COMPILER", "CMAKE_CUDA_ARCHITECTURES", "CMAKE_CUDA_FLAGS", "GGML_CUDA")
_NINJA_STATUS = re.compile(r"^\[(\d+)/(\d+)\]")
_MAKE_STATUS = re.compile(r"^\[\s*(\d+)%\]")


# ----------------------------------------------------------------------------------------------
# toolchain and plan

@dataclass(frozen=True)
class Toolchain:
    """Resolved tools and their versions; all of it is part of the build key."""

    cmake: str
    cmake_version: str
    generator: str  # "Ninja" or "Unix Makefiles"
    cc: str
    cxx: str
    compiler: str  # first line of `c++ --version`
    nvcc: str = ""
    nvcc_version: str = ""

    def as_dict(self) -> dict[str, str]:
        return dict(self.__dict__)


def _version_line(exe: str, step: str) -> str:
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EngineError(f"llama.cpp build step {step!r}: cannot run {exe} --version: {exc}",
                          "install the tool or fix PATH, then run prepare again") from None
    lines = [ln.strip() for ln in (out.stdout or out.stderr).splitlines() if ln.strip()]
    if out.returncode != 0 or not lines:
        raise EngineError(f"llama.cpp build step {step!r}: {exe} --version failed (exit {out.returncode})",
                          "install a working toolchain, then run prepare again")
    return lines[0]


def _which(env: str, *names: str) -> str | None:
    want = os.environ.get(env)
    candidates = [want] if want else list(names)
    for name in candidates:
        found = shutil.which(name)
        if found:
            return os.path.realpath(found)
    return None


def find_nvcc() -> str | None:
    found = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.access(p, os.X_OK)), None)
    return os.path.realpath(found) if found else None


def detect_toolchain(device: str = "cpu") -> Toolchain:
    """Resolve cmake, the C/C++ compilers (env CC/CXX first) and, for CUDA, nvcc; refuse loudly if one is missing."""
    cmake = _which("CMAKE", "cmake")
    if not cmake:
        raise EngineError("llama.cpp build step 'toolchain': cmake not found on PATH",
                          "install CMake >= 3.14 (`apt-get install cmake` or `pip install cmake`), "
                          "then run prepare again")
    cxx = _which("CXX", "c++", "g++", "clang++")
    if not cxx:
        raise EngineError("llama.cpp build step 'toolchain': no C++ compiler found ($CXX, c++, g++, clang++)",
                          "install one (`apt-get install g++`) or set CXX, then run prepare again")
    cc = _which("CC", "cc", "gcc", "clang")
    if not cc:
        raise EngineError("llama.cpp build step 'toolchain': no C compiler found ($CC, cc, gcc, clang)",
                          "install one (`apt-get install gcc`) or set CC, then run prepare again")
    cmake_version = _version_line(cmake, "toolchain").split()[-1]
    generator = "Ninja" if shutil.which("ninja") else "Unix Makefiles"
    nvcc = nvcc_version = ""
    if device == "cuda":
        nvcc = find_nvcc() or ""
        if not nvcc:
            raise EngineError("llama.cpp build step 'toolchain': the target runs on cuda but nvcc was not found",
                              "install the CUDA toolkit (nvcc on PATH or /usr/local/cuda/bin), then run prepare again")
        nvcc_version = _nvcc_release(nvcc)
    return Toolchain(cmake=cmake, cmake_version=cmake_version, generator=generator, cc=cc, cxx=cxx,
                     compiler=_version_line(cxx, "toolchain"), nvcc=nvcc, nvcc_version=nvcc_version)


def _nvcc_release(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
    found = re.findall(r"release [^\n]*", out)
    return found[-1].strip() if found else out.strip().splitlines()[-1] if out.strip() else "unknown"


def cuda_architectures() -> str:
    """`CMAKE_CUDA_ARCHITECTURES` from the devices present (compute_cap 9.0 -> "90"); refuses without a GPU."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        raise EngineError("llama.cpp build step 'toolchain': the target runs on cuda but nvidia-smi was not found",
                          "run on a machine with an NVIDIA GPU and driver, or use a cpu target")
    out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
                         capture_output=True, text=True, check=False)
    caps = sorted({ln.strip().replace(".", "") for ln in out.stdout.splitlines() if ln.strip()})
    if out.returncode != 0 or not caps or not all(c.isdigit() for c in caps):
        raise EngineError(f"llama.cpp build step 'toolchain': no CUDA device found (nvidia-smi exit {out.returncode}: "
                          f"{(out.stdout + out.stderr).strip()[:200]})", "check the driver with `nvidia-smi`")
    return ";".join(caps)


def cpu_fingerprint() -> dict[str, str]:
    """What GGML_NATIVE compiles for: machine, CPU model and the sha256 of its feature flags."""
    model, flags = "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = val.strip()
            elif key in ("flags", "Features") and not flags:
                flags = " ".join(sorted(val.split()))
    except OSError:
        pass
    return {"machine": platform.machine(), "model": model or platform.processor(),
            "flags_sha256": hashlib.sha256(flags.encode()).hexdigest()}


@dataclass(frozen=True)
class BuildPlan:
    """Everything a build depends on. `key()` names its cache directory."""

    reference: GitReference | SdistReference
    ref_id: str
    device: str
    toolchain: Toolchain
    cmake_flags: tuple[str, ...]  # the full configure flag list, pinned + engine-derived
    targets: tuple[str, ...]
    cpu: dict[str, str]
    cuda_arch: str = ""
    build_commit: str = ""
    # the transport of the source (source.ReferenceSource spec; "" = $SCOREBOARD_REFERENCE_SOURCE, else the pin's
    # own): not part of the key, because every transport must deliver the same verified tree
    source_spec: str = ""

    def key_inputs(self) -> dict[str, Any]:
        return {"key_format": KEY_FORMAT, "source": self.reference.identity(), "device": self.device,
                "cmake_flags": list(self.cmake_flags), "targets": list(self.targets),
                "toolchain": self.toolchain.as_dict(), "cpu": self.cpu, "cuda_arch": self.cuda_arch}

    def key(self) -> str:
        blob = json.dumps(self.key_inputs(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:24]


def pinned_flags(reference: GitReference | SdistReference, ref_id: str) -> tuple[str, ...]:
    """The reference's cmake_flags (or the defaults); flags the engine sets itself are refused."""
    flags = tuple(reference.cmake_flags) or DEFAULT_CMAKE_FLAGS
    for i, flag in enumerate(flags):
        name = flag[2:].split("=", 1)[0].split(":", 1)[0] if flag.startswith("-D") else ""
        if name in _ENGINE_SET:
            raise InputError(f"references.{ref_id}.cmake_flags[{i}]: {flag!r} is set by the llamacpp engine "
                             f"(build stamp, shared libs, compilers, CUDA)", "remove it from reference.lock")
        if not flag.startswith("-D"):
            raise InputError(f"references.{ref_id}.cmake_flags[{i}]: {flag!r} is not a -DNAME=VALUE cache entry",
                             "only -D flags are part of a pin")
    return flags


def plan_build(reference: GitReference | SdistReference, device: str = "cpu", ref_id: str = "<id>") -> BuildPlan:
    """Resolve the toolchain and the full flag list for `reference` on `device` (cheap: no build, no network)."""
    if device not in ("cpu", "cuda"):
        raise InputError(f"device must be 'cpu' or 'cuda', not {device!r}")
    tc = detect_toolchain(device)
    stamp = source.build_stamp(reference)
    flags = list(pinned_flags(reference, ref_id))
    flags += [f"-DLLAMA_BUILD_COMMIT={stamp}", "-DLLAMA_BUILD_NUMBER=0", "-DBUILD_SHARED_LIBS=ON",
              "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",  # relocatable: binaries find libllama via $ORIGIN
              f"-DCMAKE_C_COMPILER={tc.cc}", f"-DCMAKE_CXX_COMPILER={tc.cxx}"]
    arch = ""
    if device == "cuda":
        arch = cuda_architectures()
        flags += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={arch}", f"-DCMAKE_CUDA_COMPILER={tc.nvcc}",
                  f"-DCMAKE_CUDA_FLAGS={' '.join(CUDA_FLAGS)}"]
    return BuildPlan(reference=reference, ref_id=ref_id, device=device, toolchain=tc, cmake_flags=tuple(flags),
                     targets=TARGETS, cpu=cpu_fingerprint(), cuda_arch=arch, build_commit=stamp)


# ----------------------------------------------------------------------------------------------
# location independence: flags that depend on where the build lies (added at configure time, never keyed)

# Characters a path may have to be mapped: the flag travels inside CMake's flag strings (CMAKE_C_FLAGS and the
# like), which CMake re-splits at whitespace and which reach a shell unquoted, so only characters that need no
# quoting pass; '=' is out because the compilers split OLD=NEW at the first '='.
_MAPPABLE = re.compile(r"[A-Za-z0-9_@%+:,./-]+")


def prefix_maps(path: Path, to: str, through_cmake: bool = True) -> list[str]:
    """``-ffile-prefix-map=OLD=to`` for `path` made absolute and, where a symlink is on the way, its real path too.

    The map rewrites every path the compiler writes into an object (``__FILE__`` and ``__builtin_FILE``, and
    debug info where there is any) that starts with OLD. Refuses a path it cannot pass through intact: through
    CMake's flag strings (`through_cmake`), or as one argument of a command run without a shell (only '=')."""
    out = []
    for old in dict.fromkeys((os.path.abspath(path), os.path.realpath(path))):
        unmappable = not _MAPPABLE.fullmatch(old) if through_cmake else "=" in old
        if unmappable:
            raise EngineError(f"llama.cpp build step 'configure': the path {old!r} has a character (whitespace, "
                              "'=', a quote, ...) that -ffile-prefix-map cannot carry to the compiler, and without "
                              "the map the built files would depend on where the build lies",
                              "set SCOREBOARD_CACHE (or the target's cache_dir) to a path of letters, digits and "
                              "_@%+:,./- only")
        out.append(f"-ffile-prefix-map={old}={to}")
    return out


def nvcc_host_flag(flag: str) -> str:
    """`flag` for nvcc's host compiler (g++ compiles the host side of every .cu, and preprocesses it first: that is
    where ``__FILE__`` is expanded). ``-Xcompiler=<list>`` is nvcc's own syntax (CMake's CUDA PIC option is
    ``-Xcompiler=-fPIC``); nvcc splits the list at commas, so a flag holding one cannot be passed."""
    if "," in flag:
        raise EngineError(f"llama.cpp build step 'configure': {flag!r} holds a comma, and nvcc splits -Xcompiler "
                          "lists at commas", "set SCOREBOARD_CACHE (or the target's cache_dir) to a path without ','")
    return f"-Xcompiler={flag}"


def _cache_entry(flag: str) -> tuple[str, str, str]:
    """(name, ":TYPE" or "", value) of a -DNAME[:TYPE]=VALUE flag; ("", "", "") for any other flag."""
    if not flag.startswith("-D") or "=" not in flag:
        return "", "", ""
    head, value = flag[2:].split("=", 1)
    name, colon, typ = head.partition(":")
    return name, colon + typ, value


def location_flags(plan: BuildPlan, root: Path) -> dict[str, str]:
    """The flag-string entries that make a build at `root` location-independent: CMake cache name -> the words to
    add. The build root (``<cache>/llamacpp/build/<key>``, holding src/ and build/) is mapped to LOCATION_PREFIX.

    Measured before the map: two builds of one key at /root/.cache/scoreboard and /tmp/trialcache differed in
    every file under build/bin, by the build root spelled out in ``__FILE__`` strings (the GGML_ASSERT and
    GGML_ABORT messages of ggml, llama, common and the tools) and the dumper's RUNPATH (dumper_command)."""
    maps = prefix_maps(root, LOCATION_PREFIX)
    host = " ".join(maps)
    out = {"CMAKE_C_FLAGS": host, "CMAKE_CXX_FLAGS": host}
    if plan.device == "cuda":
        # nvcc has no prefix map of its own; it hands -Xcompiler flags to every host-compiler run: the g++ -E
        # of the host side, the g++ -E of the device side (cicc compiles its output, so __FILE__ in device code,
        # e.g. ggml-cuda's NO_DEVICE_CODE, is expanded there) and the compile of the .cudafe1.cpp. Measured with
        # nvcc 13.0.88 and g++ 12.2: --dryrun shows the flag on all three, and a .cu with __FILE__ in host and
        # device code compiled at two roots gave objects that differ in 471 bytes without the map, identical with
        # it. NOT covered: cudafe++ derives the translation unit's module id (_<hash>_<len>_<file>_<hash>, in the
        # names of internal-linkage device symbols) from the .cu file's absolute path, which no prefix map
        # reaches. Of five ggml-cuda objects compiled through this configure at two roots, argsort.cu.o still
        # differed (320 bytes of its PTX and cubin: the module id); arange, clamp, ggml-cuda.cu and
        # mmf-instance-ncols_5 were identical. So a CUDA build is still tied to its cache root.
        out["CMAKE_CUDA_FLAGS"] = " ".join(nvcc_host_flag(m) for m in maps)
    return out


def configure_flags(plan: BuildPlan, root: Path) -> list[str]:
    """The configure flags of the build at `root`: the plan's (its key's) with location_flags merged in.

    Appended to the value where the plan sets the entry already (a pin's CMAKE_C_FLAGS, the engine's
    CMAKE_CUDA_FLAGS), else added as a new -D. These flags differ between cache roots and the built files must
    not, so they are not part of the key (BuildPlan.key_inputs). A -DCMAKE_C_FLAGS / -DCMAKE_CXX_FLAGS on the
    command line also means $CFLAGS / $CXXFLAGS no longer initialize them: they were never part of the key."""
    add = location_flags(plan, root)
    out, merged = [], set()
    for flag in plan.cmake_flags:
        name, typ, value = _cache_entry(flag)
        if name in add:  # a name set twice gets the words in both (CMake keeps the last)
            out.append(f"-D{name}{typ}={value} {add[name]}" if value else f"-D{name}{typ}={add[name]}")
            merged.add(name)
        else:
            out.append(flag)
    out += [f"-D{name}={words}" for name, words in add.items() if name not in merged]
    return out


# ----------------------------------------------------------------------------------------------
# a verified build

@dataclass(frozen=True)
class Build:
    """A good build: its directory, the manifest it was verified against, and where its binaries are."""

    root: Path
    manifest: dict[str, Any]
    rebuilt: str = ""  # "", "full" or "dumper": what this prepare had to (re)build
    checks: dict[str, Any] = field(default_factory=dict)

    @property
    def bin_dir(self) -> Path:
        return self.root / "build" / "bin"

    @property
    def binaries(self) -> dict[str, str]:
        return dict(self.manifest["binaries"])

    def tool(self, name: str) -> Path:
        """Path of a built executable, e.g. tool("llama-quantize"); only names recorded in the manifest."""
        if name not in self.manifest["binaries"] or name not in (*TOOLS, DUMPER):
            raise EngineError(f"llama.cpp build {self.root.name} has no tool {name!r}",
                              f"tools: {', '.join((*TOOLS, DUMPER))}")
        return self.bin_dir / name

    def verify(self) -> list[str]:
        """Re-hash every file under build/bin (recursively) against the manifest; return the problems (empty = good)."""
        return verify_binaries(self.bin_dir, self.manifest)


def sha256_file(path: Path) -> str:
    return source.sha256_file(path)


def _scan_bin(bin_dir: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(regular file -> sha256, symlink -> target) for every entry under bin_dir, recursively, keyed by the path
    relative to bin_dir.

    Recursively, because the dynamic loader searches subdirectories of every RUNPATH entry
    (``$ORIGIN/glibc-hwcaps/x86-64-v4/`` before ``$ORIGIN``): a library planted there is loaded by every tool.
    Anything that is neither a regular file, a symlink nor a directory is recorded as a file with the hash
    "not-a-regular-file" so that it can never match a recorded hash.
    """
    files, links = {}, {}
    for dirpath, dirnames, filenames in os.walk(bin_dir):
        here = Path(dirpath)
        for name in sorted(dirnames):
            p = here / name
            if p.is_symlink():  # os.walk does not descend into directory links: record them as links
                links[str(p.relative_to(bin_dir))] = os.readlink(p)
        for name in sorted(filenames):
            p = here / name
            rel = str(p.relative_to(bin_dir))
            if p.is_symlink():
                links[rel] = os.readlink(p)
            elif p.is_file():
                files[rel] = sha256_file(p)
            else:
                files[rel] = "not-a-regular-file"
    return dict(sorted(files.items())), dict(sorted(links.items()))


def scan_build(bin_dir: Path) -> dict[str, dict[str, str]]:
    """A fresh hash of everything under bin_dir: {"files": relpath -> sha256, "links": relpath -> target}."""
    files, links = _scan_bin(bin_dir)
    return {"files": files, "links": links}


def files_digest(scan: dict[str, dict[str, str]]) -> str:
    """One sha256 over a scan (canonical JSON): the build's file manifest in one value."""
    blob = json.dumps(scan, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def verify_binaries(bin_dir: Path, manifest: dict[str, Any]) -> list[str]:
    """Re-hash everything under bin_dir (recursively) against the manifest; return the problems."""
    if not bin_dir.is_dir():
        return [f"{bin_dir} is missing"]
    return compare_scans(scan_build(bin_dir), manifest.get("binaries", {}), manifest.get("links", {}), "the manifest")


def read_manifest(root: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((root / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        return None
    return data


def invalidate(root: Path) -> None:
    """Un-mark a build as good (the manifest goes first, before anything is touched)."""
    try:
        (root / "manifest.json").unlink()
    except FileNotFoundError:
        pass


def build_root(cache_dir: Path, plan: BuildPlan) -> Path:
    return Path(cache_dir) / "llamacpp" / "build" / plan.key()


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _say(progress: Progress | None, msg: str, frac: float | None = None) -> None:
    if progress is not None:
        progress(msg, frac)


# ----------------------------------------------------------------------------------------------
# running steps

def _tail(path: Path, n: int = 30) -> str:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def run_step(step: str, cmd: list[str], log: Path, cwd: Path | None = None, progress: Progress | None = None,
             env: dict[str, str] | None = None) -> None:
    """Run one build step, streaming its output to `log` (and build progress to `progress`); fail loudly."""
    log.parent.mkdir(parents=True, exist_ok=True)
    _say(progress, f"llama.cpp {step}: {log}")
    with open(log, "w", encoding="utf-8") as fh:
        fh.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
        fh.flush()
        try:
            proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    errors="replace", env=env)
        except OSError as exc:
            fh.write(f"\n{exc}\n")
            raise EngineError(f"llama.cpp build failed at step {step!r}: cannot run {cmd[0]}: {exc}; log: {log}",
                              "install the missing tool, then run prepare again (nothing was marked good)") from None
        last = -1.0
        assert proc.stdout is not None
        for line in proc.stdout:
            fh.write(line)
            fh.flush()  # `tail -f` on a running build
            m = _NINJA_STATUS.match(line) or _MAKE_STATUS.match(line)
            if m and progress is not None:
                frac = int(m.group(1)) / int(m.group(2)) if m.re is _NINJA_STATUS else int(m.group(1)) / 100
                if frac - last >= 0.01 or frac >= 1.0:
                    last = frac
                    progress(f"llama.cpp {step} {line.split(' ', 1)[0]}", frac)
        rc = proc.wait()
        fh.write(f"\n[exit {rc}]\n")
    if rc != 0:
        raise EngineError(f"llama.cpp build failed at step {step!r} (exit {rc}); log: {log}\n{_tail(log)}",
                          f"read {log}, fix the toolchain or the pin, then run prepare again (nothing was marked good)")


def _dumper_inputs(plan: BuildPlan) -> dict[str, Any]:
    return {"source_sha256": sha256_file(DUMPER_SOURCE), "flags": list(DUMPER_FLAGS), "compiler": plan.toolchain.cxx,
            "compiler_version": plan.toolchain.compiler}


def dumper_command(plan: BuildPlan, root: Path, out: Path) -> list[str]:
    """The dumper's compile-and-link command (no shell). Location-independent like the CMake build: the build root
    and the dumper's source directory are prefix-mapped (the headers' and the source's __FILE__), and the RUNPATH
    is ``$ORIGIN`` (the dumper lies in build/bin beside libllama). Format-1 dumpers carried their build/bin path as
    RUNPATH (``-Wl,-rpath,<cache>/llamacpp/build/<key>/build/bin``), so they differed between cache roots."""
    src, bin_dir = root / "src", root / "build" / "bin"
    return [plan.toolchain.cxx, *DUMPER_FLAGS, *prefix_maps(root, LOCATION_PREFIX),
            *prefix_maps(DUMPER_SOURCE.parent, DUMPER_PREFIX, through_cmake=False),
            f"-I{src / 'include'}", f"-I{src / 'ggml' / 'include'}", str(DUMPER_SOURCE), "-o", str(out), f"-L{bin_dir}", "-lllama", "-Wl,-rpath,$ORIGIN"]


def build_dumper(plan: BuildPlan, root: Path, progress: Progress | None = None) -> dict[str, Any]:
    """Compile the logits dumper (one TU) against the built libllama into build/bin, atomically."""
    src, bin_dir = root / "src", root / "build" / "bin"
    tmp = bin_dir / f".{DUMPER}.tmp"
    cmd = dumper_command(plan, root, tmp)
    run_step("dumper", cmd, root / "logs" / "dumper.log", progress=progress)
    os.replace(tmp, bin_dir / DUMPER)
    return dict(_dumper_inputs(plan), command=cmd, headers=_header_hashes(src))


def _header_hashes(src: Path) -> dict[str, str]:
    """sha256 of the public headers the dumper compiles against (checked before a dumper-only rebuild)."""
    return {str(p.relative_to(src)): sha256_file(p)
            for d in (src / "include", src / "ggml" / "include") if d.is_dir() for p in sorted(d.glob("*.h"))}


def _check_stamp(plan: BuildPlan, root: Path) -> None:
    info = root / "build" / "common" / "build-info.cpp"
    if info.exists() and f'"{plan.build_commit}"' not in info.read_text(encoding="utf-8", errors="replace"):
        raise EngineError(f"llama.cpp build step 'stamp': {info} does not carry LLAMA_BUILD_COMMIT={plan.build_commit}",
                          "the pinned source ignores the stamp; check references.<id>.cmake_flags")


def full_build(plan: BuildPlan, root: Path, cache_dir: Path, progress: Progress | None = None,
               pip_args: list[str] | None = None) -> dict[str, Any]:
    """Wipe `root`, materialize the pinned source, configure, build the targets and the dumper; return the manifest
    body (binaries not yet hashed)."""
    flags = configure_flags(plan, root)  # before anything is wiped: it refuses a root it cannot map
    if root.exists():
        shutil.rmtree(root)
    (root / "logs").mkdir(parents=True)
    atomic_write_text(root / "inputs.json", json.dumps(plan.key_inputs(), indent=2, sort_keys=True) + "\n")
    t0 = time.monotonic()
    info = source.materialize(plan.reference, cache_dir, root / "src", plan.ref_id, pip_args, progress,
                              plan.source_spec or None)
    t1 = time.monotonic()
    tc = plan.toolchain
    configure = [tc.cmake, "-S", str(root / "src"), "-B", str(root / "build"), "-G", tc.generator, *flags]
    run_step("configure", configure, root / "logs" / "configure.log", progress=progress)
    t2 = time.monotonic()
    jobs = str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    build = [tc.cmake, "--build", str(root / "build"), "--target", *plan.targets, "-j", jobs]
    run_step("build", build, root / "logs" / "build.log", progress=progress)
    _check_stamp(plan, root)
    t3 = time.monotonic()
    dumper = build_dumper(plan, root, progress)
    t4 = time.monotonic()
    return {"source": {**info.identity, "build_commit": info.build_commit, **info.detail},
            "configure_command": configure, "build_command": build, "dumper": dumper,
            "durations_s": {"source": round(t1 - t0, 3), "configure": round(t2 - t1, 3),
                            "build": round(t3 - t2, 3), "dumper": round(t4 - t3, 3)}}


def _write_manifest(plan: BuildPlan, root: Path, body: dict[str, Any]) -> dict[str, Any]:
    bin_dir = root / "build" / "bin"
    files, links = _scan_bin(bin_dir)
    missing = [t for t in (*TOOLS, DUMPER) if t not in files]
    if missing:
        raise EngineError(f"llama.cpp build step 'collect': {bin_dir} lacks {missing}; "
                          f"log: {root / 'logs' / 'build.log'}",
                          "the pinned source may not define these targets; check the reference")
    manifest = {"format": MANIFEST_FORMAT, "key": plan.key(), "inputs": plan.key_inputs(),
                "build_commit": plan.build_commit, "cmake_flags": list(plan.cmake_flags),
                "toolchain": plan.toolchain.as_dict(), "device": plan.device, "cuda_arch": plan.cuda_arch,
                "bin_dir": str(bin_dir), "binaries": files, "links": links,
                "built_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), **body}
    atomic_write_text(root / "manifest.json", json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


FullBuild = Callable[..., dict[str, Any]]


def ensure_build(plan: BuildPlan, cache_dir: Path, progress: Progress | None = None,
                 pip_args: list[str] | None = None, builder: FullBuild = full_build) -> Build:
    """A good build for `plan`: the cached one after re-hashing every binary, else a clean (re)build.

    `builder` is the full-build step (tests substitute it to observe that a tampered build is rebuilt).
    """
    cache_dir = Path(cache_dir)
    root = build_root(cache_dir, plan)
    with _locked(root.parent / f"{root.name}.lock"):
        manifest = read_manifest(root)
        rebuild = "full"
        checks: dict[str, Any] = {}
        if manifest is not None and manifest.get("key") == plan.key():
            _say(progress, f"verifying {len(manifest['binaries'])} binaries of llama.cpp build {root.name}")
            problems = verify_binaries(root / "build" / "bin", manifest)
            checks = {"rehashed": len(manifest["binaries"]), "problems": problems}
            stale_dumper = manifest.get("dumper", {}).get("source_sha256") != sha256_file(DUMPER_SOURCE)
            built_tree = manifest.get("source", {}).get("source_tree")
            if plan.reference.tree and built_tree is not None and built_tree != plan.reference.tree:
                # built from a tree verified against another tree pin (the lock's tree was changed): rebuild
                problems = problems + [f"source tree {built_tree} is not the pinned tree {plan.reference.tree}"]
            if not problems and not stale_dumper:
                return Build(root=root, manifest=manifest, rebuilt="", checks=checks)
            only_dumper = all(p.startswith((f"{DUMPER}:", f".{DUMPER}")) for p in problems)
            headers_ok = manifest.get("dumper", {}).get("headers") == _header_hashes(root / "src")
            rebuild = "dumper" if only_dumper and headers_ok else "full"
            why = "; ".join(problems) or "dumper source changed"
            _say(progress, f"llama.cpp build {root.name} is not good ({why}); rebuilding {rebuild}")
        invalidate(root)
        if rebuild == "dumper":
            assert manifest is not None
            body = {k: v for k, v in manifest.items() if k in ("source", "configure_command", "build_command",
                                                                "durations_s")}
            stray = root / "build" / "bin" / f".{DUMPER}.tmp"
            stray.unlink(missing_ok=True)
            body["dumper"] = build_dumper(plan, root, progress)
        else:
            body = builder(plan, root, cache_dir, progress=progress, pip_args=pip_args)
        manifest = _write_manifest(plan, root, body)
        return Build(root=root, manifest=manifest, rebuilt=rebuild, checks=checks)


def cached_build(plan: BuildPlan, cache_dir: Path) -> dict[str, Any] | None:
    """The manifest of a build marked good for `plan`, without re-hashing (for describe())."""
    manifest = read_manifest(build_root(Path(cache_dir), plan))
    return manifest if manifest is not None and manifest.get("key") == plan.key() else None
