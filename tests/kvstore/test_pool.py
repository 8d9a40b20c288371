"""PoolClient over two real kvstore instances: keys split by rendezvous hash, dead = miss."""

from __future__ import annotations

import torch

from shared.kvtransfer.pool import PoolClient, prefix_hits, rendezvous_owner
from tests.kvstore.conftest import block, start_kvstore


def test_rendezvous_is_stable_and_moves_only_lost_keys():
    addrs = ["10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"]
    keys = [f"{i:032x}" for i in range(300)]
    owners = {k: rendezvous_owner(k, addrs) for k in keys}
    counts = {a: sum(1 for o in owners.values() if o == a) for a in addrs}
    assert all(70 <= c <= 130 for c in counts.values()), counts
    survivors = addrs[:2]
    for k in keys:
        moved = rendezvous_owner(k, survivors)
        assert moved == owners[k] or owners[k] == addrs[2]
    assert prefix_hits(["dram", "ssd", None, "dram"]) == 2 and prefix_hits([]) == 0


async def test_two_instances_split_keys_and_dead_instance_is_a_miss(nats_url):
    a = await start_kvstore(nats_url, dram_bytes=1 << 20)
    b = await start_kvstore(nats_url, dram_bytes=1 << 20)
    pool = PoolClient([a.addr, b.addr], timeout=3)
    blocks = {f"{i:032x}": block(i) for i in range(16)}
    stored = await pool.put(blocks, "fp-p")
    assert sorted(stored) == sorted(blocks)
    held = {r.addr: {h for _, h in r.store.core.dram.keys()} for r in (a, b)}
    assert held[a.addr] | held[b.addr] == set(blocks) and not held[a.addr] & held[b.addr]
    assert held[a.addr] and held[b.addr]
    for addr, keys in held.items():
        assert all(pool.owner(h) == addr for h in keys)

    order = list(blocks)
    assert await pool.lookup(order, "fp-p") == ["dram"] * 16
    assert await pool.lookup(order, "other-model") == [None] * 16
    got = await pool.get(order, "fp-p")
    assert all(torch.equal(got[h], blocks[h]) for h in order)

    await b.shutdown()
    tiers = await pool.lookup(order, "fp-p")
    assert tiers == ["dram" if pool.owner(h) == a.addr else None for h in order]
    assert pool.errors == 1
    got = await pool.get(order, "fp-p")
    assert set(got) == held[a.addr] and pool.errors == 2
    assert sorted(await pool.put({order[0]: blocks[order[0]]}, "fp-p")) == (
        [order[0]] if pool.owner(order[0]) == a.addr else []
    )
    await a.shutdown()
