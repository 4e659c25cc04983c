"""The reference pinned by the content of its source tree: any transport that delivers exactly that tree is
accepted (the sdist from pip or a pre-seeded cache, the sdist file from a local path, a git mirror, a directory),
the tree is hashed before anything is built, and a tree that differs is a pin error naming both hashes.

Real parts: real sdists (tar.gz), real bare git repositories reached by file:// and by path, real directories,
and the real llama-cpp-python sdist from the cache for the lock's own pin.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from engines.llamacpp import source
from llamacpp_fixtures import write_fake_sdist
from scoreboard.errors import PinError
from scoreboard.lockfile import SdistReference, load_lock

REPO = Path(__file__).resolve().parent.parent
FILES = {"CMakeLists.txt": "# fake\n", "src/llama.cpp": "int x;\n", "docs/build.md": "docs\n",
         "models/vocab.gguf": "vocab\n", ".gitignore": "*.cpp\nsrc/\n", "scripts/run.sh": "#!/bin/sh\n"}
EXCLUDE = ("docs", "models")


def _git_write_tree(root: Path) -> str:
    """The same tree through porcelain: git add --force everything in a real repository."""
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run(["git", "add", "-A", "-f"], cwd=root, check=True)
    return subprocess.run(["git", "write-tree"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()


def test_tree_hash_is_git_s_tree_of_every_file_ignoring_gitignore(tmp_path):
    root = tmp_path / "t"
    for name, text in FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "scripts" / "run.sh").chmod(0o755)
    os.symlink("src/llama.cpp", root / "link.cpp")
    (root / "empty").mkdir()  # git trees hold no empty directories
    full = source.tree_hash(root)
    excluded = source.tree_hash(root, EXCLUDE)
    assert full != excluded
    copy = tmp_path / "copy"
    shutil.copytree(root, copy, symlinks=True)
    for e in EXCLUDE:
        shutil.rmtree(copy / e)
    assert _git_write_tree(copy) == excluded  # .gitignore'd files count; a .git dir is never part of the tree
    assert source.tree_hash(copy) == excluded
    (copy / "src" / "llama.cpp").write_text("int y;\n")
    assert source.tree_hash(copy) != excluded


@pytest.fixture
def pin(tmp_path):
    """(sdist path, reference pinned by sha256 + tree with exclusions)."""
    tarball = write_fake_sdist(tmp_path / "dl", files=FILES)
    probe = tmp_path / "probe"
    bare_ref = SdistReference(kind="pypi-sdist", package="fakellama", version="0.1.0",
                              sha256=source.sha256_file(tarball), subdir="vendor/llama.cpp")
    source.extract_sdist(bare_ref, tarball, probe)
    tree = source.tree_hash(probe, EXCLUDE)
    ref = bare_ref.model_copy(update={"tree": tree, "tree_exclude": EXCLUDE})
    return tarball, ref


def _check(info: source.SourceInfo, dest: Path, ref: SdistReference, transport: str) -> None:
    assert info.detail["source_tree"] == ref.tree and info.detail["transport"] == transport
    assert not (dest / "docs").exists() and not (dest / "models").exists()  # never built from, on any box
    assert source.tree_hash(dest) == ref.tree


def test_every_transport_that_delivers_the_pinned_tree_is_accepted(pin, tmp_path):
    tarball, ref = pin
    cache = tmp_path / "cache"
    # the sdist file from a local path (its sha256 is checked: the transport is the sdist)
    d = tmp_path / "a"
    _check(source.materialize(ref, cache, d, "fake", source=str(tarball)), d, ref, str(tarball))
    # a pre-seeded download cache, with no index reachable
    seeded = cache / "downloads" / "pypi" / "fakellama" / "0.1.0"
    seeded.mkdir(parents=True)
    shutil.copy2(tarball, seeded / tarball.name)
    d = tmp_path / "b"
    _check(source.materialize(ref, cache, d, "fake", pip_args=["--no-index"], source="pin"), d, ref, "pin")
    # a directory (a .git inside it and the excluded directories are not part of the tree)
    tree_dir = tmp_path / "tree"
    source.extract_sdist(ref, tarball, tree_dir)
    (tree_dir / ".git").mkdir()
    (tree_dir / ".git" / "HEAD").write_text("ref: refs/heads/x\n")
    d = tmp_path / "c"
    _check(source.materialize(ref, cache, d, "fake", source=str(tree_dir)), d, ref, str(tree_dir.resolve()))
    # the carried form: a bare git repository holding exactly the pinned tree, by file:// URL and by path
    mirror = tmp_path / "carry.git"
    commit, tree = source.pack_git(ref, cache, mirror, "fake", source=str(tarball))
    assert tree == ref.tree
    for spec in (f"git+{mirror.as_uri()}@{commit}", f"git+{mirror}@{commit}", f"git+{mirror}@main"):
        d = tmp_path / f"g{len(list(tmp_path.iterdir()))}"
        info = source.materialize(ref, cache, d, "fake", source=spec)
        _check(info, d, ref, spec)
        assert info.detail["resolved_commit"] == commit


def test_a_tree_that_differs_is_a_pin_error_naming_both_hashes(pin, tmp_path):
    tarball, ref = pin
    tree_dir = tmp_path / "tree"
    source.extract_sdist(ref, tarball, tree_dir)
    (tree_dir / "src" / "llama.cpp").write_text("int evil;\n")
    actual = source.tree_hash(tree_dir, EXCLUDE)
    with pytest.raises(PinError, match=rf"hashes to tree {actual}, but the pin is tree {ref.tree}"):
        source.materialize(ref, tmp_path / "cache", tmp_path / "d1", "fake", source=str(tree_dir))
    # a mirror whose commit carries one extra file
    mirror = tmp_path / "m.git"
    subprocess.run(["git", "init", "-q", "--bare", str(mirror)], check=True)
    (tree_dir / "src" / "llama.cpp").write_text("int x;\n")
    (tree_dir / "extra.h").write_text("#define EVIL 1\n")
    grown = source.tree_hash(tree_dir, EXCLUDE, git_dir=mirror)
    env = source._git_env(mirror)
    commit = source._plumb(["commit-tree", grown], env, b"extra\n").decode().strip()
    with pytest.raises(PinError, match=rf"git\+{mirror}@{commit} hashes to tree {grown}, but the pin is tree {ref.tree}"):
        source.materialize(ref, tmp_path / "cache", tmp_path / "d2", "fake", source=f"git+{mirror}@{commit}")
    # an sdist file that is not the pinned one
    other = write_fake_sdist(tmp_path / "other", files={**FILES, "extra.h": "x\n"})
    with pytest.raises(PinError, match="sha256 .* is not the pinned"):
        source.materialize(ref, tmp_path / "cache", tmp_path / "d3", "fake", source=str(other))
    assert not (tmp_path / "d3").exists()


def test_a_pin_without_a_tree_accepts_only_its_own_transport(pin, tmp_path):
    tarball, ref = pin
    untreed = ref.model_copy(update={"tree": ""})
    tree_dir = tmp_path / "tree"
    source.extract_sdist(ref, tarball, tree_dir)
    with pytest.raises(PinError, match=r"references\.fake\.tree is empty"):
        source.materialize(untreed, tmp_path / "cache", tmp_path / "d", "fake", source=str(tree_dir))
    info = source.materialize(untreed, tmp_path / "cache", tmp_path / "e", "fake", source=str(tarball))
    assert info.detail["source_tree"] == ref.tree  # still hashed and recorded


@pytest.mark.slow
def test_the_lock_s_sdist_pin_is_satisfied_by_its_carried_git_form(tmp_path):
    """The real llama-cpp-python sdist (cached): its pinned tree, packed as the carried bare repository and
    delivered back through git+file://, hashes to the lock's tree."""
    ref = load_lock(REPO / "reference.lock").references["llama-cpp-python-0-3-36"]
    seeded = Path.home() / ".cache" / "scoreboard" / "downloads" / "pypi" / ref.package / ref.version
    tarballs = sorted(seeded.glob("*.tar.gz")) if seeded.is_dir() else []
    if not tarballs:
        pytest.skip("the pinned sdist is not in the cache yet")
    t0 = time.monotonic()
    commit, tree = source.pack_git(ref, tmp_path / "cache", tmp_path / "llama.cpp.git", "llama-cpp-python-0-3-36",
                                   source=str(tarballs[0]))
    packed_s = time.monotonic() - t0
    assert tree == ref.tree
    size = sum(p.stat().st_size for p in (tmp_path / "llama.cpp.git").rglob("*") if p.is_file())
    t0 = time.monotonic()
    info = source.materialize(ref, tmp_path / "cache", tmp_path / "src", "llama-cpp-python-0-3-36",
                              source=f"git+file://{tmp_path / 'llama.cpp.git'}@{commit}")
    print(f"carried repo {size / 2**20:.1f} MiB, pack {packed_s:.1f} s, deliver+verify {time.monotonic() - t0:.1f} s")
    assert info.detail["source_tree"] == ref.tree
    assert size < 40 * 2**20
