"""What bounds a candidate launch: the host uid it runs as, its resource limits, its size-capped scratch.

A candidate process must not be able to change the host (a uid with a host-wide privilege), starve it (memory,
processes, files) or fill the filesystem that holds rounds/. Three layers, each recorded in the receipt as
applied or not with the reason (environment.isolation.limits):

* rlimits, set by the sandbox's first program (scoreboard/round/dropper.py) as soft = hard, which an
  unprivileged process can never raise again;
* a cgroup (scoreboard/round/cgroup.py) with a memory and a process ceiling for the launch as a whole, where
  the harness can create one;
* size-capped tmpfs: the sandbox's /tmp, /sb/cache and /dev/shm (bwrap --size), and the round's scratch root
  (mounted by a root harness), so that nothing a candidate writes lands on the harness's disks.

Limits are the harness's policy, never read from the environment (a candidate could set that).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import pwd
import resource
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

GIB = 1 << 30
# A candidate's host uid when the harness is root: the first uid from UID_BASE + (the harness's pid mod UID_SPAN)
# that no account names and no process runs as. Per harness process, so concurrent rounds share one only when
# their pids agree mod 2**20 and neither's sandbox runs when the other picks (RLIMIT_NPROC counts the tasks of a
# uid host-wide), and no other program's processes count against it; never
# nobody (65534), which other host services use (here, too, ext4's reserved blocks: resuid=65534). No file of
# it outlives a launch. Below 2**31, for tools that read uids as signed 32-bit numbers.
UID_BASE = 1_700_000_000
UID_SPAN = 1 << 20


@dataclass(frozen=True)
class Limits:
    """One launch's bounds (bytes, or counts)."""

    tasks: int  # processes + threads of the sandbox: RLIMIT_NPROC (per uid) and the cgroup's pids.max
    open_files: int  # RLIMIT_NOFILE, per process
    file_size: int  # RLIMIT_FSIZE: the largest file a sandbox process may write
    address_space: int | None  # RLIMIT_AS per process; None on cuda (CUDA reserves terabytes of address space)
    memory: int  # the cgroup's memory ceiling for the whole launch (tmpfs pages it fills included)
    tmpfs: int  # each private tmpfs: /tmp, /sb/cache, /dev/shm
    scratch: int  # the round's scratch root (a tmpfs when the harness is root)


def mem_total() -> int:
    """Bytes of RAM (MemTotal of /proc/meminfo; 16 GiB where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 16 * GIB


def scratch_bytes() -> int:
    """The round's scratch root: min(32 GiB, RAM/4). Its largest user is a calibration of the flagship, whose
    launches' logits stay until it ends: 5 depths x 32 rows x 163,840 float32 = 105 MB a seed, 20 seeds a launch,
    7 launches (the correct engine, the second precision, 5 faults): 15 GB."""
    return min(32 * GIB, mem_total() // 4)


def for_box(device: str) -> Limits:
    """The default bounds on this box: 3/4 of RAM for the launch (the harness and the reference keep the rest),
    64 tasks per core (at least 1024: torch starts a thread per core and rank), each tmpfs min(4 GiB, RAM/8),
    no file larger than the scratch root (scratch_bytes)."""
    ram = mem_total()
    memory = ram * 3 // 4
    scratch = scratch_bytes()
    return Limits(tasks=max(1024, 64 * (os.cpu_count() or 1)), open_files=65536, file_size=scratch,
                  address_space=None if device == "cuda" else memory, memory=memory, tmpfs=min(4 * GIB, ram // 8),
                  scratch=scratch)


def rlimits(limits: Limits, own_uid: bool) -> tuple[dict[str, int], dict[str, str]]:
    """({RLIMIT name: value} the dropper sets, {name: why not} for the ones it does not). A value is never above
    the harness's own hard limit, which the sandbox inherits and cannot raise (no CAP_SYS_RESOURCE)."""
    wanted = {"NOFILE": limits.open_files, "FSIZE": limits.file_size, "CORE": 0}
    skipped: dict[str, str] = {}
    if own_uid:
        wanted["NPROC"] = limits.tasks
    else:
        skipped["NPROC"] = ("the sandbox runs as the harness's own uid (bwrap's user namespace), whose other "
                            "processes RLIMIT_NPROC would count")
    if limits.address_space is None:
        skipped["AS"] = "cuda target: CUDA reserves far more address space than memory, so RLIMIT_AS would break it"
    else:
        wanted["AS"] = limits.address_space
    return {name: _at_most_hard(name, value) for name, value in wanted.items()}, skipped


def _at_most_hard(name: str, value: int) -> int:
    hard = resource.getrlimit(getattr(resource, f"RLIMIT_{name}"))[1]
    return value if hard == resource.RLIM_INFINITY else min(value, hard)


def dropper_args(uid: int | None, gid: int | None, applied: dict[str, int]) -> list[str]:
    """The dropper's arguments before its `--`: the ids to switch to (root harness only) and the rlimits."""
    out = ["--uid", str(uid), "--gid", str(gid)] if uid is not None and gid is not None else []
    for name, value in sorted(applied.items()):
        out += ["--rlimit", f"{name}={value}"]
    return out


# ----------------------------------------------------------------------------------------------
# the candidate's host uid (root harness)

def _uids_in_use() -> set[int]:
    """Every real, effective, saved or filesystem uid of a process on the host."""
    out: set[int] = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            for line in (d / "status").read_text().splitlines():
                if line.startswith("Uid:"):
                    out.update(int(x) for x in line.split()[1:])
                    break
        except (OSError, ValueError):
            continue
    return out


def _has_account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


@lru_cache(maxsize=1)
def sandbox_uid() -> int:
    """This harness process's sandbox uid (and gid, the same number); see UID_BASE."""
    busy = _uids_in_use()
    start = os.getpid() % UID_SPAN
    for i in range(UID_SPAN):
        uid = UID_BASE + (start + i) % UID_SPAN
        if uid not in busy and not _has_account(uid):
            return uid
    raise RuntimeError("no free sandbox uid")  # 2**20 uids all busy: not a state a host reaches


# ----------------------------------------------------------------------------------------------
# the round's scratch root on a size-capped tmpfs (root harness)

_MS_NOSUID, _MS_NODEV = 2, 4
_MNT_DETACH = 2


def _libc() -> Any:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def mount_tmpfs(path: Path, size: int) -> str:
    """Mount a tmpfs of `size` bytes (mode 0700, nosuid, nodev) on the empty directory `path`; "" when mounted,
    else why not (not root; the kernel's refusal)."""
    if os.geteuid() != 0:
        return "the harness is not root, so it cannot mount one"
    opts = f"size={size},mode=0700".encode()
    if _libc().mount(b"tmpfs", str(path).encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, opts) != 0:
        return f"mount(2) refused: {os.strerror(ctypes.get_errno())}"
    return ""


def unmount(path: Path) -> None:
    """Detach the tmpfs at `path` (lazily: a process the kernel is still tearing down cannot keep it busy)."""
    if tmpfs_size(path) is not None:
        _libc().umount2(str(path).encode(), _MNT_DETACH)


def tmpfs_size(path: Path) -> int | None:
    """The size cap in bytes of the tmpfs mounted exactly at `path`, or None when none is mounted there."""
    target = os.path.realpath(path)
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):  # the latest mount at a path is the one in effect
        fields = line.split(" - ")
        head, tail = fields[0].split(), fields[-1].split()
        mount_point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), head[4])  # "\040": a space
        if mount_point == target and tail[0] == "tmpfs":
            sizes = [o[5:] for o in tail[2].split(",") if o.startswith("size=")]
            return _bytes(sizes[0]) if sizes else 0
    return None


def _bytes(text: str) -> int:
    """tmpfs's size option as mountinfo shows it ("1048576k", "4g") in bytes."""
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(text[-1:].lower(), 1)
    return int(text.rstrip("kKmMgG")) * scale
