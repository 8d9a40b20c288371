"""`KVStore`: the async side of the kvstore. It drives `KVStoreCore` and does the I/O the core
asks for: spills to and restores from the SSD tier (MinIO calls in worker threads, several in
flight), and publishes the core's events in order through an injected ``publish`` callable.

A store without an SSD tier (``ssd=None``) drops evicted blocks. With one that is down, puts and
DRAM reads keep working, SSD reads count as misses and errors, and pending spills are retried
every ``retry_interval`` until the store is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict

from protos.kv_transfer_pb2 import BlockFrame
from services.kvstore import metrics as m
from services.kvstore.core import KVStoreCore, Tier
from services.kvstore.dram import BlockKey, Entry
from services.kvstore.ssd import MinioTier, ObjectStoreError
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
        spill_concurrency: int = 8,
        retry_interval: float = 1.0,
    ):
        self.core = core
        self.ssd = ssd
        self.publish = publish
        self.spill_concurrency = spill_concurrency
        self.retry_interval = retry_interval
        self.ssd_online = ssd is not None
        self.published_seq = 0
        self._spill_wake = asyncio.Event()
        self._event_wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def start(self, *, list_ssd: bool = True) -> None:
        """Learn what the SSD tier already holds (a restart keeps yesterday's blocks), then
        start the spill and event workers."""
        if self.ssd is not None and list_ssd:
            try:
                items = await asyncio.to_thread(lambda: list(self.ssd.list()))
                self.core.known_ssd(items)
            except ObjectStoreError as exc:
                self._ssd_failed("list", exc)
        self._tasks = [
            asyncio.create_task(self._spill_loop(), name="kvstore-spill"),
            asyncio.create_task(self._event_loop(), name="kvstore-events"),
        ]
        self._kick()

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []

    def _kick(self) -> None:
        self._spill_wake.set()
        self._event_wake.set()

    # ------------------------------------------------------------------ writes

    def put(self, frame: BlockFrame) -> bool:
        """Commit one assembled block to DRAM (synchronously); True if new."""
        block = normalize(frame)
        stored = self.core.put((block.fingerprint, block.key), block, block_nbytes(block))
        m.PUTS.labels("stored" if stored else "duplicate").inc()
        self._kick()
        return stored

    # ------------------------------------------------------------------ reads

    async def acquire(self, key: BlockKey) -> tuple[BlockFrame, bool] | None:
        """``(block, leased)``: from memory, else read through the SSD tier and promote.
        A leased block must be handed back with ``release(key)``."""
        start = time.perf_counter()
        local = self.core.acquire_local(key)
        if local is not None:
            m.HITS.labels("dram").inc()
            m.LATENCY.labels("get_dram").observe(time.perf_counter() - start)
            return local
        frame = await self._read_ssd(key)
        if frame is None:
            m.MISSES.inc()
            return None
        self.core.restored(key, frame, block_nbytes(frame))
        self._kick()
        m.HITS.labels("ssd").inc()
        m.RESTORES.inc()
        m.RESTORE_BYTES.inc(block_nbytes(frame))
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

    async def _read_ssd(self, key: BlockKey) -> BlockFrame | None:
        if self.ssd is None:
            self.core.missed(key)
            return None
        try:
            data = await asyncio.to_thread(self.ssd.get, key)
        except ObjectStoreError as exc:
            self._ssd_failed("get", exc)
            self.core.missed(key, forget=False)
            return None
        self.ssd_online = True
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

    def query(self, keys: Sequence[BlockKey]) -> list[Tier | None]:
        return [self.core.lookup(k) for k in keys]

    # ------------------------------------------------------------------ workers

    def _ssd_failed(self, op: str, exc: Exception) -> None:
        m.ERRORS.labels(op).inc()
        if self.ssd_online:
            log.warning("SSD tier %s failed, degrading to DRAM only: %s", op, exc)
        self.ssd_online = False

    async def _spill_loop(self) -> None:
        """``spill_concurrency`` writers, each taking the oldest pending block (a sliding
        window: a slow write never holds the others back)."""
        await asyncio.gather(*(self._spill_worker() for _ in range(self.spill_concurrency)))

    async def _spill_worker(self) -> None:
        while True:
            batch = self.core.next_spills(1)
            if not batch:
                await self._spill_wake.wait()
                self._spill_wake.clear()
                continue
            if self.ssd is None:
                self.core.spill_abandoned(batch[0].key)
                self._event_wake.set()
                continue
            ok = await self._spill_one(batch[0])
            self._event_wake.set()
            if not ok:
                await asyncio.sleep(self.retry_interval)

    async def _spill_one(self, e: Entry) -> bool:
        start = time.perf_counter()
        try:
            await asyncio.to_thread(lambda: self.ssd.put(e.key, e.payload.SerializeToString()))
        except ObjectStoreError as exc:
            self._ssd_failed("spill", exc)
            self.core.spill_done(e.key, ok=False)
            return False
        if not self.ssd_online:
            log.info("SSD tier back; spills resumed")
        self.ssd_online = True
        self.core.spill_done(e.key, ok=True)
        m.SPILLS.inc()
        m.SPILL_BYTES.inc(e.nbytes)
        m.LATENCY.labels("spill").observe(time.perf_counter() - start)
        return True

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
        """Wait until no spill is pending and every queued event is published (tests, bench)."""
        deadline = time.monotonic() + timeout
        while self.core.pending or self.published_seq < self.core.last_seq:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"flush: {len(self.core.pending)} spills pending, events published "
                    f"{self.published_seq}/{self.core.last_seq}"
                )
            self._kick()
            await asyncio.sleep(0.01)

    def stats(self) -> dict:
        return {
            **self.core.tier_counts(),
            "ssd_online": self.ssd_online,
            "counters": asdict(self.core.stats),
        }
