"""scoreboard.archive: a tar whose members someone else chose is unpacked with nothing outside the destination,
through the interpreter's data filter where it has one and through the same rules checked by hand where it does
not (Debian 12's Python 3.11.2). Each attack is tried on both paths."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from scoreboard.archive import UnsafeMember, extract_tar as extract

PATHS = [pytest.param(False, id="checked-here")]
if hasattr(tarfile, "data_filter"):
    PATHS.append(pytest.param(True, id="stdlib-data-filter"))


def _tar(*members: tuple[tarfile.TarInfo, bytes | None]) -> tarfile.TarFile:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            t.addfile(info, io.BytesIO(data) if data is not None else None)
    buf.seek(0)
    return tarfile.open(fileobj=buf)


def _file(name: str, data: bytes = b"x", mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes]:
    i = tarfile.TarInfo(name)
    i.mode = mode
    return i, data


def _link(name: str, to: str, kind: bytes = tarfile.SYMTYPE) -> tuple[tarfile.TarInfo, None]:
    i = tarfile.TarInfo(name)
    i.type, i.linkname = kind, to
    return i, None


@pytest.mark.parametrize("stdlib", PATHS)
def test_a_plain_tree_unpacks_with_its_links_and_without_setuid_or_foreign_owners(tmp_path: Path, stdlib: bool):
    d = tarfile.TarInfo("pkg")
    d.type, d.mode = tarfile.DIRTYPE, 0o755
    owned = _file("pkg/run.sh", b"#!/bin/sh\n", 0o4777)  # setuid, world-writable
    owned[0].uid, owned[0].gid = 4242, 4242
    extract(_tar((d, None), owned, _link("pkg/alias", "run.sh")), tmp_path, stdlib=stdlib)
    f = tmp_path / "pkg" / "run.sh"
    assert f.read_bytes() == b"#!/bin/sh\n" and (tmp_path / "pkg" / "alias").resolve() == f.resolve()
    mode = f.stat().st_mode
    assert not mode & (stat.S_ISUID | stat.S_IWOTH | stat.S_IWGRP)
    assert f.stat().st_uid == os.geteuid()


@pytest.mark.parametrize("stdlib", PATHS)
@pytest.mark.parametrize("member", [
    _file("../escaped"),
    _link("evil", "/etc/passwd"),
    _link("up", "../.."),
    _link("hard", "../outside", tarfile.LNKTYPE),
], ids=["dotdot", "symlink-absolute", "symlink-up", "hardlink-out"])
def test_a_member_that_would_leave_the_destination_is_refused_and_nothing_is_written(tmp_path: Path, stdlib, member):
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(UnsafeMember):
        extract(_tar(member), dest, stdlib=stdlib)
    assert not (tmp_path / "escaped").exists()
    if not stdlib:  # checked before anything is written
        assert list(dest.iterdir()) == []


@pytest.mark.parametrize("stdlib", PATHS)
def test_an_absolute_member_lands_inside_the_destination(tmp_path: Path, stdlib: bool):
    outside = tmp_path / "absolute-escape"
    extract(_tar(_file(str(outside))), tmp_path / "dest", stdlib=stdlib)
    assert not outside.exists() and (tmp_path / "dest" / str(outside).lstrip("/")).is_file()


@pytest.mark.parametrize("stdlib", PATHS)
def test_a_device_file_is_refused(tmp_path: Path, stdlib: bool):
    dev = tarfile.TarInfo("null")
    dev.type, dev.devmajor, dev.devminor = tarfile.CHRTYPE, 1, 3
    with pytest.raises(UnsafeMember):
        extract(_tar((dev, None)), tmp_path, stdlib=stdlib)
    assert not (tmp_path / "null").exists()


@pytest.mark.parametrize("stdlib", PATHS)
def test_a_candidate_commit_with_a_symlink_out_of_the_tree_is_its_input_error(tmp_path: Path, stdlib: bool,
                                                                               monkeypatch):
    """Through the export a round makes of a candidate commit (a real git repository): the symlink a candidate
    committed is refused by name, as an input error, on either extraction path (the interpreter without the data
    filter is made by taking it away)."""
    import subprocess

    if not stdlib:
        monkeypatch.delattr(tarfile, "data_filter", raising=False)

    from scoreboard.errors import InputError
    from scoreboard.round.candidate import export

    repo = tmp_path / "repo"
    (repo / "engines").mkdir(parents=True)
    (repo / "engines" / "__init__.py").write_text("")
    os.symlink("/etc/passwd", repo / "engines" / "passwd")
    for cmd in (["init", "-q", "-b", "main"], ["add", "-A"], ["-c", "user.email=t@t", "-c", "user.name=t", "commit",
                                                              "-qm", "x"]):
        subprocess.run(["git", *cmd], cwd=repo, check=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, check=True, capture_output=True,
                            text=True).stdout.strip()
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with pytest.raises(InputError) as info:
        export(commit, "main", True, scratch, repo)
    assert "engines/passwd" in info.value.message and "will not unpack" in info.value.message
