"""Hugging Face weights pins against a stand-in Hub on 127.0.0.1, with the real huggingface_hub client:
re-uploaded shard, changed size, extra, missing and re-split shards, vanished revision (drift); HTTP 500,
429, a timeout, connection refused (errors); unpinned; `pin weights` recording the pins."""

from __future__ import annotations

import hashlib
import time

import pytest

from audit_fixtures import closed_port, generated_weights_toml, pins_of, shard_bytes, weights_toml, write_lock
from scoreboard.errors import InputError, PinError
from scoreboard.lockfile import load_lock, parse_lock
from scoreboard.pins.hub import apply_weights_pin, check_weights, plan_weights_pin
from standin_hub import Fault, StandinHub

REPO = "unsloth/Kimi-K3-GGUF"
Q = "UD-IQ1_S"


def shards(n: int, prefix: str = Q, size: int = 1000) -> dict[str, bytes]:
    return {f"{prefix}/K3-{prefix}-{i:05d}-of-{n:05d}.gguf": shard_bytes(i, size) for i in range(1, n + 1)}


@pytest.fixture
def hub():
    with StandinHub() as h:
        h.files = {"README.md": b"# card", **shards(3), **shards(2, "UD-Q2_K_XL")}
        h.rev = h.commit(REPO, h.files)
        yield h


def weights(hub, revision=None, files=None):
    text = "schema = 1\n" + weights_toml("w", REPO, hub.rev if revision is None else revision,
                                         pins_of(files or shards(3)), Q)
    return parse_lock(text).weights["w"]


def check(hub, w=None, timeout=5.0):
    return check_weights("w", w or weights(hub), endpoint=hub.url, timeout=timeout, targets=("t",))


def drift_subjects(findings):
    assert all(f.kind == "drift" for f in findings), [(f.kind, f.message) for f in findings]
    return [f.subject for f in findings]


def test_pinned_weights_hold_without_downloading(hub):
    (f,) = check(hub)
    assert f.kind == "ok" and f.now == hub.rev
    assert "3 file(s)" in f.message and "file set, sizes and LFS sha256 match" in f.message
    paths = [p for _, p in hub.requests]
    assert not [p for p in paths if "/resolve/" in p], "the audit must not download"
    assert paths == [f"/api/models/{REPO}/revision/{hub.rev}", f"/api/models/{REPO}/tree/{hub.rev}/{Q}",
                     f"/api/models/{REPO}/paths-info/{hub.rev}"]


def test_reuploaded_shard_with_a_new_hash_is_drift(hub):
    p = f"{Q}/K3-{Q}-00002-of-00003.gguf"
    new = bytes(reversed(hub.files[p]))  # same size, other bytes
    hub.put(REPO, hub.rev, p, new)
    (f,) = check(hub)
    assert f.kind == "drift" and f.subject == f"{p} sha256"
    assert (f.was, f.now) == (hashlib.sha256(hub.files[p]).hexdigest(), hashlib.sha256(new).hexdigest())
    assert "re-uploaded shard" in f.message
    assert "`scoreboard pin weights --target t --revision <sha>`" in f.action and "re-measure" in f.action


def test_changed_size_is_drift(hub):
    p = f"{Q}/K3-{Q}-00001-of-00003.gguf"
    hub.put(REPO, hub.rev, p, hub.files[p] + b"x")
    size, sha = drift_subjects(check(hub))
    assert (size, sha) == (f"{p} size", f"{p} sha256")


def test_extra_shard_is_drift(hub):
    hub.put(REPO, hub.rev, f"{Q}/K3-{Q}-00004-of-00003.gguf", b"extra")
    (f,) = check(hub)
    assert f.kind == "drift" and f.subject == f"{Q}/K3-{Q}-00004-of-00003.gguf"
    assert f.was == "(not pinned)" and f.now.startswith("5 B sha256 ")
    assert "--accept-file-set" in f.action


def test_missing_shard_is_drift_although_paths_info_drops_it_silently(hub):
    p = f"{Q}/K3-{Q}-00003-of-00003.gguf"
    hub.put(REPO, hub.rev, p, None)
    (f,) = check(hub)
    assert f.kind == "drift" and f.subject == p and f.now == "(missing)"


def test_resplit_shards_are_drift(hub):
    for p in shards(3):
        hub.put(REPO, hub.rev, p, None)
    for p, c in shards(4, size=750).items():
        hub.put(REPO, hub.rev, p, c)
    findings = check(hub)
    subjects = drift_subjects(findings)
    assert subjects[0] == f"file set under {Q}/"
    assert "3 file(s) pinned, 4 on the Hub (3 missing, 4 extra): re-split" in findings[0].message
    assert len(subjects) == 1 + 3 + 4


def test_root_level_shards_compare_only_root_files_of_their_kind(hub):
    root = {"K3-Q8_0.gguf": shard_bytes(9)}
    rev = hub.commit(REPO, root, parent=hub.rev)  # next to README.md and the quant folders
    w = parse_lock("schema = 1\n" + weights_toml("w", REPO, rev, pins_of(root))).weights["w"]
    assert [f.kind for f in check(hub, w)] == ["ok"]
    hub.put(REPO, rev, "K3-Q4_0.gguf", b"another root-level gguf")
    (f,) = check(hub, w)
    assert f.kind == "drift" and f.subject == "K3-Q4_0.gguf" and "extra file in /" in f.message


def test_vanished_revision_is_drift(hub):
    new = hub.squash(REPO)
    (f,) = check(hub)
    assert f.kind == "drift" and f.subject == f"revision {hub.rev[:12]}…" and f.now == "(missing)"
    assert "the Hub has no such revision (HTTP 404)" in f.message
    assert new != hub.rev


def test_vanished_repo_is_drift(hub):
    del hub.repos[REPO]
    (f,) = check(hub)
    assert f.kind == "drift" and "repository not found" in f.message


@pytest.mark.parametrize("endpoint,status", [("revision", 500), ("paths-info", 500), ("revision", 429),
                                             ("paths-info", 503)])
def test_api_failure_is_an_error_not_drift(hub, endpoint, status):
    hub.faults[endpoint] = Fault(status=status)
    (f,) = check(hub)
    assert f.kind == "error", f
    assert f"HTTP {status}" in f.message and "this is not drift" in f.action


def test_timeout_is_an_error(hub):
    hub.faults["revision"] = Fault(sleep=3.0)
    t0 = time.monotonic()
    (f,) = check(hub, timeout=0.5)
    assert time.monotonic() - t0 < 2.5
    assert f.kind == "error" and "timed out after 0.5 s" in f.message


def test_paths_info_timeout_is_an_error(hub):
    hub.faults["paths-info"] = Fault(sleep=3.0)  # get_paths_info takes no timeout: the client factory's applies
    (f,) = check(hub, timeout=0.5)
    assert f.kind == "error" and "timed out" in f.message


def test_connection_refused_is_an_error():
    w = parse_lock("schema = 1\n" + weights_toml("w", REPO, "a" * 40, pins_of(shards(1)))).weights["w"]
    (f,) = check_weights("w", w, endpoint=f"http://127.0.0.1:{closed_port()}", timeout=2)
    assert f.kind == "error" and "ConnectError" in f.message


def test_unpinned_weights_are_reported_with_the_command_to_pin_them(hub):
    w = weights(hub, revision="", files=shards(3))
    w = w.model_copy(update={"files": tuple(f.model_copy(update={"size": 0, "sha256": ""}) for f in w.files)})
    (f,) = check(hub, w)
    assert f.kind == "unpinned"
    assert f"The Hub's main is at {hub.rev}" in f.message
    assert f.action == f"review the upload, then `scoreboard pin weights --target t --revision {hub.rev}`"
    hub.faults["model"] = Fault(status=500)  # the hint's look-up failing does not turn unpinned into an error
    (f,) = check(hub, w)
    assert f.kind == "unpinned" and "Could not look up" in f.message and "<sha>" in f.action


def test_generated_weights_are_local():
    w = parse_lock("schema = 1\n" + generated_weights_toml("g")).weights["g"]
    (f,) = check_weights("g", w, endpoint="http://127.0.0.1:9", timeout=1)
    assert f.kind == "ok" and f.message == "local (generated; verified by `scoreboard weights verify`)"


# ------------------------------------------------------------------------------------------------
# scoreboard pin weights


def unpinned_lock(tmp_path, paths):
    rows = [(p, 0, "") for p in paths]
    return write_lock(tmp_path / "reference.lock", [
        '[references.r]\nkind = "pypi-sdist"\npackage = "p"\nversion = "1"\nsha256 = "%s"\nsubdir = "s"\n' % ("b" * 64),
        weights_toml("w", REPO, "", rows, Q)], {"t": ("r", "w")})


def test_pin_weights_records_sizes_and_hashes_keeping_comments(hub, tmp_path):
    lock = unpinned_lock(tmp_path, sorted(shards(3)))
    before = lock.read_text()
    plan = plan_weights_pin(load_lock(lock), "t", hub.rev, endpoint=hub.url, timeout=5)
    assert ("revision", '""', hub.rev) in plan.changes
    apply_weights_pin(lock, plan)
    after = lock.read_text()
    assert "# pinned shards: keep this comment" in after and "# slot comment" in after
    w = load_lock(lock).weights["w"]
    assert w.fully_pinned and w.revision == hub.rev
    assert [(f.path, f.size, f.sha256) for f in w.files] == pins_of(shards(3))
    assert after.split("[slots]")[1] == before.split("[slots]")[1]  # slots untouched
    assert check_weights("w", w, endpoint=hub.url, timeout=5)[0].kind == "ok"
    # pinning again at the same revision changes nothing
    assert plan_weights_pin(load_lock(lock), "t", hub.rev, endpoint=hub.url, timeout=5).changes == ()


def test_pin_weights_refuses_a_different_file_set_unless_accepted(hub, tmp_path):
    declared = sorted(shards(3))[:2] + [f"{Q}/K3-{Q}-00009-of-00003.gguf"]
    lock = unpinned_lock(tmp_path, declared)
    before = lock.read_text()
    with pytest.raises(PinError) as info:
        plan_weights_pin(load_lock(lock), "t", hub.rev, endpoint=hub.url, timeout=5)
    assert f"  - {Q}/K3-{Q}-00009-of-00003.gguf (in the lock, not on the Hub)" in info.value.message
    assert f"  + {Q}/K3-{Q}-00003-of-00003.gguf (on the Hub, not in the lock)" in info.value.message
    assert "--accept-file-set" in info.value.hint
    assert lock.read_text() == before
    plan = plan_weights_pin(load_lock(lock), "t", hub.rev, accept_file_set=True, endpoint=hub.url, timeout=5)
    apply_weights_pin(lock, plan)
    assert [f.path for f in load_lock(lock).weights["w"].files] == sorted(shards(3))


def test_pin_weights_refuses_bad_revisions(hub, tmp_path):
    lock = load_lock(unpinned_lock(tmp_path, sorted(shards(3))))
    with pytest.raises(InputError, match="full 40-hex Hub commit"):
        plan_weights_pin(lock, "t", "main", endpoint=hub.url)
    with pytest.raises(InputError, match="no such revision"):
        plan_weights_pin(lock, "t", "f" * 40, endpoint=hub.url)
    with pytest.raises(InputError, match="unknown target 'tt'"):
        plan_weights_pin(lock, "tt", hub.rev, endpoint=hub.url)


def test_standin_resolve_headers_agree_with_paths_info(hub):
    """The stand-in's download metadata matches its metadata API, as the real Hub's does."""
    from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_url

    p = f"{Q}/K3-{Q}-00001-of-00003.gguf"
    meta = get_hf_file_metadata(hf_hub_url(REPO, p, revision=hub.rev, endpoint=hub.url), token=False)
    (info,) = HfApi(endpoint=hub.url, token=False).get_paths_info(REPO, [p], revision=hub.rev)
    assert (meta.commit_hash, meta.etag, meta.size) == (hub.rev, info.lfs.sha256, info.size)
