"""llamacpp source acquisition against real parts: local bare git repos (pinned ref, force-push, deleted ref,
base not an ancestor, unreachable remote) and a fake sdist served to pip from a local directory."""

from __future__ import annotations

import hashlib
from pathlib import Path

import git
import pytest
from llamacpp_fixtures import BareRemote, write_fake_sdist

from engines.llamacpp import source
from scoreboard.errors import InputError, PinError, TransientError
from scoreboard.lockfile import GitReference, SdistReference

PR = "refs/pull/48/head"


@pytest.fixture
def remote(tmp_path: Path) -> tuple[BareRemote, str, str]:
    r = BareRemote(tmp_path / "git")
    base = r.commit({"CMakeLists.txt": "# base\n"}, "base")
    head = r.commit({"CMakeLists.txt": "# head\n", "src/a.c": "int a;\n"}, "head", parent=base)
    r.push(base, "refs/heads/master")
    r.push(head, PR)
    return r, base, head


def _ref(url: str, commit: str, base: str) -> GitReference:
    return GitReference(kind="git", repo=url, ref=PR, commit=commit, base_commit=base)


def test_git_pin_checks_out_the_pinned_commit_into_a_clean_tree(remote, tmp_path):
    r, base, head = remote
    dest = tmp_path / "src"
    info = source.materialize(_ref(r.url, head, base), tmp_path / "cache", dest, "pr48")
    assert info.detail["resolved_commit"] == head
    assert info.build_commit == head
    assert (dest / "src" / "a.c").read_text() == "int a;\n"
    work = git.Repo(dest)
    assert work.head.commit.hexsha == head and not work.is_dirty(untracked_files=True)
    # a second checkout reuses the mirror (no fetch) and is just as clean
    info2 = source.materialize(_ref(r.url, head, base), tmp_path / "cache", tmp_path / "src2", "pr48")
    assert info2.detail["mirror"] == info.detail["mirror"]


def test_force_push_fails_loudly_naming_old_and_new_sha(remote, tmp_path):
    r, base, head = remote
    ref = _ref(r.url, head, base)
    source.check_git_pin(ref, tmp_path / "cache", "pr48")  # pinned and fetched once: the mirror has `head`
    other = r.commit({"CMakeLists.txt": "# rewritten\n"}, "rewritten", parent=base)
    r.push(other, PR)  # force-push
    with pytest.raises(PinError) as exc:
        source.check_git_pin(ref, tmp_path / "cache", "pr48")
    msg = str(exc.value)
    assert head in msg and other in msg and "force-pushed" in msg and PR in msg
    assert "re-pin deliberately after review: update references.pr48.commit in reference.lock and re-measure" \
        in exc.value.hint
    assert not (tmp_path / "src").exists()


def test_deleted_ref_fails_loudly(remote, tmp_path):
    r, base, head = remote
    r.delete(PR)
    with pytest.raises(PinError, match=r"ref refs/pull/48/head no longer exists"):
        source.materialize(_ref(r.url, head, base), tmp_path / "cache", tmp_path / "src", "pr48")
    assert not (tmp_path / "src").exists()


def test_base_that_is_not_an_ancestor_fails(remote, tmp_path):
    r, _base, head = remote
    unrelated = r.commit({"x": "y\n"}, "unrelated root")
    r.push(unrelated, "refs/heads/unrelated")
    for bad_base in (unrelated, "f" * 40):  # in the remote but not an ancestor; not anywhere at all
        with pytest.raises(PinError, match=f"base_commit {bad_base} is not an ancestor of {head}") as exc:
            source.check_git_pin(_ref(r.url, head, bad_base), tmp_path / "cache", "pr48")
        assert "references.pr48.base_commit" in exc.value.hint


def test_missing_repository_is_a_pin_error_and_unreachable_host_is_transient(tmp_path):
    gone = (tmp_path / "nothing.git").as_uri()
    with pytest.raises(PinError, match="no longer exists"):
        source.check_git_pin(_ref(gone, "a" * 40, "b" * 40), tmp_path / "cache", "pr48")
    with pytest.raises(TransientError, match="could not reach"):
        source.check_git_pin(_ref("http://127.0.0.1:9/x.git", "a" * 40, "b" * 40), tmp_path / "cache", "pr48")


# ----------------------------------------------------------------------------------------------
# sdist

def _sdist(tmp_path: Path) -> tuple[Path, str, list[str]]:
    links = tmp_path / "index"
    path = write_fake_sdist(links, files={"CMakeLists.txt": "# fake llama.cpp\n", "include/llama.h": "// h\n"})
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    return path, sha, ["--no-index", "--find-links", str(links), "--no-build-isolation"]


def _sref(sha: str) -> SdistReference:
    return SdistReference(kind="pypi-sdist", package="fakellama", version="0.1.0", sha256=sha,
                          subdir="vendor/llama.cpp")


def test_sdist_is_downloaded_verified_and_only_the_subdir_extracted(tmp_path):
    _, sha, pip_args = _sdist(tmp_path)
    dest = tmp_path / "src"
    info = source.materialize(_sref(sha), tmp_path / "cache", dest, "fake", pip_args)
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*")) == [
        "CMakeLists.txt", "README.md", "include", "include/llama.h"]  # no pyproject.toml, no dangling .git
    assert info.detail["dropped_dot_git"] is True and info.detail["sdist_sha256"] == sha
    assert info.build_commit == f"fakellama-0.1.0-{sha[:12]}"
    cached = tmp_path / "cache" / "downloads" / "pypi" / "fakellama" / "0.1.0" / "fakellama-0.1.0.tar.gz"
    assert hashlib.sha256(cached.read_bytes()).hexdigest() == sha


def test_wrong_sdist_hash_refuses_before_extracting_and_deletes_nothing_else(tmp_path):
    _, sha, pip_args = _sdist(tmp_path)
    cache = tmp_path / "cache"
    keep = cache / "llamacpp" / "build" / "other" / "manifest.json"
    keep.parent.mkdir(parents=True)
    keep.write_text("{}")
    wrong = "0" * 64
    with pytest.raises(PinError) as exc:
        source.materialize(_sref(wrong), cache, tmp_path / "src", "fake", pip_args)
    assert wrong in str(exc.value) and sha in str(exc.value) and "nothing was extracted" in str(exc.value)
    assert "references.fake.sha256" in exc.value.hint
    assert not (tmp_path / "src").exists()
    assert keep.read_text() == "{}"
    assert not any((cache / "downloads").rglob("*.tar.gz"))  # nothing kept under the pin's name


def test_tampered_cached_sdist_is_set_aside_and_downloaded_again(tmp_path):
    _, sha, pip_args = _sdist(tmp_path)
    cache = tmp_path / "cache"
    path = source.fetch_sdist(_sref(sha), cache, "fake", pip_args)
    path.write_bytes(b"tampered")
    again = source.fetch_sdist(_sref(sha), cache, "fake", pip_args)
    assert again == path and hashlib.sha256(again.read_bytes()).hexdigest() == sha
    rejected = list((cache / "downloads" / "rejected").iterdir())
    assert len(rejected) == 1 and rejected[0].read_bytes() == b"tampered"


def test_extract_rehashes_and_checks_the_subdir(tmp_path):
    path, sha, _ = _sdist(tmp_path)
    with pytest.raises(PinError, match="is not the pinned"):
        source.extract_sdist(_sref("1" * 64), path, tmp_path / "a")
    assert not (tmp_path / "a").exists()
    bad = SdistReference(kind="pypi-sdist", package="fakellama", version="0.1.0", sha256=sha, subdir="vendor/nope")
    with pytest.raises(InputError, match="subdir 'vendor/nope' not found"):
        source.extract_sdist(bad, path, tmp_path / "b")


def test_pip_args_come_from_the_environment(monkeypatch):
    monkeypatch.setenv(source.PIP_ARGS_ENV, "--no-index --find-links '/a b'")
    assert source._pip_args(None) == ["--no-index", "--find-links", "/a b"]
    assert source._pip_args(["--x"]) == ["--x"]


def test_a_tampered_object_in_the_cached_mirror_is_caught_at_checkout(remote, tmp_path):
    import zlib

    r, base, head = remote
    ref = _ref(r.url, head, base)
    source.materialize(ref, tmp_path / "cache", tmp_path / "src", "pr48")  # populates the mirror
    mirror = git.Repo(source._mirror_path(tmp_path / "cache", r.url))
    blob = mirror.git.rev_parse(f"{head}:src/a.c")
    loose = Path(mirror.git_dir) / "objects" / blob[:2] / blob[2:]
    if not loose.exists():
        pytest.skip("the fetch packed its objects")
    evil = b"int a = 666;\n"
    loose.chmod(0o644)
    loose.write_bytes(zlib.compress(b"blob %d\x00" % len(evil) + evil))  # same name, other content
    with pytest.raises(PinError, match="corrupt or tampered with"):
        source.materialize(ref, tmp_path / "cache", tmp_path / "src2", "pr48")
