"""The SSD tier's budget (``ssd_bytes``) against real MinIO and NATS: least recently used objects
are deleted whole, their blocks leave the kvstore's index with ``ssd removed`` events, and a block
read recently survives."""

from __future__ import annotations

import asyncio

import torch

from services.kvstore import metrics as kvm
from shared.kvtransfer.client import KVClient
from shared.protocol import subjects
from shared.protocol.codec import decode
from shared.protocol.kv import KVEvent
from tests.kvstore.conftest import BLOCK_BYTES, block, block_frames, new_bucket, start_kvstore

FP = "fp-budget"


def bucket_contents(store) -> tuple[int, set[str]]:
    """(bytes of every object in the kvstore's bucket, block hashes those objects hold)."""
    tier = store.ssd
    total, hashes = 0, set()
    for obj in tier.client.list_objects(tier.bucket, recursive=True):
        total += obj.size
    listing = tier.list()
    hashes.update(k[1] for k, _ in listing.blocks)
    for _, name in listing.chunks:
        hashes.update(tier.read_chunk_index(name))
    return total, hashes


async def settled(kv, events: list[KVEvent]) -> None:
    """Flush SSD writes, deletes and events, then wait until this subscriber has every event."""
    await kv.store.flush()
    for _ in range(500):
        if events and events[-1].seq >= kv.store.core.last_seq:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"events up to {kv.store.core.last_seq} not received")


def collector(events: list[KVEvent]):
    async def on_event(msg) -> None:
        events.append(decode(msg.data, KVEvent))

    return on_event


def last_ssd_event(events: list[KVEvent]) -> dict[str, str]:
    last: dict[str, str] = {}
    for ev in events:
        if ev.tier == "ssd":
            for h in ev.hashes:
                last[h] = ev.kind
    return last


async def test_lru_objects_evicted_under_budget_hot_block_survives(nats_url, nc, minio_server):
    budget = 10 * BLOCK_BYTES
    bucket, iid = new_bucket(), "kv-budget-1"
    events: list[KVEvent] = []
    sub = await nc.subscribe(subjects.kv_events(iid), cb=collector(events))
    evicted_metric = kvm.SSD_EVICTED_OBJECTS._value.get()
    kv = await start_kvstore(
        nats_url,
        minio_server,
        bucket,
        instance_id=iid,
        dram_bytes=4 * (BLOCK_BYTES + 256) + 10,
        ssd_bytes=budget,
    )
    client = KVClient(kv.addr)
    await client.push(block_frames("hot", block(1000), FP))
    await settled(kv, events)
    pushed = ["hot"]
    for r in range(8):
        cold = [f"c{r}-{i}" for i in range(4)]
        frames = [f for i, h in enumerate(cold) for f in block_frames(h, block(r * 10 + i), FP)]
        await client.push(frames)
        pushed += cold
        await settled(kv, events)
        got = await client.pull_tensors(["hot"], FP)  # the hot block is read every round
        assert "hot" in got and torch.equal(got["hot"], block(1000))
        await settled(kv, events)
        used, _ = bucket_contents(kv.store)
        assert used <= budget and kv.store.core.ssd_bytes == used

    core = kv.store.core
    assert core.stats.ssd_evicted_objects > 0
    assert kvm.SSD_EVICTED_OBJECTS._value.get() - evicted_metric == core.stats.ssd_evicted_objects
    used, in_bucket = bucket_contents(kv.store)
    indexed = {h for (fp, h) in core.ssd if fp == FP}
    assert indexed == in_bucket  # the index and the bucket agree
    last = last_ssd_event(events)
    gone = {h for h in pushed if last.get(h) == "removed"}
    assert gone and gone == set(pushed) - indexed  # "ssd removed" for exactly the evicted ones
    assert not gone & in_bucket
    removed = sum(len(e.hashes) for e in events if e.tier == "ssd" and e.kind == "removed")
    assert removed == core.stats.ssd_evicted_blocks
    assert "hot" in indexed and last["hot"] == "stored"  # read every round: never the LRU
    assert {"c0-0", "c0-1", "c0-2", "c0-3"} <= gone  # written before the hot block's last read

    # A restart with a smaller budget: the blocks listed at start-up count, the oldest go.
    await kv.shutdown()
    await client.close()
    await sub.unsubscribe()
    events.clear()
    iid2 = "kv-budget-2"
    sub = await nc.subscribe(subjects.kv_events(iid2), cb=collector(events))
    small = 6 * BLOCK_BYTES
    kv = await start_kvstore(nats_url, minio_server, bucket, instance_id=iid2, ssd_bytes=small)
    await settled(kv, events)
    used, in_bucket = bucket_contents(kv.store)
    assert 0 < used <= small and kv.store.core.ssd_bytes == used
    assert {h for _, h in kv.store.core.ssd} == in_bucket
    last = last_ssd_event(events)
    gone = {h for h, kind in last.items() if kind == "removed"}
    assert gone and gone == indexed - in_bucket
    await kv.shutdown()
    await sub.unsubscribe()
