"""`SsdReader`: reads of the SSD tier for a pull, coalesced and in parallel.

A pull names a run of blocks, usually consecutive blocks of one prompt written together into
one or two chunk objects. Reading them one ranged GET at a time, one after the other, is bound
by the per-request round trip (~2-4 ms on a loopback MinIO), far below MinIO's streaming rate.
So a pull's SSD-tier blocks are planned at once (`chunks.plan_reads`: adjacent blocks of one
object in one ranged GET of up to ``max_bytes``) and the GETs are started on the reader's own
thread pool (``concurrency`` in flight, in the order of the first block each carries, up to
``window_bytes`` ahead of the block being sent); the kvstore streams block after block as their
reads land while later ones still download.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from services.kvstore import metrics as m
from services.kvstore.chunks import RangeRead, SsdLoc, plan_reads
from services.kvstore.dram import BlockKey
from services.kvstore.ssd import MinioTier, ObjectStoreError


@dataclass(frozen=True)
class ReadOptions:
    """How a pull reads the SSD tier."""

    concurrency: int = 8
    """GETs in flight (threads of the reader's pool, shared by every pull)."""
    max_bytes: int = 4 << 20
    """Most bytes of one coalesced ranged GET (0 = one GET per block)."""
    gap_bytes: int = 256 << 10
    """Bytes of blocks nobody asked for that one GET may read between two requested ones
    (cheaper than a second round trip)."""
    window_bytes: int = 64 << 20
    """Most block bytes one pull reads ahead of the block being sent (bounds its memory)."""


class SsdReader:
    """Runs the GETs of `Fetch`es against ``tier``; counts them (``gets``, ``get_bytes``)."""

    def __init__(self, tier: MinioTier, opts: ReadOptions | None = None):
        self.tier = tier
        self.opts = opts or ReadOptions()
        self._pool: ThreadPoolExecutor | None = None
        self.gets = 0
        self.get_bytes = 0
        self._lock = threading.Lock()

    def fetch(self, want: Mapping[BlockKey, SsdLoc]) -> Fetch:
        """Start reading the blocks of ``want`` now (call from the event loop)."""
        return Fetch(self, want)

    def read(self, r: RangeRead) -> bytes | None:
        """One GET (blocking): the bytes of ``r``, None if the object is gone."""
        data = self.tier.get(r.loc) if r.length or not r.ranged else b""
        if data is not None:
            with self._lock:
                self.gets += 1
                self.get_bytes += len(data)
            m.SSD_GETS.inc()
            m.SSD_GET_BYTES.inc(len(data))
        return data

    @property
    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.opts.concurrency, thread_name_prefix="kv-read")
        return self._pool

    def close(self) -> None:
        """Stop the threads (reads queued are dropped); a later fetch starts new ones."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


class Fetch:
    """The GETs of one pull, started in plan order at construction while the bytes read ahead and
    not yet taken stay under ``window_bytes`` (one read at least), more as blocks are taken.
    ``take(key, loc)`` waits for the read that carries ``key`` (a key not planned, e.g. one
    evicted from DRAM since, gets a read of its own then) and returns the block's bytes, None if
    its object is gone; a failed GET raises `ObjectStoreError` for every block it carries.
    ``cancel()`` drops reads not needed any more."""

    def __init__(self, reader: SsdReader, want: Mapping[BlockKey, SsdLoc]):
        self._reader = reader
        self._loop = asyncio.get_running_loop()
        o = reader.opts
        keys = list(want)
        self._plan = plan_reads([want[k] for k in keys], max_bytes=o.max_bytes, max_gap=o.gap_bytes)
        self._where: dict[BlockKey, tuple[int, int, int]] = {}  # key -> (read, offset, length)
        for n, r in enumerate(self._plan):
            for i, off, length in r.members:
                self._where[keys[i]] = (n, off, length if r.ranged else -1)  # -1: whole object
        self._planned = len(self._plan)
        self._futures: dict[int, asyncio.Future] = {}  # read index -> its GET
        self._next = 0  # next planned read to start
        self._ahead = 0  # bytes of started planned reads not taken yet
        self._top_up()

    def _start(self, n: int) -> None:
        r = self._plan[n]
        self._futures[n] = self._loop.run_in_executor(self._reader.pool, self._reader.read, r)

    def _top_up(self, upto: int = -1) -> None:
        window = self._reader.opts.window_bytes
        while self._next < self._planned and (
            self._next <= upto or self._ahead < window or self._ahead <= 0
        ):
            self._start(self._next)
            self._ahead += sum(length for _, _, length in self._plan[self._next].members)
            self._next += 1

    @property
    def reads(self) -> int:
        """GETs this fetch started."""
        return len(self._futures)

    async def take(self, key: BlockKey, loc: SsdLoc) -> memoryview | None:
        got = self._where.pop(key, None)
        if got is None:  # not planned: a read of its own, now
            self._plan.append(
                RangeRead(loc.obj, loc.offset, loc.length, loc.ranged, ((0, 0, loc.length),))
            )
            got = (len(self._plan) - 1, 0, loc.length if loc.ranged else -1)
            self._start(got[0])
        n, off, length = got
        if n < self._planned:
            self._top_up(upto=n)
            self._ahead -= self._plan[n].members[0][2] if length < 0 else length
        try:
            data = await asyncio.shield(self._futures[n])  # other blocks of the read need it
        finally:
            self._top_up()
        if data is None:
            return None
        if length < 0 or (off == 0 and length == len(data)):
            return memoryview(data)
        if off + length > len(data):
            raise ObjectStoreError(f"short read of {loc.obj}: {len(data)} < {off + length} bytes")
        return memoryview(data)[off : off + length]

    def cancel(self) -> None:
        for fut in self._futures.values():
            if fut.done():
                if not fut.cancelled():
                    fut.exception()  # retrieved: no "never retrieved" warning
            else:
                fut.cancel()
