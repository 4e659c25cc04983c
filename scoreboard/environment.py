"""Environment fingerprint: what box a number came from. Best effort, never raises, no torch import."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from .lockfile import NodeClass

PACKAGES = ("scoreboard", "numpy", "scipy", "torch", "gguf", "pydantic", "huggingface_hub", "gitpython")
_KEY_CPU_FLAGS = ("avx", "avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "fma", "f16c",
                  "sse4_2", "asimd", "sve")


def _run(cmd: list[str], timeout: float = 10.0, cwd: str | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _cpu() -> dict[str, Any]:
    info: dict[str, Any] = {"arch": platform.machine(), "cores": os.cpu_count() or 0, "model": "", "flags": []}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model") and not info["model"]:
            info["model"] = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    info["flags"] = sorted(f for f in _KEY_CPU_FLAGS if f in flags)
    info["flags_sha256"] = hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:16]
    return info


def ram_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / (1 << 20), 2)
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


def gpus() -> dict[str, Any]:
    """GPUs via nvidia-smi: observed (current) clocks, not the card's maximum: the receipt records what was measured."""
    if shutil.which("nvidia-smi") is None:
        return {"count": 0, "devices": []}
    q = "name,memory.total,driver_version,clocks.sm,clocks.mem,clocks.max.sm,power.limit,compute_cap,pci.bus_id"
    out = _run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader,nounits"])
    if out is None:
        return {"count": 0, "devices": [], "error": "nvidia-smi failed"}
    devices = []
    for line in out.splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) < 9:
            continue
        devices.append({"name": f[0], "memory_mib": _num(f[1]), "driver": f[2], "clock_sm_mhz": _num(f[3]),
                        "clock_mem_mhz": _num(f[4]), "clock_sm_max_mhz": _num(f[5]), "power_limit_w": _num(f[6]),
                        "compute_cap": f[7], "bus_id": f[8]})
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() != "":
        idx = [int(x) for x in visible.split(",") if x.strip().isdigit()]
        devices = [d for i, d in enumerate(devices) if i in idx]  # nvidia-smi ignores CUDA_VISIBLE_DEVICES
    cuda = None
    smi = _run(["nvidia-smi"])
    if smi and "CUDA Version:" in smi:
        cuda = smi.split("CUDA Version:")[1].split()[0]
    return {"count": len(devices), "devices": devices, "cuda": cuda}


def _num(s: str) -> float | None:
    try:
        return float(s)
    except ValueError:
        return None


def _packages() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


HARNESS_CODE = ("scoreboard", "pyproject.toml")  # what measures; the lock and rounds/ are its records


def _harness_git(root: Path) -> dict[str, Any]:
    """The harness's commit, and whether its code (HARNESS_CODE) has uncommitted changes."""
    commit = _run(["git", "rev-parse", "HEAD"], cwd=str(root))
    if commit is None:
        return {"commit": "", "dirty": None}
    status = _run(["git", "status", "--porcelain", "--untracked-files=no", "--", *HARNESS_CODE], cwd=str(root))
    return {"commit": commit, "dirty": bool(status)}


def fingerprint(root: Path | None = None) -> dict[str, Any]:
    """Collect the environment fingerprint. Never raises: missing parts are empty/None."""
    root = root or Path(__file__).resolve().parent.parent
    fp: dict[str, Any] = {}
    for key, fn in (("cpu", _cpu), ("ram_gib", ram_gib), ("gpu", gpus), ("packages", _packages),
                    ("harness", lambda: _harness_git(root))):
        try:
            fp[key] = fn()
        except Exception as exc:  # best effort by contract
            fp[key] = {"error": f"{type(exc).__name__}: {exc}"}
    fp["kernel"] = platform.release()
    fp["os"] = platform.system()
    fp["python"] = platform.python_version()
    return fp


def node_mismatches(fp: dict[str, Any], node: NodeClass) -> list[str]:
    """Fields where this box differs from the node class, each naming field, wanted and found."""
    problems: list[str] = []
    cpu = fp.get("cpu", {}) if isinstance(fp.get("cpu"), dict) else {}
    gpu = fp.get("gpu", {}) if isinstance(fp.get("gpu"), dict) else {}
    if node.cpu_arch and cpu.get("arch") != node.cpu_arch:
        problems.append(f"cpu.arch: node class wants {node.cpu_arch!r}, this box has {cpu.get('arch')!r}")
    if (cpu.get("cores") or 0) < node.min_cpu_cores:
        problems.append(f"cpu.cores: node class wants >= {node.min_cpu_cores}, this box has {cpu.get('cores')}")
    if node.gpu_count:
        count = gpu.get("count", 0)
        if count != node.gpu_count:
            problems.append(f"gpu.count: node class wants {node.gpu_count}, this box has {count}")
        names = {d.get("name", "") for d in gpu.get("devices", [])}
        if node.gpu_model and not all(node.gpu_model in n for n in names or {""}):
            problems.append(f"gpu.model: node class wants {node.gpu_model!r}, this box has {sorted(names)}")
    return problems


def comparable(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Fields that make two fingerprints incomparable (different node class), naming each field."""
    diffs = []
    pairs = [("cpu.model", a.get("cpu", {}).get("model"), b.get("cpu", {}).get("model")),
             ("cpu.arch", a.get("cpu", {}).get("arch"), b.get("cpu", {}).get("arch")),
             ("cpu.cores", a.get("cpu", {}).get("cores"), b.get("cpu", {}).get("cores")),
             ("gpu.count", a.get("gpu", {}).get("count"), b.get("gpu", {}).get("count")),
             ("gpu.models", sorted({d.get("name") for d in a.get("gpu", {}).get("devices", [])}),
              sorted({d.get("name") for d in b.get("gpu", {}).get("devices", [])}))]
    for name, x, y in pairs:
        if x != y:
            diffs.append(f"{name}: {x!r} != {y!r}")
    return diffs
