"""Session fixtures: one real nats-server and one real MinIO per test session, on free ports.

Unit tests of pure cores use neither; they are started lazily by the tests that ask for them.
"""

from __future__ import annotations

import os

# The suite runs gRPC servers and clients in this process and also starts clusters from it
# (fork + exec with a pre-exec hook). gRPC's fork handlers then run in the forked child before
# its exec and can abort it (seen once: a decode child died with "epoll_wait error: Bad file
# descriptor"). The children exec at once and need none of them; set before grpc is imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import pytest  # noqa: E402
import torch

from services.infra.minio_server import MinioServer, start_minio
from services.infra.nats_server import NatsServer, start_nats

torch.set_num_threads(int(os.environ.get("STRATA_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory) -> NatsServer:
    # Open (no NATS auth): service-level tests connect anonymously and use every subject.
    # Auth is on by default in `Cluster` / `strata up` and tested in tests/security/.
    # die_with_parent: a pytest killed mid-run (timeout) leaves no server behind
    server = start_nats(data_dir=str(tmp_path_factory.mktemp("nats")), die_with_parent=True)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def nats_url(nats_server) -> str:
    return nats_server.url


@pytest.fixture(scope="session")
def minio_server(tmp_path_factory) -> MinioServer:
    server = start_minio(data_dir=str(tmp_path_factory.mktemp("minio")), die_with_parent=True)
    yield server
    server.stop()


@pytest.fixture
async def nc(nats_url):
    """A fresh NATS connection per test."""
    from shared.bus import connect

    conn = await connect(nats_url, name="pytest")
    yield conn
    await conn.drain()
