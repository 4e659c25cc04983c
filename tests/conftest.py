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
