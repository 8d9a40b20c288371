"""KV pool benchmark: write-behind/restart/restore through the kvstore with one object per block
vs chunk objects (same run, same MinIO), raw minio-SDK put/get of the same sizes for reference,
the per-object cost microbenchmark behind the batching decision, and the restore of one prompt's
run of blocks (a pull) against raw `get_object` reads of the same chunk objects.

    .venv/bin/python -m loadtests.bench_kvpool [--quick] [--only-restore] [--repeats N]

Starts a private MinIO (local disk) and prints markdown tables (docs/benchmarks/kvpool.md).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import torch

from protos.kv_transfer_pb2 import BlockFrame
from services.infra.minio_server import start_minio
from services.kvstore.core import KVStoreCore
from services.kvstore.handler import KVStoreHandler
from services.kvstore.reader import ReadOptions
from services.kvstore.ssd import MinioTier
from services.kvstore.store import KVStore
from services.kvstore.writer import WriterOptions
from shared.kvtransfer.client import KVClient
from shared.kvtransfer.server import start_kv_server

CONCURRENCY = 8


def frame_of(i: int, nbytes: int) -> BlockFrame:
    data = torch.randint(0, 255, (nbytes,), dtype=torch.uint8).numpy().tobytes()
    return BlockFrame(
        key=f"{i:032x}", fingerprint="bench", dtype="bfloat16", shape=[nbytes // 2], data=data
    )


def tier(minio, bucket: str) -> MinioTier:
    t = MinioTier(
        minio.endpoint, minio.access_key, minio.secret_key, bucket, max_connections=2 * CONCURRENCY
    )
    t.ensure_bucket()
    return t


def raw_sdk(minio, blobs: list[bytes], threads: int) -> tuple[float, float]:
    """Seconds to put then get every blob as its own object with the bare minio SDK."""
    t = tier(minio, f"raw-{uuid.uuid4().hex[:8]}")
    c, b = t.client, t.bucket

    def put(i):
        c.put_object(b, f"o/{i}", io.BytesIO(blobs[i]), len(blobs[i]))

    def get(i):
        r = c.get_object(b, f"o/{i}")
        r.read()
        r.close()
        r.release_conn()

    out = []
    for fn in (put, get):
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(fn, range(len(blobs))))
        out.append(time.perf_counter() - start)
    return out[0], out[1]


async def kvstore_side(minio, frames: list[BlockFrame], chunk_bytes: int) -> dict[str, float]:
    """Write-behind of every block (all fit in DRAM) until committed, a restart's listing, and a
    read of every block through the SSD tier. ``chunk_bytes`` 0 = one object per block."""
    bucket = f"kv-{uuid.uuid4().hex[:8]}"
    opts = WriterOptions(concurrency=CONCURRENCY, chunk_bytes=chunk_bytes)
    core = KVStoreCore("bench", "i1", dram_bytes=1 << 40, write_behind_blocks=1 << 20)
    store = KVStore(core, tier(minio, bucket), writer=opts)
    await store.start()
    start = time.perf_counter()
    for f in frames:
        store.put(f)
    await store.flush(timeout=600)
    persist = time.perf_counter() - start
    await store.stop()
    listing = store.ssd.list()
    objects = len(listing.blocks) + len(listing.chunks)

    fresh = KVStore(KVStoreCore("bench", "i2", dram_bytes=1 << 40), tier(minio, bucket))
    start = time.perf_counter()
    await fresh.start()
    startup = time.perf_counter() - start
    assert len(fresh.core.ssd) == len(frames)
    sem = asyncio.Semaphore(CONCURRENCY)

    async def get(f):
        async with sem:
            got = await fresh.get(("bench", f.key))
            assert got is not None and got.data == f.data

    start = time.perf_counter()
    await asyncio.gather(*(get(f) for f in frames))
    restore = time.perf_counter() - start
    await fresh.stop()
    return {"persist": persist, "startup": startup, "restore": restore, "objects": objects}


def batching(minio, size: int, n: int, per_chunk: int) -> dict[str, float]:
    """Per-block write seconds: one object per block (1 and 8 in flight) vs chunk objects."""
    t = tier(minio, f"batch-{uuid.uuid4().hex[:8]}")
    c, b = t.client, t.bucket
    blob = bytes(size)
    res = {}
    for name, threads in (("per_object_seq", 1), ("per_object_x8", CONCURRENCY)):
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            list(
                ex.map(
                    lambda i, p=name: c.put_object(b, f"{p}/{i}", io.BytesIO(blob), size), range(n)
                )
            )
        res[name] = (time.perf_counter() - start) / n
    chunk = blob * per_chunk
    start = time.perf_counter()
    for j in range(n // per_chunk):
        c.put_object(b, f"chunk/{j}", io.BytesIO(chunk), len(chunk))
    res["chunk_seq"] = (time.perf_counter() - start) / n
    return res


async def run_restore(minio, frames: list[BlockFrame], repeats: int) -> dict[str, list[float]]:
    """Seconds to restore the run ``frames`` (one prompt's blocks, written behind into chunk
    objects) from MinIO, best of ``repeats``, each on a fresh kvstore (empty DRAM): raw
    ``get_object`` of the whole chunk objects (1 and 8 in flight), the kvstore's pull path
    in-process (``acquire_many``, the default reader and one ranged GET per block one after the
    other as before), and the same pull over gRPC to a client (what a prefill instance sees)."""
    bucket = f"rs-{uuid.uuid4().hex[:8]}"
    core = KVStoreCore("bench", "w", dram_bytes=1 << 40, write_behind_blocks=1 << 20)
    store = KVStore(core, tier(minio, bucket), writer=WriterOptions(concurrency=CONCURRENCY))
    await store.start()
    for f in frames:
        store.put(f)
    await store.flush(timeout=600)
    await store.stop()
    t = tier(minio, bucket)
    names = [name for _, name in t.list().chunks]
    keys = [("bench", f.key) for f in frames]

    def raw_get(name: str) -> int:
        r = t.client.get_object(bucket, name)
        try:
            return len(r.read())
        finally:
            r.close()
            r.release_conn()

    async def fresh(opts: ReadOptions | None = None) -> KVStore:
        s = KVStore(KVStoreCore("bench", "r", dram_bytes=1 << 40), tier(minio, bucket), reader=opts)
        await s.start()
        return s

    async def pull_local(opts: ReadOptions | None) -> float:
        s = await fresh(opts)
        start = time.perf_counter()
        n = 0
        async for key, got in s.acquire_many(keys):
            assert got is not None, key
            n += 1
            if got[1]:
                s.release(key)
        secs = time.perf_counter() - start
        assert n == len(keys)
        await s.stop()
        return secs

    async def pull_grpc() -> float:
        s = await fresh()
        server, addr = await start_kv_server(KVStoreHandler(s))
        client = KVClient(addr)
        await client.query(["warm-up"], "bench")  # connected before the clock starts
        start = time.perf_counter()
        got = [f async for f in client.pull([k for _, k in keys], "bench", timeout=600)]
        secs = time.perf_counter() - start
        assert len(got) == len(keys)
        await client.close()
        await server.stop(0)
        await s.stop()
        return secs

    res: dict[str, list[float]] = {}
    for _ in range(repeats):  # sides alternated, so load changes hit all of them alike
        for threads in (1, CONCURRENCY):
            start = time.perf_counter()
            with ThreadPoolExecutor(threads) as ex:
                list(ex.map(raw_get, names))
            res.setdefault(f"raw x{threads}", []).append(time.perf_counter() - start)
        res.setdefault("per block", []).append(
            await pull_local(ReadOptions(concurrency=1, max_bytes=0))
        )
        res.setdefault("pull", []).append(await pull_local(None))
        res.setdefault("grpc", []).append(await pull_grpc())
    res["objects"] = [len(names)]
    return res


async def restore_table(minio, repeats: int, quick: bool) -> None:
    print("\n## Restore of one prompt's blocks from MinIO vs raw get_object (MiB/s)\n")
    print("A fresh kvstore (empty DRAM) serves a pull of a run of consecutive blocks written")
    print("behind together (chunk objects); raw = minio-SDK `get_object` of the same chunk objects")
    print(f"whole, 1 and {CONCURRENCY} in flight. Best of {repeats}.\n")
    print(
        "| block | n | MiB | chunks | raw x1 | raw x8 | kvstore, one GET per block (old) "
        "| kvstore pull | pull over gRPC | pull / raw x8 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    # the default model's f32 block (64 KiB) for an 8k prompt (32 MiB), and a 0.5B-class block
    for size, n in [(64 << 10, 64 if quick else 512), (256 << 10, 16 if quick else 128)]:
        frames = [frame_of(i, size) for i in range(n)]
        r = await run_restore(minio, frames, repeats)
        best = {k: min(v) for k, v in r.items()}
        total = size * n
        print(
            f"| {size >> 10} KiB | {n} | {total >> 20} | {r['objects'][0]} "
            f"| {mibs(total, best['raw x1'])} | {mibs(total, best['raw x8'])} "
            f"| {mibs(total, best['per block'])} | {mibs(total, best['pull'])} "
            f"| {mibs(total, best['grpc'])} | {best['raw x8'] / best['pull']:.2f} |",
            flush=True,
        )


def mibs(nbytes: int, secs: float) -> str:
    return f"{nbytes / secs / 2**20:,.0f}"


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer objects (smoke run)")
    ap.add_argument("--only-restore", action="store_true", help="only the restore table")
    ap.add_argument("--repeats", type=int, default=3, help="restore table: best of N")
    args = ap.parse_args()
    torch.set_num_threads(1)
    minio = start_minio()
    try:
        await restore_table(minio, args.repeats, args.quick)
        if args.only_restore:
            return
        # (block bytes, count): the default model's block (32 KiB bf16 / 64 KiB f32), a 0.5B-class
        # block (~256 KiB) and an 8B-class block (2 MiB)
        cases = [(32 << 10, 512), (64 << 10, 256), (256 << 10, 128), (2 << 20, 32)]
        if args.quick:
            cases = [(s, max(8, n // 8)) for s, n in cases]
        print("## Write-behind, restart and restore: one object per block vs 4 MiB chunks\n")
        print("MiB/s of block bytes, 8 writers/readers in flight; objects written; restart = a")
        print("fresh kvstore's start-up listing (+ chunk headers) in ms.\n")
        print(
            "| block | n | raw put | persist: per object | persist: chunks | objects | "
            "restart ms: per object | restart ms: chunks | raw get | restore: per object "
            "| restore: chunks |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for size, n in cases:
            frames = [frame_of(i, size) for i in range(n)]
            blobs = [f.SerializeToString() for f in frames]
            raw_put, raw_get = raw_sdk(minio, blobs, CONCURRENCY)
            one = await kvstore_side(minio, frames, chunk_bytes=0)
            chunked = await kvstore_side(minio, frames, chunk_bytes=4 << 20)
            total = size * n
            print(
                f"| {size >> 10} KiB | {n} | {mibs(total, raw_put)} "
                f"| {mibs(total, one['persist'])} | {mibs(total, chunked['persist'])} "
                f"| {one['objects']} / {chunked['objects']} "
                f"| {one['startup'] * 1e3:.0f} | {chunked['startup'] * 1e3:.0f} "
                f"| {mibs(total, raw_get)} | {mibs(total, one['restore'])} "
                f"| {mibs(total, chunked['restore'])} |",
                flush=True,
            )
        print("\n## Per-block write cost: one object per block vs chunk objects (ms/block)\n")
        print(
            "| block | per object, 1 in flight | per object, 8 in flight "
            "| 16-block chunk objects, 1 in flight |"
        )
        print("|---|---|---|---|")
        for size, n in [(4 << 10, 256), (16 << 10, 256), (256 << 10, 64), (2 << 20, 32)]:
            n = max(16, n // 8) if args.quick else n
            r = batching(minio, size, n, 16)
            print(
                f"| {size >> 10} KiB | {r['per_object_seq'] * 1e3:.2f} | "
                f"{r['per_object_x8'] * 1e3:.2f} | {r['chunk_seq'] * 1e3:.2f} |",
                flush=True,
            )
    finally:
        minio.stop()


if __name__ == "__main__":
    asyncio.run(main())
