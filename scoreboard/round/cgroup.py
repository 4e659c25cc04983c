"""A cgroup per candidate launch: a memory and a task ceiling for the launch as a whole.

rlimits bound one process (RLIMIT_AS) or one uid (RLIMIT_NPROC); a cgroup bounds every process of the launch
together, tmpfs pages they fill included. Each controller is used where the host has it: cgroup v2 (the unified
hierarchy, `memory.max`, `memory.swap.max`, `pids.max`), else a v1 hierarchy of its own (`memory.limit_in_bytes`,
`pids.max`), as a child of the harness's own cgroup there (so the harness's own limits still contain it).

The harness can create one when it may write its own cgroup's directory (root, or a delegated cgroup) and, on
v2, that cgroup delegates the controller to its children: a non-root v2 cgroup that holds processes (the
harness itself) cannot, so there the launch runs without one and the receipt says why.

The launch enters the cgroup before bwrap starts (`enter_argv`: a shell that writes its own pid into each
`cgroup.procs` and execs bwrap), so every process of the sandbox is in it from its first instruction.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass
from itertools import count
from pathlib import Path

CONTROLLERS = ("memory", "pids")
_names = count()
# sh -c SCRIPT sb-cgroup PROCS... -- ARGV...: join every cgroup named, then become ARGV (exit 126 if one refuses)
_ENTER = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 126; shift; done; shift; exec "$@"'


@dataclass(frozen=True)
class Place:
    """Where a controller lives: its hierarchy's mount point, the version, and the harness's cgroup in it."""

    controller: str
    version: int  # 1 or 2
    mount: Path
    own: str  # the harness's cgroup path within the hierarchy ("/" at its root)

    @property
    def parent(self) -> Path:
        return self.mount / self.own.lstrip("/")


def _mounts() -> list[tuple[Path, str, set[str]]]:
    """(mount point, fstype, super options) of every cgroup hierarchy mounted in this mount namespace."""
    out: list[tuple[Path, str, set[str]]] = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        head, _, tail = line.partition(" - ")
        fs = tail.split()
        if len(fs) >= 3 and fs[0] in ("cgroup", "cgroup2"):
            out.append((Path(head.split()[4]), fs[0], set(fs[2].split(","))))
    return out


def _own() -> dict[str, str]:
    """The harness's cgroup per hierarchy, from /proc/self/cgroup: "" for v2, else each v1 controller name."""
    out: dict[str, str] = {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        _id, names, path = line.split(":", 2)
        for name in names.split(",") if names else [""]:
            out[name] = path
    return out


def locate(controller: str) -> Place | None:
    """Where `controller` is available to this process: the v2 hierarchy when it lists it, else its v1 one."""
    own = _own()
    for mount, fstype, _opts in _mounts():
        if fstype == "cgroup2" and "" in own:
            parent = mount / own[""].lstrip("/")
            try:
                if controller in (parent / "cgroup.controllers").read_text().split():
                    return Place(controller, 2, mount, own[""])
            except OSError:
                continue
    for mount, fstype, opts in _mounts():
        if fstype == "cgroup" and controller in opts and controller in own:
            return Place(controller, 1, mount, own[controller])
    return None


@dataclass(frozen=True)
class Cgroup:
    """The launch's cgroup: one directory of the same name per hierarchy it spans (v2: one for both)."""

    name: str
    places: tuple[Place, ...]

    @property
    def dirs(self) -> list[Path]:
        return list(dict.fromkeys(p.parent / self.name for p in self.places))

    def enter_argv(self) -> list[str]:
        """The prefix that puts the command after it into this cgroup before it runs."""
        return ["/bin/sh", "-c", _ENTER, "sb-cgroup", *[str(d / "cgroup.procs") for d in self.dirs], "--"]

    def oom_kills(self) -> int:
        """Processes the kernel killed for the memory ceiling (memory.events on v2, memory.oom_control on v1)."""
        for p in self.places:
            if p.controller != "memory":
                continue
            name = "memory.events" if p.version == 2 else "memory.oom_control"
            try:
                for line in (p.parent / self.name / name).read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
            except (OSError, ValueError):
                return 0
        return 0

    def remove(self, grace_s: float = 5.0) -> None:
        """Kill what is left in it (a sandbox the kernel is still tearing down), then remove every directory."""
        for d in self.dirs:
            _remove(d, time.monotonic() + grace_s)


def _remove(d: Path, deadline: float) -> None:
    while d.exists():
        _kill_all(d)
        try:
            d.rmdir()
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                return
            time.sleep(0.02)


def _kill_all(d: Path) -> None:
    try:
        pids = [int(p) for p in (d / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _write(path: Path, value: str) -> None:
    path.write_text(value)


def _delegated(place: Place) -> None:
    """A v2 controller must already be enabled for the harness's cgroup's children: the harness never changes
    its own or a parent's cgroup.subtree_control (a setting of the host, not of the round)."""
    control = place.parent / "cgroup.subtree_control"
    if place.controller not in control.read_text().split():
        raise OSError(errno.EPERM, f"{control} does not enable {place.controller} for its children (a v2 cgroup "
                                   "that holds processes cannot; run the harness in a delegated cgroup, e.g. "
                                   "`systemd-run --scope -p Delegate=yes ...`)")


def _limit(place: Place, d: Path, memory: int, tasks: int) -> None:
    if place.controller == "pids":
        _write(d / "pids.max", str(tasks))
    elif place.version == 2:
        _write(d / "memory.max", str(memory))
        if (d / "memory.swap.max").exists():
            _write(d / "memory.swap.max", "0")
    else:
        _write(d / "memory.limit_in_bytes", str(memory))
        if (d / "memory.memsw.limit_in_bytes").exists():  # swap accounting on: memory + swap = memory alone
            _write(d / "memory.memsw.limit_in_bytes", str(memory))


def create(memory: int, tasks: int) -> tuple[Cgroup | None, dict[str, str]]:
    """A fresh cgroup for one launch with `memory` bytes and `tasks` tasks at most, and {controller: why not}
    for each controller it could not bound (a cgroup with neither is None)."""
    name = f"scoreboard-{os.getpid()}-{next(_names)}"
    done: list[Place] = []
    skipped: dict[str, str] = {}
    for controller in CONTROLLERS:
        place = locate(controller)
        if place is None:
            skipped[controller] = "no cgroup hierarchy of this host offers it to the harness"
            continue
        d = place.parent / name
        try:
            if place.version == 2:
                _delegated(place)
            d.mkdir(exist_ok=True)
            _limit(place, d, memory, tasks)
            done.append(place)
        except OSError as exc:
            skipped[controller] = f"cgroup v{place.version} at {place.parent}: {exc.strerror or exc}"
            if not any(q.parent / name == d for q in done):
                _remove(d, time.monotonic() + 1.0)
    if not done:
        return None, skipped
    return Cgroup(name, tuple(done)), skipped
