"""Unpacking a tar archive whose members someone else chose: a candidate commit's `git archive` (a candidate can
commit a symlink to anywhere), a plugin's package, a pinned sdist.

Nothing may land outside the destination: no `..` member (a leading slash is dropped), no link whose target leaves it, no device
file or fifo, no setuid/setgid/sticky bit, no group/other write bit, no foreign owner. These are the rules of the
standard library's "data" filter (`tarfile.data_filter`), which is used wherever the interpreter has it (Python
3.12, and the 3.11.4 / 3.10.12 patch releases). Older patch releases lack it, Debian 12's Python 3.11.2 among them
(there `extractall(filter=...)` is a TypeError), so the same rules are checked here, for every member, before
anything is written.
"""

from __future__ import annotations

import copy
import os
import stat
import tarfile
from collections.abc import Iterable


class UnsafeMember(Exception):
    """A member the rules above refuse; nothing was extracted."""


def extract_tar(tar: tarfile.TarFile, dest: str | os.PathLike[str], members: Iterable[tarfile.TarInfo] | None = None,
            *, stdlib: bool | None = None) -> None:
    """Every member (or `members`) of `tar` under `dest`, or UnsafeMember naming the first refused one.
    `stdlib`: use the interpreter's data filter (default: wherever it has one; tests force either way)."""
    if stdlib is None:
        stdlib = hasattr(tarfile, "data_filter")
    if stdlib:
        try:
            tar.extractall(dest, members=members, filter="data")
        except tarfile.FilterError as exc:  # type: ignore[attr-defined,unused-ignore]
            raise UnsafeMember(str(exc)) from None
        return
    chosen = list(members) if members is not None else tar.getmembers()
    root = os.path.realpath(dest)
    checked = [_checked(m, root) for m in chosen]
    tar.extractall(dest, members=checked)


def _inside(root: str, path: str) -> bool:
    return os.path.commonpath([root, path]) == root


def _checked(m: tarfile.TarInfo, root: str) -> tarfile.TarInfo:
    """`m` as the data filter would extract it, or UnsafeMember."""
    name = m.name.lstrip("/" + os.sep)  # as the data filter does: a leading slash is dropped, never followed
    if os.path.isabs(name):
        raise UnsafeMember(f"member {m.name!r} has an absolute path")
    target = os.path.realpath(os.path.join(root, name))
    if not _inside(root, target):
        raise UnsafeMember(f"member {name!r} would be extracted outside the destination")
    if not (m.isreg() or m.isdir() or m.issym() or m.islnk()):
        raise UnsafeMember(f"member {name!r} is a special file (device, fifo): refused")
    if m.issym():
        if os.path.isabs(m.linkname):
            raise UnsafeMember(f"symlink {name!r} points to the absolute path {m.linkname!r}")
        to = os.path.realpath(os.path.join(root, os.path.dirname(name), m.linkname))
        if not _inside(root, to):
            raise UnsafeMember(f"symlink {name!r} points outside the destination ({m.linkname!r})")
    if m.islnk():
        to = os.path.realpath(os.path.join(root, m.linkname))
        if os.path.isabs(m.linkname) or not _inside(root, to):
            raise UnsafeMember(f"hard link {name!r} points outside the destination ({m.linkname!r})")
    out = copy.copy(m)  # TarInfo.replace came with the filters: not here
    out.name = name
    mode = m.mode & ~(stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX | stat.S_IWGRP | stat.S_IWOTH)
    if m.isreg() or m.islnk():
        mode |= stat.S_IRUSR | stat.S_IWUSR  # the data filter's: the owner can read and write what it extracted
    out.mode = mode
    out.uid, out.gid, out.uname, out.gname = os.geteuid(), os.getegid(), "", ""  # never chown to the archive's
    return out
