"""Fixtures for the loadgen tests."""

from __future__ import annotations

import pytest

from services.cluster_config import ensure_model


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    return ensure_model("")
