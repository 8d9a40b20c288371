"""kvstore service against real NATS (JetStream), real MinIO and a real gRPC server."""

from __future__ import annotations

import asyncio

import torch
from minio import Minio

from services.infra.minio_server import start_minio
from services.kvstore.ssd import object_name
from shared.bus import request
from shared.kvtransfer.client import KVClient
from shared.protocol import subjects
from shared.protocol.codec import decode
from shared.protocol.kv import KVEvent, KVStoreStats, KVStoreStatsRequest
from shared.protocol.load import LoadReport
from tests.kvstore.conftest import (
    BLOCK_BYTES,
    block,
    block_frames,
    new_bucket,
    start_kvstore,
)


async def push_blocks(client: KVClient, items, fp="fp-a", **kw):
    frames = [f for h, t in items for f in block_frames(h, t, fp, **kw)]
    return await client.push(frames)


async def test_put_get_identical_bytes_query_and_admin(kvstore, nc):
    client = KVClient(kvstore.addr)
    bf16, f32 = block(1, torch.bfloat16), block(2)
    rep = await push_blocks(client, [("h1", bf16), ("h2", f32)])
    assert rep.stored == ["h1", "h2"]
    rep = await push_blocks(client, [("h1", bf16)])  # idempotent
    assert rep.stored == ["h1"] and kvstore.store.core.stats.duplicate_puts == 1
    await push_blocks(client, [("h1", block(9))], fp="fp-b")  # same hash, other model

    got = await client.pull_tensors(["h2", "missing", "h1"], "fp-a")
    assert set(got) == {"h1", "h2"}
    assert got["h1"].dtype == torch.bfloat16 and torch.equal(got["h1"], bf16)
    assert torch.equal(got["h2"], f32)
    other = await client.pull_tensors(["h1"], "fp-b")
    assert torch.equal(other["h1"], block(9))
    assert await client.query(["h1", "h2", "x"], "fp-a") == {"h1": "dram", "h2": "dram"}
    assert await client.query(["h2"], "fp-b") == {}

    stats = await request(
        nc, subjects.admin("kvstore", kvstore.cfg.instance_id), KVStoreStatsRequest(), KVStoreStats
    )
    assert stats.dram_blocks == 3 and stats.dram_leased == 0 and stats.ssd_online
    assert stats.dram_bytes == 3 * (f32.numel() * 4 + 256) - bf16.numel() * 2
    assert stats.grpc_addr == kvstore.addr and stats.counters["hits_dram"] == 3

    sub = await nc.subscribe(subjects.load_report("kvstore", kvstore.cfg.instance_id))
    beat = decode((await sub.next_msg(timeout=3)).data, LoadReport)
    assert beat.role == "kvstore" and beat.grpc_addr == kvstore.addr
    await sub.unsubscribe()
    await client.close()


async def test_eviction_spills_and_get_restores_and_promotes(kvstore, minio_server):
    client = KVClient(kvstore.addr)
    blocks = {f"b{i}": block(i) for i in range(7)}
    await push_blocks(client, list(blocks.items()))
    await kvstore.store.flush()
    tiers = await client.query(list(blocks), "fp-a")
    assert tiers == {
        "b0": "ssd",
        "b1": "ssd",
        "b2": "ssd",
        "b3": "dram",
        "b4": "dram",
        "b5": "dram",
        "b6": "dram",
    }
    mc = Minio(
        minio_server.endpoint, minio_server.access_key, minio_server.secret_key, secure=False
    )
    names = {o.object_name for o in mc.list_objects(kvstore.cfg.minio_bucket, recursive=True)}
    assert names == {"fp-a/b0", "fp-a/b1", "fp-a/b2"}

    got = await client.pull_tensors(["b1"], "fp-a")  # restore from MinIO, promote to DRAM
    assert torch.equal(got["b1"], blocks["b1"])
    assert (await client.query(["b1"], "fp-a")) == {"b1": "dram"}
    s = kvstore.store.core.stats
    assert (s.hits_ssd, s.restores) == (1, 1)
    await kvstore.store.flush()  # b3 (LRU) was evicted by the promotion and spilled
    assert s.spills == 4
    assert (await client.query(["b3"], "fp-a")) == {"b3": "ssd"}
    await client.close()


async def test_restart_gets_hits_from_minio(nats_url, minio_server):
    bucket, one_block = new_bucket(), BLOCK_BYTES // 2 + 256  # float16 block + overhead
    first = await start_kvstore(nats_url, minio_server, bucket, dram_bytes=one_block)
    client = KVClient(first.addr)
    kept, filler = block(5, torch.float16), block(6, torch.float16)
    await push_blocks(client, [("kept", kept), ("filler", filler)], fp="fp-r")
    await first.store.flush()  # "kept" was evicted by "filler" and spilled
    await first.shutdown()
    await client.close()

    second = await start_kvstore(nats_url, minio_server, bucket, dram_bytes=1 << 20)
    client = KVClient(second.addr)
    assert second.store.core.stats.hits_ssd == 0
    assert await client.query(["kept", "filler"], "fp-r") == {"kept": "ssd"}
    got = await client.pull_tensors(["kept", "filler"], "fp-r")
    assert list(got) == ["kept"] and torch.equal(got["kept"], kept)
    assert second.store.core.stats.hits_ssd == 1
    assert await client.query(["kept"], "fp-r") == {"kept": "dram"}  # promoted
    await second.shutdown()
    await client.close()


async def test_events_in_order_on_jetstream_after_commit(kvstore, nc, minio_server):
    iid = kvstore.cfg.instance_id
    mc = Minio(
        minio_server.endpoint, minio_server.access_key, minio_server.secret_key, secure=False
    )
    received: list[tuple[KVEvent, bool]] = []

    async def on_event(msg):
        ev = decode(msg.data, KVEvent)
        committed = all(kvstore.store.core.lookup(("fp-a", h)) is not None for h in ev.hashes)
        if ev.tier == "ssd" and ev.kind == "stored":  # the object must already exist
            committed = committed and all(
                mc.stat_object(kvstore.cfg.minio_bucket, object_name(("fp-a", h))) is not None
                for h in ev.hashes
            )
        received.append((ev, committed))
        await msg.ack()

    js = nc.jetstream()
    sub = await js.subscribe(subjects.kv_events(iid), cb=on_event, manual_ack=True)
    client = KVClient(kvstore.addr)
    await push_blocks(client, [(f"e{i}", block(i)) for i in range(6)])
    await kvstore.store.flush()
    for _ in range(200):
        if len(received) >= kvstore.store.core.last_seq:
            break
        await asyncio.sleep(0.02)
    await sub.unsubscribe()
    evs = [e for e, _ in received]
    assert [e.seq for e in evs] == list(range(1, len(evs) + 1)) and len(evs) == 10
    assert {e.incarnation for e in evs} == {kvstore.store.core.incarnation}
    dram_stored = [e.hashes[0] for e in evs if (e.tier, e.kind) == ("dram", "stored")]
    assert dram_stored == [f"e{i}" for i in range(6)]
    for h in ("e0", "e1"):  # spills run concurrently; per block the order is fixed
        steps = [(e.tier, e.kind) for e in evs if e.hashes == [h]]
        assert steps == [("dram", "stored"), ("ssd", "stored"), ("dram", "removed")]
    assert all(ok for e, ok in received if e.kind == "stored")
    await client.close()


async def test_minio_down_degrades_then_spill_resumes(nats_url, tmp_path):
    minio = start_minio(data_dir=str(tmp_path / "minio"))
    try:
        kv = await start_kvstore(nats_url, minio, dram_bytes=2 * (BLOCK_BYTES + 256))
        client = KVClient(kv.addr)
        await push_blocks(client, [("a", block(1)), ("b", block(2)), ("c", block(3))])
        await kv.store.flush()
        assert await client.query(["a", "b", "c"], "fp-a") == {"a": "ssd", "b": "dram", "c": "dram"}

        minio.stop()
        # puts still succeed (DRAM); "b" is evicted and cannot spill yet but stays readable
        rep = await push_blocks(client, [("d", block(4))])
        assert rep.stored == ["d"]
        got = await client.pull_tensors(["b", "d", "a"], "fp-a")
        assert set(got) == {"b", "d"} and torch.equal(got["b"], block(2))  # "a": a miss
        await asyncio.sleep(0.5)  # a few spill retries fail
        stats = kv.store.stats()
        assert stats["ssd_online"] is False and stats["pending_spill_blocks"] == 1
        assert stats["counters"]["spill_failures"] >= 1 and stats["counters"]["misses"] == 1
        assert await client.query(["a", "b"], "fp-a") == {"a": "ssd", "b": "dram"}

        minio.start()  # same data dir and port
        await kv.store.flush(timeout=60)  # MinIO restarts slowly on a loaded box
        assert kv.store.ssd_online and kv.store.core.stats.spills == 2
        assert await client.query(["a", "b"], "fp-a") == {"a": "ssd", "b": "ssd"}
        got = await client.pull_tensors(["a"], "fp-a")
        assert torch.equal(got["a"], block(1))
        await kv.shutdown()
        await client.close()
    finally:
        minio.stop()
