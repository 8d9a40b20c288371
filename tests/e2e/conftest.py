"""One real cluster per e2e module: nats-server, MinIO and every service as subprocesses,
started through the same entry point as `strata up`."""

from __future__ import annotations

import pytest

from loadtests.simulator.realcluster import start_cluster as retrying_start
from services.cluster_config import ensure_model
from services.launcher import Cluster


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    return ensure_model("")


def start_cluster(model_dir: str, **overrides) -> Cluster:
    """`Cluster(...).start()`, again when a port picked free was taken meanwhile (CI saw a
    kvstore's gRPC port taken by another process between picking and binding)."""
    return retrying_start(model_dir, **overrides)
