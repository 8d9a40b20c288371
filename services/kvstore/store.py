"""`KVStore`: the async side of the kvstore. It drives `KVStoreCore` and does the I/O the core
asks for: writes to the SSD tier (`SsdWriter`: spills of evicted blocks and write-behind of every
committed block, small blocks batched into chunk objects), reads back from it (`SsdReader`: the
blocks of a pull read ahead with coalesced ranged GETs in parallel), refreshes its view
of the bucket on a miss (blocks written by another instance or before a restart; `MissCache`),
deletes the least recently used objects when the SSD tier is over its budget (``ssd_bytes``),
and publishes the core's events in order through an injected ``publish`` callable.

A store without an SSD tier (``ssd=None``) drops evicted blocks. With one that is down, puts and
DRAM reads keep working, SSD reads count as misses and errors, and pending writes are retried
every ``retry_interval`` until the store is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict

from protos.kv_transfer_pb2 import BlockFrame
from services.kvstore import metrics as m
from services.kvstore.chunks import ChunkFormatError, SsdLoc
from services.kvstore.core import KVStoreCore, Tier
from services.kvstore.dram import BlockKey
from services.kvstore.miss_cache import MissCache
from services.kvstore.reader import Fetch, ReadOptions, SsdReader
from services.kvstore.ssd import MinioTier, ObjectStoreError
from services.kvstore.writer import SsdWriter, WriterOptions
from shared.protocol.errors import StrataError
from shared.protocol.kv import KVEvent

log = logging.getLogger(__name__)

FRAME_OVERHEAD = 256  # bytes of metadata counted per block on top of data + scales


def normalize(frame: BlockFrame) -> BlockFrame:
    """The content-addressed form of a pushed block: request-specific fields cleared."""
    if not frame.key:
        raise StrataError("bad_request", "a pool block needs a key (its content hash)")
    if frame.num_chunks > 1:
        raise StrataError("bad_request", f"block {frame.key} is a chunk; assemble it first")
    out = BlockFrame()
    out.CopyFrom(frame)
    out.request_id, out.last, out.total_tokens = "", False, 0
    out.chunk_index, out.num_chunks = 0, 1
    return out


def block_nbytes(frame: BlockFrame) -> int:
    return len(frame.data) + len(frame.scales) + FRAME_OVERHEAD


class KVStore:
    """Tiered block store; call ``start()`` before use and ``stop()`` on the way out."""

    def __init__(
        self,
        core: KVStoreCore,
        ssd: MinioTier | None,
        *,
        publish: Callable[[KVEvent], Awaitable[None]] | None = None,
        writer: WriterOptions | None = None,
        reader: ReadOptions | None = None,
        refresh_interval: float = 1.0,
        negative_ttl: float = 1.0,
    ):
        self.core = core
        self.ssd = ssd
        self.publish = publish
        self.opts = writer or WriterOptions()
        self.retry_interval = self.opts.retry_interval
        self.ssd_online = ssd is not None
        m.SSD_ONLINE.set(1 if self.ssd_online else 0)
        self.published_seq = 0
        self.misses = MissCache(refresh_interval, negative_ttl)
        self.writer = SsdWriter(core, ssd, self.opts, self)
        self.reader = None if ssd is None else SsdReader(ssd, reader)
        self._event_wake = asyncio.Event()
        self._evict_wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._chunks_seen: set[str] = set()
        self._refreshing: dict[str, asyncio.Lock] = {}

    async def start(self, *, list_ssd: bool = True) -> None:
        """Learn what the SSD tier already holds (a restart keeps yesterday's blocks), then
        start the write and event workers."""
        if self.ssd is not None and list_ssd:
            await self._refresh_view(None)
        self._tasks = [
            asyncio.create_task(self.writer.run(), name="kvstore-ssd-writer"),
            asyncio.create_task(self._event_loop(), name="kvstore-events"),
        ]
        if self.ssd is not None:
            self._tasks.append(asyncio.create_task(self._evict_loop(), name="kvstore-ssd-evict"))
        self._kick()

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []
        if self.reader is not None:
            self.reader.close()

    def _kick(self) -> None:
        self.writer.wake()
        self._event_wake.set()
        self._evict_wake.set()

    # ---- callbacks of the writer
    def events_ready(self) -> None:
        self._event_wake.set()
        self._evict_wake.set()  # a write may have taken the SSD tier over its budget

    def ssd_ok(self) -> None:
        if not self.ssd_online:
            log.info("SSD tier back; writes resumed")
        self.ssd_online = True
        m.SSD_ONLINE.set(1)

    def ssd_failed(self, op: str, exc: Exception) -> None:
        m.ERRORS.labels(op).inc()
        if self.ssd_online:
            log.warning("SSD tier %s failed, degrading to DRAM only: %s", op, exc)
        self.ssd_online = False
        m.SSD_ONLINE.set(0)

    def wrote_chunk(self, name: str) -> None:
        self._chunks_seen.add(name)

    # ------------------------------------------------------------------ writes

    def put(self, frame: BlockFrame) -> bool:
        """Commit one assembled block to DRAM (synchronously); True if new. Its SSD write
        (write-behind, or a spill when it is evicted) happens in the background."""
        block = normalize(frame)
        key = (block.fingerprint, block.key)
        stored = self.core.put(key, block, block_nbytes(block))
        self.misses.forget(key)
        m.PUTS.labels("stored" if stored else "duplicate").inc()
        self._kick()
        return stored

    # ------------------------------------------------------------------ reads

    async def acquire(self, key: BlockKey) -> tuple[BlockFrame, bool] | None:
        """``(block, leased)``: from memory, else read through the SSD tier and promote.
        A leased block must be handed back with ``release(key)``."""
        async with contextlib.aclosing(self.acquire_many([key])) as run:
            async for _, got in run:
                return got
        return None

    async def acquire_many(
        self, keys: Sequence[BlockKey]
    ) -> AsyncIterator[tuple[BlockKey, tuple[BlockFrame, bool] | None]]:
        """``(key, (block, leased) or None)`` for each of ``keys`` in order: memory hits at
        once; the blocks only in the SSD tier are read ahead from the start of the run
        (`SsdReader`: adjacent blocks in one ranged GET, GETs in parallel, up to 64 MiB ahead
        by default), so a caller
        streaming them out sends early blocks while later ones download. Leased blocks must
        be handed back with ``release(key)``. Close the iterator (``aclosing``) when stopping
        early: it drops the reads nobody will take."""
        if self.ssd is not None:  # keys unknown here: look in the bucket once per model
            unknown = [k for k in keys if self.core.lookup(k) is None]
            for fp in dict.fromkeys(k[0] for k in unknown):
                await self.refresh(fp, [k for k in unknown if k[0] == fp])
        fetch = None
        if self.reader is not None:
            want = {k: self.core.ssd[k] for k in keys if self.core.lookup(k) == "ssd"}
            fetch = self.reader.fetch(want)
        try:
            for key in keys:
                yield key, await self._acquire_one(key, fetch)
        finally:
            if fetch is not None:
                fetch.cancel()

    async def _acquire_one(self, key: BlockKey, fetch: Fetch | None):
        start = time.perf_counter()
        local = self.core.acquire_local(key)
        if local is not None:
            m.HITS.labels("dram").inc()
            m.LATENCY.labels("get_dram").observe(time.perf_counter() - start)
            return local
        loc = self.core.ssd.get(key)
        frame = None if loc is None or fetch is None else await self._read_ssd(key, loc, fetch)
        if frame is None or loc is None:
            if loc is None:
                self.core.missed(key, forget=False)
            m.MISSES.inc()
            return None
        nbytes = block_nbytes(frame)  # once: reading .data copies the bytes
        self.core.restored(key, frame, nbytes, loc)
        self._kick()
        m.HITS.labels("ssd").inc()
        m.RESTORES.inc()
        m.RESTORE_BYTES.inc(nbytes)
        m.LATENCY.labels("get_ssd").observe(time.perf_counter() - start)
        leased = self.core.dram.acquire(key) is not None
        return frame, leased

    def release(self, key: BlockKey) -> None:
        self.core.dram.release(key)

    async def get(self, key: BlockKey) -> BlockFrame | None:
        got = await self.acquire(key)
        if got is None:
            return None
        frame, leased = got
        if leased:
            self.release(key)
        return frame

    async def _read_ssd(self, key: BlockKey, loc: SsdLoc, fetch: Fetch) -> BlockFrame | None:
        try:
            data = await fetch.take(key, loc)
        except ObjectStoreError as exc:
            self.ssd_failed("get", exc)
            self.core.missed(key, forget=False)
            return None
        self.ssd_ok()
        if data is None:
            self.core.missed(key)
            return None
        try:
            return BlockFrame.FromString(data)
        except Exception as exc:  # noqa: BLE001 - a corrupt object is a miss, not a crash
            m.ERRORS.labels("decode").inc()
            log.warning("corrupt block object %s: %s", key, exc)
            self.core.missed(key)
            return None

    async def query(self, keys: Sequence[BlockKey]) -> list[Tier | None]:
        """Tier of each key; keys unknown here are looked for in the bucket (`refresh`)."""
        tiers = [self.core.lookup(k) for k in keys]
        missing = [k for k, t in zip(keys, tiers, strict=True) if t is None]
        if not missing or self.ssd is None:
            return tiers
        for fp in dict.fromkeys(k[0] for k in missing):
            await self.refresh(fp, [k for k in missing if k[0] == fp])
        return [self.core.lookup(k) for k in keys]

    # ------------------------------------------------------------------ freshness

    async def refresh(self, fingerprint: str, keys: Sequence[BlockKey]) -> None:
        """Missing ``keys`` (of one fingerprint): re-read the bucket's view of the fingerprint
        unless it was refreshed recently or the keys are known absent (`MissCache`)."""
        if self.ssd is None or not self.misses.need_refresh(fingerprint, keys):
            return
        lock = self._refreshing.setdefault(fingerprint, asyncio.Lock())
        if lock.locked() and not self.ssd_online:
            return  # do not queue queries behind a listing of a store that is down
        async with lock:  # one refresh per fingerprint at a time; waiters reuse its result
            if self.misses.need_refresh(fingerprint, keys):
                await self._refresh_view(fingerprint)
        self.misses.missed([k for k in keys if self.core.lookup(k) is None])

    async def _refresh_view(self, fingerprint: str | None) -> None:
        """List the bucket (one fingerprint, or all at start-up), read the headers of chunks not
        seen yet, and tell the core what is there."""
        assert self.ssd is not None
        if fingerprint is not None:
            self.misses.refreshed(fingerprint)
            m.REFRESHES.inc()
        try:
            listing = await asyncio.to_thread(self.ssd.list, fingerprint)
        except ObjectStoreError as exc:
            self.ssd_failed("list", exc)
            return
        self.ssd_ok()
        items: list[tuple[BlockKey, SsdLoc]] = list(listing.blocks)
        fresh = [(fp, name) for fp, name in listing.chunks if name not in self._chunks_seen]
        sem = asyncio.Semaphore(self.opts.concurrency)

        async def index(fp: str, name: str) -> None:
            async with sem:
                try:
                    locs = await asyncio.to_thread(self.ssd.read_chunk_index, name)
                except ObjectStoreError as exc:
                    self.ssd_failed("list", exc)
                    return
                except ChunkFormatError as exc:
                    m.ERRORS.labels("decode").inc()
                    log.warning("skipping object %s: %s", name, exc)
                    locs = {}
                self._chunks_seen.add(name)
                items.extend(((fp, h), loc) for h, loc in (locs or {}).items())

        await asyncio.gather(*(index(fp, name) for fp, name in fresh))
        for fp in {fp for fp, _ in listing.chunks} | {k[0] for k, _ in listing.blocks}:
            self.misses.refreshed(fp)
        # Oldest objects first: they become the least recently used of the SSD tier's budget.
        items.sort(key=lambda it: (listing.modified.get(it[1].obj, 0.0), it[1].obj))
        found = self.core.known_ssd(items)
        if fingerprint is not None:
            m.REFRESH_FOUND.inc(found)
        if found:
            self._kick()

    # ------------------------------------------------------------------ SSD tier budget

    async def _evict_loop(self) -> None:
        """Keep the SSD tier under its budget: the core picks the least recently used objects
        (and announces their blocks removed); delete them, retrying failed deletes."""
        assert self.ssd is not None
        sem = asyncio.Semaphore(self.opts.concurrency)

        async def delete(name: str) -> bool:
            async with sem:
                try:
                    await asyncio.to_thread(self.ssd.delete_object, name)
                except ObjectStoreError as exc:
                    self.ssd_failed("delete", exc)
                    self.core.delete_done(name, ok=False)
                    return False
            self.core.delete_done(name, ok=True)
            return True

        while True:
            await self._evict_wake.wait()
            self._evict_wake.clear()
            blocks = self.core.stats.ssd_evicted_blocks
            for name in self.core.evict_ssd():
                m.SSD_EVICTED_OBJECTS.inc()
                m.SSD_EVICTED_BYTES.inc(self.core.deleting[name])
            m.SSD_EVICTED_BLOCKS.inc(self.core.stats.ssd_evicted_blocks - blocks)
            if not self.core.deleting:
                continue
            self._event_wake.set()
            oks = await asyncio.gather(*(delete(n) for n in list(self.core.deleting)))
            if all(oks):
                self.ssd_ok()
            else:
                await asyncio.sleep(self.retry_interval)
                self._evict_wake.set()

    # ------------------------------------------------------------------ events

    async def _event_loop(self) -> None:
        backlog: list[KVEvent] = []
        while True:
            if not backlog:
                await self._event_wake.wait()
                self._event_wake.clear()
                backlog = self.core.drain_events()
            while backlog:
                ev = backlog[0]
                if self.publish is not None:
                    try:
                        await self.publish(ev)
                    except Exception as exc:  # noqa: BLE001 - keep order: retry this one
                        m.ERRORS.labels("publish").inc()
                        log.warning("publishing KV event %d failed: %s", ev.seq, exc)
                        await asyncio.sleep(self.retry_interval)
                        continue
                self.published_seq = ev.seq
                backlog.pop(0)

    async def flush(self, timeout: float = 10.0) -> None:
        """Wait until every block is committed to the SSD tier (no spill or write-behind left)
        and every queued event is published: graceful shutdown, tests, bench."""
        deadline = time.monotonic() + timeout
        while (
            self.core.writes_outstanding
            or self.core.deleting
            or self.published_seq < self.core.last_seq
        ):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"flush: {self.core.writes_outstanding} SSD writes and "
                    f"{len(self.core.deleting)} deletes outstanding, events "
                    f"published {self.published_seq}/{self.core.last_seq}"
                )
            self._kick()
            await asyncio.sleep(0.01)

    def stats(self) -> dict:
        return {
            **self.core.tier_counts(),
            "ssd_online": self.ssd_online,
            "counters": asdict(self.core.stats),
        }
