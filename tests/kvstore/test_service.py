"""kvstore service against real NATS (JetStream), real MinIO and a real gRPC server."""

from __future__ import annotations

import asyncio

import torch
from minio import Minio

from services.infra.minio_server import start_minio
from services.kvstore import metrics as kvm
from services.kvstore.ssd import MinioTier
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


async def test_write_behind_chunks_and_eviction_needs_no_spill(kvstore, minio_server):
    client = KVClient(kvstore.addr)
    blocks = {f"b{i}": block(i) for i in range(7)}
    await push_blocks(client, list(blocks.items())[:4])  # DRAM holds 4
    await kvstore.store.flush()  # write-behind: all 4 in MinIO while still in DRAM
    s = kvstore.store.core.stats
    assert (s.persists, s.spills) == (4, 0)
    assert await client.query(list(blocks)[:4], "fp-a") == {f"b{i}": "dram" for i in range(4)}
    await push_blocks(client, list(blocks.items())[4:])  # evicts b0-b2: already persisted
    await kvstore.store.flush()
    assert (s.persists, s.spills) == (7, 0)
    tiers = await client.query(list(blocks), "fp-a")
    assert tiers == {f"b{i}": "ssd" if i < 3 else "dram" for i in range(7)}

    tier = MinioTier(
        minio_server.endpoint,
        minio_server.access_key,
        minio_server.secret_key,
        kvstore.cfg.minio_bucket,
    )
    listing = tier.list()
    assert listing.blocks == [] and 2 <= len(listing.chunks) <= 7  # small blocks: chunks only
    indexed = {}
    for _, name in listing.chunks:
        indexed.update(tier.read_chunk_index(name))
    assert sorted(indexed) == sorted(blocks)
    assert all(kvstore.store.core.ssd[("fp-a", h)] == loc for h, loc in indexed.items())

    got = await client.pull_tensors(["b1"], "fp-a")  # ranged read of a chunk, promoted
    assert torch.equal(got["b1"], blocks["b1"])
    assert (await client.query(["b1"], "fp-a")) == {"b1": "dram"}
    assert (s.hits_ssd, s.restores) == (1, 1)
    await kvstore.store.flush()  # b3 (LRU) was evicted by the promotion: persisted, no spill
    assert (s.persists, s.spills) == (7, 0)
    assert (await client.query(["b3"], "fp-a")) == {"b3": "ssd"}
    await client.close()


async def test_big_blocks_get_their_own_objects(nats_url, minio_server):
    kv = await start_kvstore(
        nats_url, minio_server, chunk_block_max_bytes=BLOCK_BYTES * 3 // 4, write_linger=0.3
    )
    client = KVClient(kv.addr)
    await push_blocks(client, [("big1", block(1)), ("big2", block(2))])  # float32: "big"
    await push_blocks(client, [("s1", block(3, torch.float16)), ("s2", block(4, torch.float16))])
    await kv.store.flush()
    listing = kv.store.ssd.list("fp-a")
    assert sorted(k for k, _ in listing.blocks) == [("fp-a", "big1"), ("fp-a", "big2")]
    assert len(listing.chunks) == 1  # both small ones, pushed together, in one chunk
    assert sorted(kv.store.ssd.read_chunk_index(listing.chunks[0][1])) == ["s1", "s2"]
    await kv.shutdown()
    await client.close()


async def test_restart_gets_hits_from_minio(nats_url, minio_server):
    bucket = new_bucket()
    first = await start_kvstore(nats_url, minio_server, bucket, dram_bytes=1 << 20)
    client = KVClient(first.addr)
    kept, other = block(5, torch.float16), block(6, torch.float16)
    await push_blocks(client, [("kept", kept), ("other", other)], fp="fp-r")
    await first.shutdown()  # no explicit flush: the graceful stop flushes the write-behind
    await client.close()

    second = await start_kvstore(nats_url, minio_server, bucket, dram_bytes=1 << 20)
    client = KVClient(second.addr)
    assert second.store.core.stats.hits_ssd == 0
    assert await client.query(["kept", "other", "x"], "fp-r") == {"kept": "ssd", "other": "ssd"}
    got = await client.pull_tensors(["kept", "other"], "fp-r")
    assert torch.equal(got["kept"], kept) and torch.equal(got["other"], other)
    assert second.store.core.stats.hits_ssd == 2
    assert await client.query(["kept"], "fp-r") == {"kept": "dram"}  # promoted
    await second.shutdown()
    await client.close()


async def test_blocks_written_by_another_instance_are_found(nats_url, minio_server):
    bucket = new_bucket()
    a = await start_kvstore(nats_url, minio_server, bucket, dram_bytes=1 << 20)
    b = await start_kvstore(
        nats_url, minio_server, bucket, dram_bytes=1 << 20, refresh_interval=0.3, negative_ttl=0.3
    )
    ca, cb = KVClient(a.addr), KVClient(b.addr)
    await push_blocks(ca, [("x1", block(1)), ("x2", block(2))], fp="fp-f")
    await a.store.flush()
    assert await cb.query(["x1", "x2", "nope"], "fp-f") == {"x1": "ssd", "x2": "ssd"}
    refreshes = b.store.misses  # "nope" is now negatively cached: no listing for it
    assert refreshes.is_negative(("fp-f", "nope"))
    listed = kvm.REFRESHES._value.get()
    assert await cb.query(["nope"], "fp-f") == {}
    assert kvm.REFRESHES._value.get() == listed
    got = await cb.pull_tensors(["x2"], "fp-f")
    assert torch.equal(got["x2"], block(2))

    await push_blocks(ca, [("nope", block(3))], fp="fp-f")  # now it exists
    await a.store.flush()
    await asyncio.sleep(0.35)  # negative entry and refresh interval expire
    assert await cb.query(["nope"], "fp-f") == {"nope": "ssd"}
    assert kvm.REFRESHES._value.get() == listed + 1
    got = await cb.pull_tensors(["nope"], "fp-f")
    assert torch.equal(got["nope"], block(3))
    for r in (a, b):
        await r.shutdown()
    await ca.close()
    await cb.close()


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
            locs = [kvstore.store.core.ssd[("fp-a", h)] for h in ev.hashes]
            committed = committed and all(
                mc.stat_object(kvstore.cfg.minio_bucket, loc.obj) is not None for loc in locs
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
    # 6 x dram stored, 6 x ssd stored (write-behind or spill), 2 x dram removed (e0, e1)
    assert [e.seq for e in evs] == list(range(1, len(evs) + 1)) and len(evs) == 14
    assert {e.incarnation for e in evs} == {kvstore.store.core.incarnation}
    dram_stored = [e.hashes[0] for e in evs if (e.tier, e.kind) == ("dram", "stored")]
    assert dram_stored == [f"e{i}" for i in range(6)]
    for h in ("e0", "e1"):  # spills run concurrently; per block the order is fixed
        steps = [(e.tier, e.kind) for e in evs if e.hashes == [h]]
        assert steps == [("dram", "stored"), ("ssd", "stored"), ("dram", "removed")]
    assert all(ok for e, ok in received if e.kind == "stored")
    await client.close()


async def test_minio_down_degrades_then_writes_resume(nats_url, tmp_path):
    minio = start_minio(data_dir=str(tmp_path / "minio"))
    try:
        kv = await start_kvstore(nats_url, minio, dram_bytes=2 * (BLOCK_BYTES + 256))
        client = KVClient(kv.addr)
        await push_blocks(client, [("a", block(1)), ("b", block(2)), ("c", block(3))])
        await kv.store.flush()
        assert await client.query(["a", "b", "c"], "fp-a") == {"a": "ssd", "b": "dram", "c": "dram"}

        minio.stop()
        # puts still succeed (DRAM): d, e evict the persisted b, c (no spill needed); f evicts
        # d, which is not persisted yet: it waits for its spill and stays readable
        rep = await push_blocks(client, [("d", block(4)), ("e", block(5)), ("f", block(6))])
        assert rep.stored == ["d", "e", "f"]
        got = await client.pull_tensors(["d", "f", "a"], "fp-a")
        assert set(got) == {"d", "f"} and torch.equal(got["d"], block(4))  # "a": a miss
        await asyncio.sleep(0.5)  # a few write retries fail
        stats = kv.store.stats()
        assert stats["ssd_online"] is False and stats["pending_spill_blocks"] == 1
        assert stats["write_behind_blocks"] == 2  # e, f
        assert stats["counters"]["spill_failures"] >= 1 and stats["counters"]["misses"] == 1
        assert kvm.SSD_ONLINE._value.get() == 0
        assert await client.query(["a", "b", "d"], "fp-a") == {"a": "ssd", "b": "ssd", "d": "dram"}

        minio.start()  # same data dir and port
        await kv.store.flush(timeout=60)  # MinIO restarts slowly on a loaded box
        assert kv.store.ssd_online and kvm.SSD_ONLINE._value.get() == 1
        assert all(("fp-a", h) in kv.store.core.ssd for h in "abcdef")
        assert await client.query(["d", "e", "f"], "fp-a") == {"d": "ssd", "e": "dram", "f": "dram"}
        got = await client.pull_tensors(["a", "d"], "fp-a")
        assert torch.equal(got["a"], block(1)) and torch.equal(got["d"], block(4))
        await kv.shutdown()
        await client.close()
    finally:
        minio.stop()
