"""Distributed MinIO (erasure-coded, one drive on each of four namespace hosts) as the SSD tier:
the kvstore's `MinioTier` gets the comma-separated endpoints of every node. Killing the node it
talks to keeps the tier readable (blocks written before the kill) and writable (new blocks):
the tier moves to another endpoint (``failovers``) and the erasure code serves the rest.

Four hosts with one drive each, not two with two: with 4 drives MinIO's default parity is 2,
and a write needs data+1 = 3 drives when parity equals data, so losing a host with two of the
four drives leaves the tier readable but not writable."""

from __future__ import annotations

import os

import pytest

from services.infra.minio_server import MinioCredentials
from tests.multihost.hosts import MinioCluster

pytestmark = pytest.mark.timeout(180)

MINIO_HOSTS = (1, 2, 3, 4)
CLIENT_HOST = 5
PORT = 9000


def blocks(tag: str, n: int = 8) -> dict[tuple[str, str], bytes]:
    return {("fp", f"{tag}-{k}"): os.urandom(64 * 1024) for k in range(n)}


def scenario(minio: MinioCluster) -> dict:
    minio.wait_healthy()
    minio.provision()  # the KV bucket and the kvstore's bucket-limited user
    minio.wait_serving()
    tier = minio.tier(timeout=2.0)
    before = blocks("before")
    locs = {k: tier.put(k, v) for k, v in before.items()}
    first = tier.current
    minio.kill(first)
    read_back = {k: tier.get(loc) for k, loc in locs.items()}
    after = blocks("after")
    for k, v in after.items():
        tier.put(k, v)
    return {
        "killed": MINIO_HOSTS[first],
        "failovers": tier.failovers,
        "now_on": tier.endpoints[tier.current],
        "before_ok": read_back == before,
        "after_ok": {k: tier.get_key(k) for k in after} == after,
        "listed": len(tier.list("fp").blocks),
    }


def test_losing_one_minio_node_keeps_the_ssd_tier_readable_and_writable(net_factory, tmp_path):
    net = net_factory(len(MINIO_HOSTS) + 1)
    creds = MinioCredentials.load_or_create(str(tmp_path / "creds.json"))
    minio = MinioCluster(net, tmp_path, creds, [(i, PORT) for i in MINIO_HOSTS])
    out = net.run_in(CLIENT_HOST, lambda: scenario(minio))
    print(
        f"killed minio on host {out['killed']}, tier now on {out['now_on']} "
        f"after {out['failovers']} failover(s)"
    )
    assert out["failovers"] >= 1 and not out["now_on"].startswith(net.addr(out["killed"]) + ":")
    assert out["before_ok"], "a block written before the kill did not read back"
    assert out["after_ok"], "a block written after the kill did not read back"
    assert out["listed"] == 16
