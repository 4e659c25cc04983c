"""The sandbox's first program: set the launch's limits, drop to its unprivileged uid, exec the worker.

It runs inside bubblewrap before any candidate code, started as
``python3 -I -S dropper.py [--uid U --gid G] [--rlimit NAME=N ...] [--chdir DIR] -- ARGV...`` (isolated mode, no site
import: nothing of the environment or of site-packages runs before it is done). Standard library only; it
never imports ``scoreboard``.

* A root harness starts bwrap without a user namespace (so it can bind paths only root may traverse, like an
  interpreter under /root, 0700), with every capability dropped but CAP_SETUID and CAP_SETGID. This program
  then starts as host uid 0: it sets the limits (soft = hard: an unprivileged process can lower a hard limit,
  never raise it), clears the supplementary groups, sets real, effective and saved gid and uid to the launch's
  own (the kernel clears every capability on that switch), and checks that no capability is left, that
  ``no_new_privs`` is set (bwrap sets it: no set-uid binary can give uid 0 back) and that uid 0 cannot be
  regained, before it enters DIR (the launch's scratch dir, the sandbox uid's own, 0700: bwrap itself, as root
  without CAP_DAC_OVERRIDE, cannot) and execs ARGV.
* A harness that is not root runs bwrap in a user namespace of its own, which already maps the sandbox onto
  the harness's unprivileged uid: then no --uid is given and this program only sets the limits.

Any failure exits EXIT with one line on stderr naming what failed; the worker never starts.
"""

from __future__ import annotations

import os
import resource
import sys
from typing import NoReturn

EXIT = 125  # the dropper failed: the worker never started
RLIMITS = ("NPROC", "NOFILE", "FSIZE", "CORE", "AS")  # the names --rlimit accepts (resource.RLIMIT_<NAME>)


def fail(message: str) -> NoReturn:
    sys.stderr.write(f"sandbox dropper: {message}\n")
    sys.stderr.flush()
    os._exit(EXIT)


def parse(argv: list[str]) -> tuple[int | None, int | None, dict[str, int], str | None, list[str]]:
    """(uid, gid, {rlimit name: value}, the directory to enter, the argv to exec) from this program's arguments."""
    if "--" not in argv:
        fail("no '--' before the command to run")
    cut = argv.index("--")
    opts, command = argv[:cut], argv[cut + 1:]
    if not command or len(opts) % 2:
        fail(f"malformed arguments {opts!r} -- {command!r}")
    uid = gid = None
    chdir: str | None = None
    limits: dict[str, int] = {}
    for flag, value in zip(opts[::2], opts[1::2]):
        if flag == "--uid":
            uid = int(value)
        elif flag == "--gid":
            gid = int(value)
        elif flag == "--chdir":
            chdir = value
        elif flag == "--rlimit" and value.partition("=")[0] in RLIMITS:
            name, _, number = value.partition("=")
            limits[name] = int(number)
        else:
            fail(f"unknown argument {flag} {value}")
    if (uid is None) != (gid is None):
        fail("--uid and --gid go together")
    return uid, gid, limits, chdir, command


def set_limits(limits: dict[str, int]) -> None:
    """Every limit as soft = hard."""
    for name, value in limits.items():
        try:
            resource.setrlimit(getattr(resource, f"RLIMIT_{name}"), (value, value))
        except (OSError, ValueError) as exc:
            fail(f"setrlimit RLIMIT_{name}={value}: {exc}")


def status() -> dict[str, str]:
    """This process's /proc/self/status fields (the sandbox's own procfs is mounted before this runs)."""
    with open("/proc/self/status") as fh:
        return dict(line.rstrip("\n").split(":\t", 1) for line in fh if ":\t" in line)


def drop(uid: int, gid: int) -> None:
    """Groups, then gid, then uid (after the uid switch no gid change is allowed any more)."""
    try:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    except OSError as exc:
        fail(f"cannot switch to uid {uid} gid {gid}: {exc}")


def check_dropped(uid: int, gid: int) -> None:
    """What the switch must have left: the ids, no capability, no_new_privs, and no way back to uid 0."""
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid) or os.getgroups():
        fail(f"ids after the switch: uid {os.getresuid()} gid {os.getresgid()} groups {os.getgroups()}")
    st = status()
    left = {k: st.get(k) for k in ("CapPrm", "CapEff", "CapAmb") if int(st.get(k, "1"), 16)}
    if left:
        fail(f"capabilities left after the switch: {left}")
    try:
        os.setuid(0)
    except PermissionError:
        pass
    else:
        fail("uid 0 could be regained after the switch")


def main(argv: list[str]) -> NoReturn:
    uid, gid, limits, chdir, command = parse(argv)
    if status().get("NoNewPrivs") != "1":
        fail("no_new_privs is not set (bwrap sets it): a set-uid binary could regain privileges")
    set_limits(limits)
    if uid is not None and gid is not None:
        drop(uid, gid)
        check_dropped(uid, gid)
    try:
        if chdir is not None:
            os.chdir(chdir)
        os.execv(command[0], command)
    except OSError as exc:
        fail(f"cannot run {command[0]}: {exc}")


if __name__ == "__main__":
    main(sys.argv[1:])
