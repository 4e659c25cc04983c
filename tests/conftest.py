"""Shared pytest fixtures: repository paths."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def repo_root() -> Path:
    return REPO


@pytest.fixture
def lock_path() -> Path:
    return REPO / "reference.lock"
