"""Multi-host fixtures: a private network of namespaces per test (skipped, with the reason,
where network namespaces are not usable: not root, or no iproute2)."""

from __future__ import annotations

import pytest

from tests.multihost.netns import Net, netns_unusable, sweep_leftovers

_WHY = netns_unusable()


@pytest.fixture
def net_factory():
    """``make(hosts)`` -> a started `Net`; every one is closed after the test, even on failure."""
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
