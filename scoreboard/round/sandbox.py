"""Candidate workers run inside bubblewrap: the candidate's code never holds the harness's pen.

Every launch of a candidate worker (one process, or torchrun and its W ranks) is wrapped in a
``bwrap`` command built from explicit binds (never the host root):

* read-only: the system dirs Python and torch need (/usr and the merged-/usr symlinks, a few files of
  /etc), the interpreter's prefix and site-packages, the harness's ``scoreboard/`` package alone at
  /sb/harness/scoreboard (not the checkout root: no lock, no rounds/, no keys, no sitecustomize.py of
  the checkout), the arm's own ``engines/`` at /sb/arm/engines, and the weight shards at their own paths;
* read-write: the launch's private scratch directory (request, result, logits, FIFOs) at its own path;
* private tmpfs: /tmp (HOME) and /sb/cache, the engine's cache_dir (the real cache is never bound);
* every namespace unshared (no network: only a loopback device, enough for gloo between ranks; a new
  pid namespace whose processes all die with it; a fresh /proc that shows only the sandbox's processes);
  uid/gid 65534 inside; a cleared environment plus an allow-list; a new session (no terminal to inject
  into); ``--die-with-parent``.

``isolation="none"`` (tests only, opted into by a RoundOptions field that no candidate can set) runs the
worker as a plain subprocess, as before; such receipts say so and move no frontier.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

from ..errors import InputError

MODES = ("bwrap", "none")
SANDBOX_UID = 65534  # nobody/nogroup
ARM = Path("/sb/arm")  # holds the arm's engines/ (read-only)
HARNESS = Path("/sb/harness")  # holds the harness's scoreboard/ (read-only)
CACHE = Path("/sb/cache")  # the engine's cache_dir inside the sandbox: a private tmpfs
HOSTNAME = "sandbox"
UNSHARED = ("user", "ipc", "pid", "net", "uts", "cgroup")

# /etc files a Python + torch process reads; none of them is the harness's (the rest of /etc is not bound)
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "nsswitch.conf", "passwd", "group", "localtime",
             "os-release", "host.conf")
# the environment a worker gets, by name (values from the round or this process); nothing else passes
PASS_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_WAIT_POLICY", "KMP_AFFINITY",
            "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NCCL_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "LANG")
HINT = ("install bubblewrap: `apt-get install bubblewrap`; on a box without a package registry carry the .deb "
        "(`apt-get download bubblewrap` elsewhere), unpack it with `dpkg -x bubblewrap_*.deb DIR` and put DIR/usr/bin "
        "on PATH (docs/isolation.md)")


@dataclass(frozen=True)
class Launch:
    """What run_worker starts: argv and environment for Popen, the cache_dir to put in the request, and
    whether a pid namespace bounds the launch (then the ranks' pid files hold namespace pids, which must
    never be signalled from outside; the namespace's end kills every process in it)."""

    argv: list[str]
    env: dict[str, str]
    cache_dir: str
    pid_namespace: bool
    isolation: dict[str, Any] = field(default_factory=dict)


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


@lru_cache(maxsize=4)
def _probe(bwrap: str) -> tuple[str, str]:
    """(version, error): bwrap's version, and why it cannot create the namespaces here ("" when it can)."""
    try:
        ver = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return "", f"{bwrap} --version failed: {exc}"
    argv = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--uid", str(SANDBOX_UID), "--gid",
            str(SANDBOX_UID), "--ro-bind", "/usr", "/usr", *_merged_usr(), "--proc", "/proc", "--dev", "/dev",
            "--tmpfs", "/tmp", "--clearenv", "--", "/usr/bin/true"]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    except (OSError, subprocess.SubprocessError) as exc:
        return ver, f"bwrap could not start: {exc}"
    if out.returncode != 0:
        return ver, f"bwrap cannot create its namespaces here (exit {out.returncode}): {out.stderr.strip()[:300]}"
    return ver, ""


def check(mode: str) -> dict[str, Any]:
    """Preflight: the isolation this round's candidate workers will run under, or InputError before any engine
    runs. "bwrap" must be on PATH and able to create its namespaces; "none" is the explicit opt-out."""
    if mode not in MODES:
        raise InputError(f"isolation {mode!r}: unknown; known: {', '.join(MODES)}", "use 'bwrap' (the default)")
    if mode == "none":
        return {"tool": "none", "note": "candidate workers ran as plain subprocesses (explicit opt-out); "
                                        "this round moves no frontier"}
    bwrap = bwrap_path()
    if bwrap is None:
        raise InputError("candidate workers run inside bubblewrap, and `bwrap` is not on PATH", HINT)
    ver, err = _probe(bwrap)
    if err:
        raise InputError(err, HINT)
    return {"tool": "bwrap", "version": ver, "path": bwrap, "unshared": list(UNSHARED), "uid": SANDBOX_UID,
            "gid": SANDBOX_UID, "pid_namespace": True, "network": "loopback only", "proc": "private",
            "env": "cleared + allow-list", "die_with_parent": True, "new_session": True}


def _merged_usr() -> list[str]:
    """/bin, /lib, /lib64, /sbin: symlinks into /usr where the host merges /usr, else read-only binds."""
    out: list[str] = []
    for name in ("bin", "lib", "lib64", "sbin"):
        p = Path("/") / name
        if p.is_symlink():
            out += ["--symlink", os.readlink(p), str(p)]
        elif p.is_dir():
            out += ["--ro-bind", str(p), str(p)]
    return out


def python_dirs() -> list[Path]:
    """What this interpreter needs to start and import numpy/torch: its prefix(es) and site-packages."""
    dirs = [Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable).resolve().parent.parent]
    dirs += [Path(p) for p in site.getsitepackages()]
    user = site.getusersitepackages() if site.ENABLE_USER_SITE else None
    if user and Path(user).is_dir():
        dirs.append(Path(user))
    out: list[Path] = []
    for d in dirs:
        d = d.resolve()
        if d.is_dir() and not any(d == o or o in d.parents for o in out):
            out = [o for o in out if d not in o.parents] + [d]
    return out


def launch(inner: list[str], *, mode: str, engines_dir: Path, harness_pkg: Path, scratch: Path,
           read_only: Sequence[Path], device: str, env: dict[str, str] | None = None,
           fallback_env: dict[str, str] | None = None, fallback_cache: Path | None = None) -> Launch:
    """The command that runs `inner` (the worker, or torchrun and its ranks) for one launch.

    engines_dir: the arm's engines/ (bound read-only at /sb/arm/engines); harness_pkg: the harness's
    scoreboard/ package (read-only at /sb/harness/scoreboard); scratch: this launch's private directory
    (read-write at its own path); read_only: files bound read-only at their own paths (weight shards);
    env: the round's additions (CUDA_VISIBLE_DEVICES), filtered through the allow-list.
    mode "none": `inner` as it is, with `fallback_env` and `fallback_cache` (the old plain subprocess).
    """
    if mode == "none":
        return Launch(list(inner), dict(fallback_env or {}), str(fallback_cache or scratch / "cache"), False,
                      {"tool": "none"})
    if mode != "bwrap":
        raise InputError(f"isolation {mode!r}: unknown; known: {', '.join(MODES)}")
    bwrap = bwrap_path()
    if bwrap is None:
        raise InputError("candidate workers run inside bubblewrap, and `bwrap` is not on PATH", HINT)
    scratch = Path(scratch).resolve()
    engines_dir = Path(engines_dir).resolve()
    harness_pkg = Path(harness_pkg).resolve()
    args = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--hostname", HOSTNAME,
            "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
            "--ro-bind", "/usr", "/usr", *_merged_usr()]
    for name in ETC_FILES:
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    # torchrun's rendezvous resolves the sandbox's hostname: only loopback names, written by the harness beside
    # (not inside) the launch's scratch dir, so the candidate cannot edit it
    hosts = scratch.parent / f"{scratch.name}.hosts"
    hosts.write_text(f"127.0.0.1 localhost {HOSTNAME}\n::1 localhost ip6-localhost\n")
    args += ["--ro-bind", str(hosts), "/etc/hosts"]
    args += ["--proc", "/proc"]
    if device == "cuda":  # the GPUs (and the driver's view of them) pass through
        args += ["--dev-bind", "/dev", "/dev", "--ro-bind-try", "/sys", "/sys"]
    else:
        args += ["--dev", "/dev"]
    args += ["--tmpfs", "/tmp", "--tmpfs", str(CACHE)]
    binds: list[dict[str, str]] = []

    def ro(src: Path, dest: Path) -> None:
        nonlocal args
        args += ["--ro-bind", str(src), str(dest)]
        binds.append({"src": str(src), "dest": str(dest), "mode": "ro"})

    for d in python_dirs():
        ro(d, d)
    ro(harness_pkg, HARNESS / "scoreboard")
    ro(engines_dir, ARM / "engines")
    seen: set[Path] = set()
    for f in read_only:
        dest = Path(os.path.abspath(f))
        if dest in seen:
            continue
        seen.add(dest)
        ro(dest.resolve(), dest)
    args += ["--bind", str(scratch), str(scratch), "--chdir", str(scratch)]
    binds.append({"src": str(scratch), "dest": str(scratch), "mode": "rw"})
    # the sandbox's own root (where bwrap made the mount points) read-only too: only /tmp, the cache tmpfs and
    # the scratch dir take writes
    args += ["--remount-ro", "/"]
    wenv = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp",
            "PYTHONPATH": f"{ARM}:{HARNESS}", "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONNOUSERSITE": "1", "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    for k in PASS_ENV:
        if k in os.environ:
            wenv[k] = os.environ[k]
    for k, v in (env or {}).items():
        if k in PASS_ENV:
            wenv[k] = v
    args += ["--clearenv"]
    for k, v in sorted(wenv.items()):
        args += ["--setenv", k, v]
    args += ["--", *inner]
    record = {**check("bwrap"), "binds": binds, "tmpfs": ["/tmp", str(CACHE)],
              "dev": "host /dev (GPUs)" if device == "cuda" else "minimal", "env_keys": sorted(wenv)}
    # bwrap's own environment is also the environment of the sandbox's pid 1 (readable in its /proc): keep it bare
    return Launch(args, {"PATH": "/usr/bin:/bin"}, str(CACHE), True, record)


def receipt_binds(record: dict[str, Any]) -> list[dict[str, str]]:
    """A launch's binds as a receipt keeps them: the same for every launch of the round (the arm's export
    and the launch's scratch dir, which differ per launch and are removed, are named, not given)."""
    fixed = [b for b in record.get("binds") or [] if b["mode"] == "ro" and b["dest"] != str(ARM / "engines")]
    return fixed + [{"src": "<the arm's engines/>", "dest": str(ARM / "engines"), "mode": "ro"},
                    {"src": "<the launch's private scratch dir>", "dest": "<same path>", "mode": "rw"}]


# ----------------------------------------------------------------------------------------------
# scratch: a private root per round, a private directory per launch, all removed

def new_scratch_root(base: Path | None = None) -> Path:
    """A private (0700) per-round scratch root, `sb-round-*` in the system temp dir (or `base`)."""
    return Path(tempfile.mkdtemp(prefix="sb-round-", dir=base))


def new_launch_dir(root: Path) -> Path:
    """A private (0700, mkdtemp's mode) directory for one worker launch inside the round's scratch root."""
    return Path(tempfile.mkdtemp(prefix="sb-worker-", dir=root))


def remove_tree(path: Path | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
