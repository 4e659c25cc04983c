"""Git reference pins against real local bare repositories: pinned ref, new commits, force-push, deleted ref,
rewritten base, a lock whose base is wrong, and remotes that cannot be reached or hang (errors, not drift)."""

from __future__ import annotations

import socket
import time

import pytest

from audit_fixtures import GitRemote, closed_port
from scoreboard.lockfile import GitReference
from scoreboard.pins.git import check_git_reference, ls_remote

PR = "refs/pull/48/head"


@pytest.fixture
def remote(tmp_path):
    r = GitRemote(tmp_path / "git")
    r.base = r.commit("upstream base")
    r.c1 = r.commit("pr: first", r.base)
    r.pinned = r.commit("pr: second", r.c1)
    r.push(r.base, "refs/heads/main")
    r.push(r.pinned, PR)
    return r


def pin(remote, commit=None, base=None, ref=PR, url=None) -> GitReference:
    return GitReference(kind="git", repo=url or remote.url, ref=ref, commit=commit or remote.pinned,
                        base_commit=base or remote.base)


def check(ref: GitReference, tmp_path, timeout=10.0):
    return check_git_reference("ref-a", ref, timeout=timeout, cache=tmp_path / "cache", targets=("t",))


def kinds(findings):
    return [f.kind for f in findings]


def test_pinned_ref_holds(remote, tmp_path):
    (f,) = check(pin(remote), tmp_path)
    assert f.kind == "ok" and f.pin == "references.ref-a" and f.targets == ("t",)
    assert f.was == f.now == remote.pinned
    # the history was fetched into the cache, commits only
    assert list((tmp_path / "cache" / "audit" / "git").iterdir())


def test_new_commits_on_top_are_drift_with_old_and_new_sha(remote, tmp_path):
    new = remote.commit("pr: third", remote.pinned)
    remote.push(new, PR)
    (f,) = check(pin(remote), tmp_path)
    assert f.kind == "drift"
    assert (f.was, f.now) == (remote.pinned, new)
    assert f"moved from {remote.pinned[:12]}… to {new[:12]}…: a force-push or new commits" in f.message
    assert "still in its history: new commits were pushed on top" in f.message
    assert "update references.ref-a.commit" in f.action and "re-measure" in f.action


def test_force_push_is_drift_and_says_the_history_was_rewritten(remote, tmp_path):
    check(pin(remote), tmp_path)  # warm the cache with the old pinned commit: it must not fool the check
    amended = remote.commit("pr: second (amended)", remote.c1)
    remote.push(amended, PR)
    (f,) = check(pin(remote), tmp_path)
    assert f.kind == "drift" and (f.was, f.now) == (remote.pinned, amended)
    assert "no longer in its history: the ref was force-pushed" in f.message


def test_rewritten_base_is_a_second_drift(remote, tmp_path):
    root = remote.commit("rewritten upstream")
    head = remote.commit("pr: rebased", root)
    remote.push(head, PR)
    moved, base = check(pin(remote), tmp_path)
    assert kinds([moved, base]) == ["drift", "drift"]
    assert base.subject == f"base_commit {remote.base[:12]}…"
    assert base.was == remote.base and base.now == f"not in the history of {head}"
    assert "not an ancestor of the ref's new head" in base.message
    assert "rebased onto another base or rewritten" in base.action


def test_lock_whose_base_is_not_an_ancestor_is_drift(remote, tmp_path):
    side = remote.commit("unrelated branch", remote.base)
    remote.push(side, "refs/heads/side")
    (f,) = check(pin(remote, base=side), tmp_path)
    assert f.kind == "drift"
    assert f.message == f"base_commit {side[:12]}… is not an ancestor of the pinned commit ({remote.pinned[:12]}…)"
    assert "the lock is inconsistent" in f.action


def test_deleted_ref_is_drift(remote, tmp_path):
    remote.delete(PR)
    (f,) = check(pin(remote), tmp_path)
    assert f.kind == "drift" and f.now == "(missing)"
    assert f.message.startswith(f"ref {PR} no longer exists in {remote.url}")


@pytest.mark.parametrize("make_url", [
    lambda tmp: (tmp / "no-such-repo.git").as_uri(),
    lambda tmp: f"http://127.0.0.1:{closed_port()}/repo.git",
], ids=["missing-repo", "connection-refused"])
def test_unreachable_remote_is_an_error_not_drift(remote, tmp_path, make_url):
    (f,) = check(pin(remote, url=make_url(tmp_path)), tmp_path)
    assert f.kind == "error"
    assert "could not resolve the ref: `git ls-remote" in f.message
    assert "this is not drift" in f.action


def test_hanging_remote_times_out_as_an_error(remote, tmp_path):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)  # accepts the TCP connection, never answers
    try:
        t0 = time.monotonic()
        (f,) = check(pin(remote, url=f"http://127.0.0.1:{srv.getsockname()[1]}/r.git"), tmp_path, timeout=1.0)
        elapsed = time.monotonic() - t0
    finally:
        srv.close()
    assert f.kind == "error"
    assert elapsed < 8, elapsed


def test_ls_remote_exact_names_and_peeled_tags(remote):
    remote.tag("v1", remote.c1)
    assert ls_remote(remote.url, PR, 10) == remote.pinned
    assert ls_remote(remote.url, "v1", 10) == remote.c1  # the commit, not the annotated tag object
    assert ls_remote(remote.url, "main", 10) == remote.base
    assert ls_remote(remote.url, "head", 10) is None  # git matches "head" to refs/pull/48/head by tail; we do not
