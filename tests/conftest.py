"""Shared pytest fixtures: repository paths; tests marked `gpu` are skipped where no CUDA device is."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Without a GPU, Triton kernels (engines/sparkinfer/kernels.py) can run only in Triton's interpreter, which is
# chosen when `triton` is first imported: set it before any test module imports it. A machine with an NVIDIA
# driver compiles them for real instead.
if not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The declared `gpu` marker (pyproject) skips its tests without a CUDA device; torch is only imported
    when some collected test carries it."""
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu or _cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked gpu)")
    for item in gpu:
        item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def session_signer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's signing key, outside every checkout: every record a test seals is signed, and a test lock
    that starts a fresh history pins it (signer_fixtures)."""
    from signer_fixtures import make_session_key

    return make_session_key(tmp_path_factory.mktemp("signer"))


@pytest.fixture
def repo_root() -> Path:
    return REPO


@pytest.fixture
def lock_path() -> Path:
    return REPO / "reference.lock"


@pytest.fixture(scope="session")
def main_round_history(session_signer: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real, sealed main round of this checkout's HEAD on k3-mini-cpu (pinned llama.cpp build, sparkinfer in
    sandboxed workers), run once per session: a directory holding reference.lock (the repo's, slots zeroed, speed
    policy shrunk to 2 blocks of 1 rep) and rounds/ (the committed calibration, the round's receipt and ledger
    lines). Tests that need a history whose first main round set the BASELINE work on their own copy of it
    (shutil.copytree) and assert what they need of that round's receipt (`main_round_receipt`)."""
    from calibration_fixtures import seed_calibration
    from receipt_factory import shrunk_lock

    from scoreboard.round.run import RoundOptions, run_round
    from scoreboard.weights.verify import default_cache

    d = tmp_path_factory.mktemp("main-round-history")
    lock = shrunk_lock(d / "reference.lock", "k3-mini-cpu")
    rounds = seed_calibration(d / "rounds")
    out = run_round(RoundOptions(target="k3-mini-cpu", lock_path=lock, rounds_dir=rounds, cache_dir=default_cache(),
                                 seed=11))
    assert out.receipt["status"] == "verdict", out.receipt.get("aborted")
    assert out.path is not None and out.path.parent == rounds
    return d


def main_round_receipt(history: Path) -> dict:
    """The receipt of `main_round_history`'s round (the only round receipt in its rounds/)."""
    import json

    (path,) = sorted((history / "rounds").glob("*.json"))
    return json.loads(path.read_text(encoding="utf-8"))
