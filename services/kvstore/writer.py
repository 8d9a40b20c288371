"""`SsdWriter`: the kvstore's writers to the SSD tier (spills and write-behind).

``concurrency`` workers each take the next batch the core hands out (a sliding window: a slow
write never holds the others back). A batch of one goes to its own object; a batch of small
blocks of one fingerprint becomes one chunk object. A worker does not take a write-behind block
younger than ``linger`` seconds (unless a spill waits), so the blocks of one push land in one
chunk.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from services.kvstore import metrics as m
from services.kvstore.chunks import SsdLoc
from services.kvstore.core import KVStoreCore
from services.kvstore.dram import BlockKey, Entry
from services.kvstore.ssd import MinioTier, ObjectStoreError


@dataclass(frozen=True)
class WriterOptions:
    """How blocks are written to the SSD tier."""

    concurrency: int = 8
    """Writes (objects) in flight."""
    retry_interval: float = 1.0
    """Seconds a worker waits after a failed write (the object store is down)."""
    chunk_bytes: int = 4 << 20
    """Most bytes of one chunk object (0 = one object per block, no chunks)."""
    chunk_block_max: int = 1 << 20
    """Blocks of at least this many bytes always get their own object."""
    chunk_max_blocks: int = 512
    """Most blocks in one chunk object."""
    linger: float = 0.02
    """Seconds to gather blocks after a wake-up before writing (0 = write at once)."""


class SsdWriter:
    """Runs the write workers of ``core`` against ``ssd``; ``wake()`` after new work."""

    def __init__(self, core: KVStoreCore, ssd: MinioTier | None, opts: WriterOptions, status):
        self.core = core
        self.ssd = ssd
        self.opts = opts
        self.status = status  # the KVStore: ssd_ok(), ssd_failed(op, exc), wrote_chunk(name)
        self._wake = asyncio.Event()

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        await asyncio.gather(*(self._worker() for _ in range(self.opts.concurrency)))

    async def _worker(self) -> None:
        o = self.opts
        while True:
            if o.linger > 0 and o.chunk_bytes > 0:
                delay = self.core.write_delay(o.linger)
                if delay > 0:
                    await asyncio.sleep(delay)
            batch = self.core.next_spills(o.chunk_max_blocks, o.chunk_bytes, o.chunk_block_max)
            if not batch:
                await self._wake.wait()
                self._wake.clear()
                continue
            if self.ssd is None:
                for e in batch:
                    self.core.spill_abandoned(e.key)
                self.status.events_ready()
                continue
            ok = await self.write(batch)
            self.status.events_ready()
            if not ok:
                await asyncio.sleep(o.retry_interval)

    async def write(self, batch: list[Entry]) -> bool:
        """Write ``batch`` (one object, or one chunk object) and tell the core."""
        assert self.ssd is not None
        start = time.perf_counter()
        try:
            locs = await asyncio.to_thread(self._write_sync, batch)
        except ObjectStoreError as exc:
            self.status.ssd_failed("spill", exc)
            for e in batch:
                self.core.spill_done(e.key, ok=False)
            return False
        self.status.ssd_ok()
        for e in batch:
            spill = e.key in self.core.pending
            self.core.spill_done(e.key, True, locs[e.key])
            (m.SPILLS if spill else m.PERSISTS).inc()
            m.SPILL_BYTES.inc(e.nbytes)
        kind = "chunk" if len(batch) > 1 else "block"
        m.SSD_OBJECTS.labels(kind).inc()
        if kind == "chunk":
            self.status.wrote_chunk(locs[batch[0].key].obj)
        m.LATENCY.labels("spill").observe(time.perf_counter() - start)
        return True

    def _write_sync(self, batch: list[Entry]) -> dict[BlockKey, SsdLoc]:
        assert self.ssd is not None
        if len(batch) == 1:
            e = batch[0]
            return {e.key: self.ssd.put(e.key, e.payload.SerializeToString())}
        fp = batch[0].key[0]
        blobs = [(e.key[1], e.payload.SerializeToString()) for e in batch]
        return {(fp, h): loc for h, loc in self.ssd.put_chunk(fp, blobs).items()}
