"""Multi-host fixtures: a private network of namespaces per test, or one per module for tests
that share a deployment (skipped, with the reason, where network namespaces are not usable: not
root, or no iproute2)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest

from tests.multihost.netns import Net, netns_unusable, sweep_leftovers

_WHY = netns_unusable()


@contextlib.contextmanager
def _nets() -> Iterator[Callable[[int], Net]]:
    """``make(hosts)`` -> a started `Net`; every one is closed on the way out, even on failure."""
    if _WHY:
        pytest.skip(f"multi-host tests need network namespaces: {_WHY}")
    swept = sweep_leftovers()
    if swept:
        print(f"removed {len(swept)} namespaces left by killed runs: {', '.join(swept)}")
    nets: list[Net] = []

    def make(hosts: int) -> Net:
        net = Net(hosts)
        nets.append(net)
        return net.up()

    try:
        yield make
    finally:
        for net in nets:
            net.close()


@pytest.fixture
def net_factory():
    with _nets() as make:
        yield make


@pytest.fixture(scope="module")
def module_net_factory():
    """`net_factory` for a deployment the tests of one module share."""
    with _nets() as make:
        yield make
