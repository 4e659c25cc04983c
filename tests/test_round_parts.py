"""Round building blocks: balanced schedule, seeded prompt, ubatch padding, candidate resolution, worker env."""

from __future__ import annotations

import collections
import subprocess
from pathlib import Path

import pytest

from scoreboard.errors import InputError
from scoreboard.round.candidate import import_root, resolve
from scoreboard.round.prompt import draw_prompt
from scoreboard.round.schedule import balanced_schedule
from scoreboard.round.stages import SHORT_UBATCH, padded
from scoreboard.round.launch import SECRET_ENV, worker_env


def test_schedule_is_balanced_seeded_and_not_reference_first():
    s = balanced_schedule(["reference", "candidate"], 8, seed=3)
    firsts = collections.Counter(order[0] for order in s)
    assert firsts["reference"] == firsts["candidate"] == 4
    assert s == balanced_schedule(["reference", "candidate"], 8, seed=3)
    assert any(balanced_schedule(["reference", "candidate"], 8, seed=k) != s for k in range(4, 10))
    three = balanced_schedule(["reference", "candidate", "main"], 6, seed=1)
    for pos in range(3):
        assert len({order[pos] for order in three}) == 3 and collections.Counter(o[pos] for o in three) == \
            collections.Counter({"reference": 2, "candidate": 2, "main": 2})


class _Tok:
    def encode(self, text):
        return [ord(c) % 256 for c in text]


def test_prompt_is_reproducible_by_seed_and_long_enough():
    a = draw_prompt(_Tok(), 5000, seed=9)
    assert len(a.token_ids) == 5000  # tiled past the corpus length
    assert a == draw_prompt(_Tok(), 5000, seed=9)
    assert a.token_ids != draw_prompt(_Tok(), 5000, seed=10).token_ids
    assert a.describe()["seed"] == 9 and len(a.describe()["token_ids_sha256"]) == 64


def test_padding_avoids_short_ubatches_and_keeps_the_prefix():
    ids = tuple(range(1055))
    p = padded(ids, 512, 2048, (7,))
    assert p[:1055] == ids and len(p) % 512 == 0
    assert padded(tuple(range(1024)), 512, 2048, (7,)) == tuple(range(1024))  # no tail
    assert padded(tuple(range(1100)), 512, 2048, (7,)) == tuple(range(1100))  # tail of 76 >= 64
    assert len(padded(tuple(range(1000)), 512, 1010, (7,))) == 1000  # cannot pad within n_ctx: unchanged
    assert SHORT_UBATCH == 64


def _git(*args, cwd):
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def test_candidate_resolution(tmp_path: Path):
    repo = tmp_path / "repo"
    (repo / "engines").mkdir(parents=True)
    (repo / "engines" / "__init__.py").write_text("")
    _git("init", "-q", "-b", "main", cwd=repo)
    _git("-c", "user.email=t@t", "-c", "user.name=t", "add", "-A", cwd=repo)
    _git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "x", cwd=repo)
    head = _git("rev-parse", "HEAD", cwd=repo)
    (tmp_path / "cache").mkdir()  # the round's private scratch root: git arms are exported into it
    main = resolve("main", tmp_path / "cache", repo=repo)
    assert main.is_main and main.commit == head and not main.dirty
    rev = resolve(head, tmp_path / "cache", repo=repo)
    assert not rev.is_main and rev.commit == head and (rev.root / "engines").is_dir() and rev.root != repo
    path = resolve(str(repo), tmp_path / "cache", repo=repo)
    assert not path.is_main and path.commit == head
    with pytest.raises(InputError, match="neither 'main'"):
        resolve("no-such-rev", tmp_path / "cache", repo=repo)
    assert import_root(rev, tmp_path / "cache") == rev.root  # a clean export: only the candidate's code
    assert [p.name for p in rev.root.iterdir()] == ["engines"]  # never scoreboard, never the checkout
    shim = import_root(path, tmp_path / "cache")  # a development tree: a shim holding only its engines/
    assert (shim / "engines").resolve() == (repo / "engines").resolve()
    assert [p.name for p in shim.iterdir()] == ["engines"]


def test_the_harness_records_never_make_main_dirty(tmp_path: Path):
    """A sealed round appends to rounds/ledger.jsonl and rewrites reference.lock: that is the harness's own
    record, not a change to what the candidate runs, so the next main round may still move a frontier."""
    repo = tmp_path / "repo"
    (repo / "engines").mkdir(parents=True)
    (repo / "rounds").mkdir()
    (repo / "engines" / "e.py").write_text("x = 1\n")
    (repo / "rounds" / "ledger.jsonl").write_text("")
    (repo / "reference.lock").write_text("schema = 1\n")
    _git("init", "-q", "-b", "main", cwd=repo)
    _git("-c", "user.email=t@t", "-c", "user.name=t", "add", "-A", cwd=repo)
    _git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "x", cwd=repo)
    (repo / "rounds" / "ledger.jsonl").write_text("{}\n")
    (repo / "reference.lock").write_text("schema = 1\n# slots moved\n")
    (tmp_path / "cache").mkdir()
    assert not resolve("main", tmp_path / "cache", repo=repo).dirty
    (repo / "sitecustomize.py").write_text("")  # untracked files count: they run in any Python started there
    assert resolve("main", tmp_path / "cache", repo=repo).dirty
    (repo / "sitecustomize.py").unlink()
    (repo / "engines" / "e.py").write_text("x = 2\n")
    assert resolve("main", tmp_path / "cache", repo=repo).dirty


def test_worker_env_strips_secrets(monkeypatch, tmp_path):
    for k in SECRET_ENV:
        monkeypatch.setenv(k, "secret")
    env = worker_env(tmp_path)
    assert not any(k in env for k in SECRET_ENV)
    assert env["PYTHONPATH"].split(":")[0] == str(tmp_path)


def test_the_engine_contract_version_of_a_commit_is_read_from_its_own_git_objects():
    """A main round re-measures the frontier's commit only when that commit speaks this harness's engine
    contract; the committed frontier (set before the clock handshake) speaks version 1."""
    from scoreboard.engine import CONTRACT_VERSION
    from scoreboard.round.candidate import contract_version

    assert contract_version("922ce13e287f8b95cb63c8e3fc0e6d5369365eec") == 1
    assert contract_version("HEAD") == CONTRACT_VERSION == 3
