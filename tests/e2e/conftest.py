"""One real cluster per e2e module: nats-server, MinIO and every service as subprocesses,
started through the same entry point as `strata up`."""

from __future__ import annotations

import os

import pytest

from services.cluster_config import ensure_model
from services.launcher import Cluster


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    return ensure_model("")


def start_cluster(model_dir: str, **overrides) -> Cluster:
    overrides.setdefault("ready_timeout", 240.0)
    overrides.setdefault("die_with_parent", True)
    return Cluster(model_dir, log_stream=open(os.devnull, "w"), **overrides).start()
