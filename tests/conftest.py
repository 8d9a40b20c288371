"""Session fixtures: one real nats-server and one real MinIO per test session, on free ports.

Unit tests of pure cores use neither; they are started lazily by the tests that ask for them.

With pytest-xdist (`scripts/test.sh` runs ``-n 2 --dist loadgroup``), every test that starts
clusters or servers of its own (`SERIAL_DIRS`, and any test marked ``e2e``) joins one xdist group,
so those run one after another on one worker, as in a serial run; the other worker takes the
in-process tests beside them, a module at a time.
"""

from __future__ import annotations

import os

# The suite runs gRPC servers and clients in this process and also starts clusters from it
# (fork + exec with a pre-exec hook). gRPC's fork handlers then run in the forked child before
# its exec and can abort it (seen once: a decode child died with "epoll_wait error: Bad file
# descriptor"). The children exec at once and need none of them; set before grpc is imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch

from services.infra.minio_server import MinioServer, start_minio
from services.infra.nats_server import NatsServer, start_nats

torch.set_num_threads(int(os.environ.get("STRATA_TEST_THREADS", "1")))

SERIAL_DIRS = frozenset(
    {"acceptance", "cluster", "cluster_kv", "compose", "e2e", "infra", "multihost", "security"}
)
"""Test directories whose tests start whole clusters, `strata up`, dockerd or network
namespaces: under xdist they run in one group ("cluster"), never two at once."""


def serial(item: pytest.Item) -> bool:
    """Whether ``item`` belongs to the one-at-a-time group (`SERIAL_DIRS` or marked ``e2e``)."""
    here = Path(__file__).parent
    path = Path(str(item.path))
    parts = path.relative_to(here).parts if path.is_relative_to(here) else ()
    in_dir = len(parts) > 1 and parts[0] in SERIAL_DIRS
    return in_dir or item.get_closest_marker("e2e") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not getattr(config.option, "numprocesses", None):  # not distributed by xdist
        return
    for item in items:  # the others by module: a module's fixtures are made on one worker
        group = "cluster" if serial(item) else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))


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
