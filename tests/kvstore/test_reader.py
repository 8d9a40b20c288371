"""SSD-tier reads of a pull: the read plan (pure, exact) and the coalesced, parallel reads against
the real MinIO of the session (counted GETs prove the path)."""

from __future__ import annotations

import uuid

import torch

from protos.kv_transfer_pb2 import BlockFrame
from services.kvstore.chunks import RangeRead, SsdLoc, plan_reads
from services.kvstore.core import KVStoreCore
from services.kvstore.reader import ReadOptions, SsdReader
from services.kvstore.ssd import MinioTier, ObjectStoreError
from services.kvstore.store import KVStore
from services.kvstore.writer import WriterOptions
from shared.kvtransfer.client import KVClient
from tests.kvstore.conftest import BLOCK_BYTES, block, block_frames, start_kvstore


def loc(obj: str, offset: int, length: int) -> SsdLoc:
    return SsdLoc(obj, offset, length, ranged=True)


def test_plan_coalesces_adjacent_blocks_of_one_chunk_in_request_order():
    # chunk "c": blocks at 10..40 (10 bytes each) then a gap of 20 and one at 60; object "d"
    locs = [loc("c", 20, 10), loc("c", 10, 10), loc("d", 8, 4), loc("c", 30, 10), loc("c", 60, 5)]
    assert plan_reads(locs, max_bytes=1000, max_gap=0) == [
        RangeRead("c", 10, 30, True, ((0, 10, 10), (1, 0, 10), (3, 20, 10))),
        RangeRead("d", 8, 4, True, ((2, 0, 4),)),
        RangeRead("c", 60, 5, True, ((4, 0, 5),)),
    ]
    # a gap of 20 unrequested bytes is worth reading to save a GET
    assert plan_reads(locs, max_bytes=1000, max_gap=20)[0] == RangeRead(
        "c", 10, 55, True, ((0, 10, 10), (1, 0, 10), (3, 20, 10), (4, 50, 5))
    )
    # a byte cap splits the run; 0 = one GET per block
    assert [
        (r.offset, r.length) for r in plan_reads(locs[:2] + locs[3:4], max_bytes=20, max_gap=0)
    ] == [(10, 20), (30, 10)]
    assert len(plan_reads(locs, max_bytes=0, max_gap=100)) == 5


def test_plan_whole_objects_and_repeats():
    big = SsdLoc("fp/h1", 0, 100)
    locs = [big, loc("c", 8, 4), big, SsdLoc("fp/h2", 0, 50), loc("c", 8, 4)]
    assert plan_reads(locs, max_bytes=10, max_gap=0) == [
        RangeRead("fp/h1", 0, 100, False, ((0, 0, 100), (2, 0, 100))),
        RangeRead("c", 8, 4, True, ((1, 0, 4), (4, 0, 4))),
        RangeRead("fp/h2", 0, 50, False, ((3, 0, 50),)),
    ]
    assert plan_reads([], max_bytes=10, max_gap=0) == []


def minio_tier(minio_server) -> MinioTier:
    t = MinioTier(
        minio_server.endpoint,
        minio_server.access_key,
        minio_server.secret_key,
        f"rd-{uuid.uuid4().hex[:10]}",
    )
    t.ensure_bucket()
    return t


async def test_fetch_reads_a_chunk_in_one_get_and_objects_in_their_own(minio_server):
    tier = minio_tier(minio_server)
    blobs = {f"h{i}": bytes([i]) * (100 + i) for i in range(6)}
    locs = tier.put_chunk("fp", list(blobs.items()))
    big = tier.put(("fp", "big"), b"B" * 300)
    reader = SsdReader(tier, ReadOptions(concurrency=4, max_bytes=1 << 20, gap_bytes=0))
    want = {("fp", h): locs[h] for h in ["h4", "h1", "h2", "h3"]} | {("fp", "big"): big}
    fetch = reader.fetch(want)
    assert fetch.reads == 2  # h1..h4 are adjacent in the chunk: one ranged GET
    for (_, h), where in want.items():
        data = await fetch.take(("fp", h), where)
        assert bytes(data) == (b"B" * 300 if h == "big" else blobs[h])
    assert reader.gets == 2 and reader.get_bytes == 300 + sum(100 + i for i in range(1, 5))
    # a key the plan did not have gets its own read; a gone object is None
    assert bytes(await fetch.take(("fp", "h0"), locs["h0"])) == blobs["h0"]
    assert await fetch.take(("fp", "x"), SsdLoc("fp/gone", 0, 5)) is None
    assert fetch.reads == 4 and reader.gets == 3
    fetch.cancel()
    reader.close()


async def test_fetch_reads_ahead_within_the_window(minio_server):
    tier = minio_tier(minio_server)
    locs = tier.put_chunk("fp", [(f"h{i}", bytes([i]) * 100) for i in range(6)])
    reader = SsdReader(tier, ReadOptions(max_bytes=200, gap_bytes=0, window_bytes=250))
    want = {("fp", f"h{i}"): locs[f"h{i}"] for i in range(6)}
    fetch = reader.fetch(want)
    assert fetch.reads == 2  # 3 reads of 200 bytes planned; 400 bytes ahead >= the window
    started = []
    for i, (key, where) in enumerate(want.items()):
        assert bytes(await fetch.take(key, where)) == bytes([i]) * 100
        started.append(fetch.reads)
    assert started == [2, 3, 3, 3, 3, 3]  # the third read starts once h0, h1 are taken
    assert reader.gets == 3
    reader.close()


async def test_fetch_failure_raises_for_every_block_of_the_read(minio_server):
    tier = minio_tier(minio_server)
    locs = tier.put_chunk("fp", [("a", b"a" * 10), ("b", b"b" * 10)])
    reader = SsdReader(tier)
    short = {("fp", "a"): locs["a"], ("fp", "b"): loc(locs["b"].obj, locs["b"].offset, 99)}
    fetch = reader.fetch(short)  # one GET past the object's end
    assert fetch.reads == 1
    for key, where in short.items():
        try:
            await fetch.take(key, where)
        except ObjectStoreError as exc:
            assert "short read" in str(exc) or "InvalidRange" in str(exc)
        else:
            raise AssertionError(f"{key} read past the end of its chunk")
    reader.close()


async def test_store_streams_a_restored_run_with_one_get_per_chunk(minio_server):
    tier = minio_tier(minio_server)
    frames = [f for i in range(8) for f in block_frames(f"k{i}", block(i))]
    writer = KVStore(
        KVStoreCore("w", "i1", 1 << 30, write_behind_blocks=64),
        tier,
        writer=WriterOptions(linger=0.2),
    )
    await writer.start()
    for f in frames:
        writer.put(f)
    await writer.flush()
    await writer.stop()
    assert len(tier.list("fp-a").chunks) == 1  # pushed together: one chunk

    fresh = KVStore(KVStoreCore("r", "i2", 1 << 30), tier)
    await fresh.start()
    keys = [("fp-a", f"k{i}") for i in (2, 3, 4, 5, 6)] + [("fp-a", "nope"), ("fp-a", "k7")]
    got = [(k, g) async for k, g in fresh.acquire_many(keys)]
    assert [k for k, _ in got] == keys  # in order, misses included
    assert got[5][1] is None
    for (key, g), want in zip(
        got, [frames[i] for i in (2, 3, 4, 5, 6)] + [None, frames[7]], strict=True
    ):
        if want is None:
            continue
        frame, leased = g
        assert leased and isinstance(frame, BlockFrame) and frame.data == want.data
        fresh.release(key)
    assert fresh.reader.gets == 1  # k2..k7: one ranged GET of the chunk
    s = fresh.core.stats
    assert (s.hits_ssd, s.restores, s.misses) == (6, 6, 1)
    assert fresh.core.lookup(("fp-a", "k4")) == "dram"  # promoted
    got = [g async for _, g in fresh.acquire_many(keys[:2])]  # now from DRAM: no GET
    assert fresh.reader.gets == 1 and s.hits_dram == 2
    for k in keys[:2]:
        fresh.release(k)
    await fresh.stop()


async def test_pull_of_ssd_blocks_over_grpc_uses_one_get(nats_url, minio_server):
    five = 5 * (BLOCK_BYTES + 256) + 10  # the DRAM tier holds 5 blocks
    kv = await start_kvstore(nats_url, minio_server, dram_bytes=five, write_linger=0.2)
    client = KVClient(kv.addr)
    blocks = {f"p{i}": block(20 + i) for i in range(5)}
    await client.push([f for h, t in blocks.items() for f in block_frames(h, t)])
    await kv.store.flush()  # written behind as one chunk
    await client.push([f for i in range(5) for f in block_frames(f"q{i}", block(40 + i))])
    await kv.store.flush()
    assert await client.query(list(blocks), "fp-a") == {h: "ssd" for h in blocks}  # evicted
    got = await client.pull_tensors(list(blocks), "fp-a")
    assert all(torch.equal(got[h], t) for h, t in blocks.items())
    assert kv.store.reader.gets == 1 and kv.store.core.stats.restores == 5
    await kv.shutdown()
    await client.close()
