"""KV pool benchmark: spill/restore through the kvstore vs raw minio-SDK put/get of the same
object sizes, and per-object cost vs batched chunk objects (the batching decision).

    .venv/bin/python -m loadtests.bench_kvpool [--quick]

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
from services.kvstore.ssd import MinioTier
from services.kvstore.store import KVStore, block_nbytes

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


async def kvstore_side(minio, frames: list[BlockFrame], concurrency: int) -> tuple[float, float]:
    """Seconds to spill every block (DRAM of one block) and to restore them all after a restart."""
    bucket = f"kv-{uuid.uuid4().hex[:8]}"
    one = block_nbytes(frames[0])
    core = KVStoreCore("bench", "i1", dram_bytes=one, spill_buffer_bytes=1 << 40)
    store = KVStore(core, tier(minio, bucket), spill_concurrency=concurrency)
    await store.start()
    start = time.perf_counter()
    for f in frames:
        store.put(f)
    store.put(frame_of(-1, len(frames[0].data)))  # pushes the last real block out too
    await store.flush(timeout=600)
    spill = time.perf_counter() - start
    await store.stop()

    fresh = KVStore(KVStoreCore("bench", "i2", dram_bytes=1 << 40), tier(minio, bucket))
    await fresh.start()
    sem = asyncio.Semaphore(concurrency)

    async def get(f):
        async with sem:
            got = await fresh.get(("bench", f.key))
            assert got is not None and got.data == f.data

    start = time.perf_counter()
    await asyncio.gather(*(get(f) for f in frames))
    restore = time.perf_counter() - start
    await fresh.stop()
    return spill, restore


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


def mibs(nbytes: int, secs: float) -> str:
    return f"{nbytes / secs / 2**20:,.0f}"


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer objects (smoke run)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    minio = start_minio()
    try:
        # (block bytes, count): 16 tokens x all layers of toy .. 8B-class models
        cases = [(16 << 10, 400), (256 << 10, 200), (2 << 20, 48)]
        if args.quick:
            cases = [(s, max(8, n // 8)) for s, n in cases]
        print("## Spill / restore vs raw minio SDK (MiB/s, 8 in flight)\n")
        print("| block | n | raw put | kvstore spill | raw get | kvstore restore |")
        print("|---|---|---|---|---|---|")
        for size, n in cases:
            frames = [frame_of(i, size) for i in range(n)]
            blobs = [f.SerializeToString() for f in frames]
            raw_put, raw_get = raw_sdk(minio, blobs, CONCURRENCY)
            spill, restore = await kvstore_side(minio, frames, CONCURRENCY)
            total = size * n
            print(
                f"| {size >> 10} KiB | {n} | {mibs(total, raw_put)} | {mibs(total, spill)} "
                f"| {mibs(total, raw_get)} | {mibs(total, restore)} |",
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
