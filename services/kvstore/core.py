"""The kvstore's bookkeeping core: DRAM tier + what is known to be in the SSD tier (and where) +
blocks waiting to be written there + the KV event outbox. Pure and synchronous (no NATS, gRPC or
MinIO): the async `KVStore` feeds it what happened and performs the I/O it asks for.

Two kinds of SSD writes, handed out by ``next_spills`` (spills first: they hold memory):
- *spill*: a block evicted from DRAM that is not in the SSD tier yet (kept in memory until the
  write commits, bounded by ``spill_buffer_bytes``);
- *write-behind*: every block committed to DRAM is also queued for the SSD tier (a bounded queue
  of keys, ``write_behind_blocks``; when full the oldest are skipped and spill on eviction), so a
  restart keeps the pool. Evicting a block that is already persisted needs no spill.

Tier semantics seen from outside (``lookup``):
- "dram": in the DRAM LRU, or evicted and still in memory waiting for its spill to commit;
- "ssd": committed in the object store (known from a write, a read or the start-up listing).

SSD tier budget (``ssd_bytes``, 0 = unbounded): the core counts the bytes of every object it knows
(written, read or listed) and keeps the objects in LRU order by the last read or write of any of
their blocks. When the bytes exceed the budget, ``evict_ssd`` takes the least recently used
objects out of the index whole (a chunk's blocks go together), announces ``ssd removed`` for
their blocks at once and hands their names out for deletion (``delete_done`` when it committed).

Events (`KVEvent`, one sequence per incarnation) are queued only after the bytes are committed
in that tier. An evicted block is announced ``ssd stored`` when its spill commits and only then
``dram removed``, so a block never looks absent while it is moving down.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from services.kvstore.chunks import SsdLoc
from services.kvstore.dram import BlockKey, DramTier, Entry
from shared.protocol.kv import KVEvent

Tier = Literal["dram", "ssd"]
EVENT_MAX_HASHES = 2000  # keeps one event well under the NATS payload limit


@dataclass
class Pending:
    """An evicted (or refused) block whose spill has not committed yet."""

    entry: Entry
    announced_dram: bool  # a "dram stored" event went out, so "dram removed" must follow
    in_flight: bool = False


@dataclass
class SsdObject:
    """An object of the SSD tier as the core knows it: its bytes and the blocks indexed in it."""

    nbytes: int
    keys: set[BlockKey]


@dataclass
class CoreStats:
    hits_dram: int = 0
    hits_ssd: int = 0
    misses: int = 0
    puts: int = 0
    duplicate_puts: int = 0
    spills: int = 0
    spill_bytes: int = 0
    spill_failures: int = 0
    spill_dropped: int = 0
    persists: int = 0
    persist_skipped: int = 0
    restores: int = 0
    restore_bytes: int = 0
    ssd_evicted_objects: int = 0
    ssd_evicted_blocks: int = 0
    ssd_evicted_bytes: int = 0


class KVStoreCore:
    """See the module docstring. ``spill_buffer_bytes`` bounds memory held by pending spills;
    when the object store is down for long, the oldest pending blocks are dropped (counted).
    ``write_behind_blocks`` bounds the write-behind queue (0 = write-behind off). ``ssd_bytes``
    bounds the SSD tier (0 = unbounded; see the module docstring)."""

    def __init__(
        self,
        instance_id: str,
        incarnation: str,
        dram_bytes: int,
        spill_buffer_bytes: int | None = None,
        clock=time.time,
        write_behind_blocks: int = 0,
        ssd_bytes: int = 0,
    ):
        self.instance_id = instance_id
        self.incarnation = incarnation
        self.dram = DramTier(dram_bytes)
        self.spill_buffer_bytes = dram_bytes if spill_buffer_bytes is None else spill_buffer_bytes
        self.pending: OrderedDict[BlockKey, Pending] = OrderedDict()
        self.pending_bytes = 0
        self.ssd: dict[BlockKey, SsdLoc] = {}
        self.ssd_budget = ssd_bytes
        self.ssd_objects: OrderedDict[str, SsdObject] = OrderedDict()  # least recent first
        self.ssd_bytes = 0  # bytes of ssd_objects
        self.deleting: dict[str, int] = {}  # evicted objects whose delete has not committed
        self._deleted: OrderedDict[str, None] = OrderedDict()  # recent deletes (late reads)
        self.write_behind_blocks = write_behind_blocks
        self.persist_q: OrderedDict[BlockKey, float] = OrderedDict()  # key -> queued at (clock)
        self.persisting: dict[BlockKey, Entry] = {}  # write-behind writes in flight
        self.stats = CoreStats()
        self._seq = 0
        self._outbox: list[KVEvent] = []
        self._clock = clock

    # ------------------------------------------------------------------ events

    def _event(self, tier: Tier, kind: Literal["stored", "removed"], hashes: list[str]) -> None:
        for i in range(0, len(hashes), EVENT_MAX_HASHES):
            self._seq += 1
            self._outbox.append(
                KVEvent(
                    instance_id=self.instance_id,
                    incarnation=self.incarnation,
                    seq=self._seq,
                    tier=tier,
                    kind=kind,
                    hashes=hashes[i : i + EVENT_MAX_HASHES],
                    ts=self._clock(),
                )
            )

    def drain_events(self) -> list[KVEvent]:
        """Events queued since the last call, in sequence order."""
        out, self._outbox = self._outbox, []
        return out

    # ------------------------------------------------------------------ writes

    def put(self, key: BlockKey, payload: Any, nbytes: int) -> bool:
        """Commit a block to DRAM (or, with no room, queue it straight for the SSD tier).
        Returns True when new bytes were stored; a duplicate only refreshes recency."""
        if key in self.pending:  # re-put while spilling: the spill carries it down anyway
            self.stats.duplicate_puts += 1
            return False
        res = self.dram.put(key, payload, nbytes)
        if res.refused:
            if key not in self.ssd:
                self._queue_spill(Entry(key, payload, nbytes), announced_dram=False)
                self.stats.puts += 1
                return True
            self.stats.duplicate_puts += 1
            return False
        if not res.stored:
            self._ssd_touch(key)
            self.stats.duplicate_puts += 1
            return False
        self.stats.puts += 1
        self._event("dram", "stored", [key[1]])
        self._evicted(res.evicted)
        self._queue_persist(key)
        return True

    def _queue_persist(self, key: BlockKey) -> None:
        if not self.write_behind_blocks or key in self.ssd or key in self.persisting:
            return
        self.persist_q[key] = self._clock()
        while len(self.persist_q) > self.write_behind_blocks:
            self.persist_q.popitem(last=False)  # stays in DRAM; spills if evicted
            self.stats.persist_skipped += 1

    def _evicted(self, entries: list[Entry]) -> None:
        gone = []
        for e in entries:
            self.persist_q.pop(e.key, None)
            if e.key in self.ssd:
                gone.append(e.key[1])
            elif self.persisting.pop(e.key, None) is not None:  # its write is in flight
                self._queue_spill(e, announced_dram=True, in_flight=True)
            else:
                self._queue_spill(e, announced_dram=True)
        if gone:
            self._event("dram", "removed", gone)

    def _queue_spill(self, entry: Entry, announced_dram: bool, in_flight: bool = False) -> None:
        self.pending[entry.key] = Pending(entry, announced_dram, in_flight)
        self.pending_bytes += entry.nbytes
        while self.pending_bytes > self.spill_buffer_bytes:
            victim = next((k for k, p in self.pending.items() if not p.in_flight), None)
            if victim is None:
                break
            p = self.pending.pop(victim)
            self.pending_bytes -= p.entry.nbytes
            self.stats.spill_dropped += 1
            if p.announced_dram:
                self._event("dram", "removed", [victim[1]])

    # ------------------------------------------------------------------ spills

    def next_spills(self, max_n: int = 1, max_bytes: int = 0, small_bytes: int = 0) -> list[Entry]:
        """Blocks to write now, marked in flight: pending spills first, then write-behind, oldest
        first. The first one decides: a block of ``small_bytes`` or more (or any block when
        ``max_bytes`` is 0) goes alone; a small one is joined by further small blocks of the same
        fingerprint up to ``max_n`` blocks and ``max_bytes`` bytes (one chunk object)."""
        batch: list[Entry] = []
        total = 0
        for e in self._candidates():
            if not batch:
                batch.append(e)
                total = e.nbytes
                if max_bytes <= 0 or e.nbytes >= small_bytes:
                    break
                continue
            if len(batch) >= max_n:
                break
            if e.key[0] == batch[0].key[0] and e.nbytes < small_bytes:
                if total + e.nbytes <= max_bytes:
                    batch.append(e)
                    total += e.nbytes
        for e in batch:
            p = self.pending.get(e.key)
            if p is not None:
                p.in_flight = True
            else:
                del self.persist_q[e.key]
                self.persisting[e.key] = e
        return batch

    def write_delay(self, linger: float) -> float:
        """Seconds to wait before taking a batch so blocks queued together (one push) land in
        one chunk: 0 when a spill is waiting (it holds memory) or the oldest queued write-behind
        is ``linger`` old."""
        if any(not p.in_flight for p in self.pending.values()) or not self.persist_q:
            return 0.0
        oldest = next(iter(self.persist_q.values()))
        return max(0.0, min(linger, oldest + linger - self._clock()))

    def _candidates(self):
        for p in self.pending.values():
            if not p.in_flight:
                yield p.entry
        for key in self.persist_q:
            e = self.dram.entry(key)
            if e is not None:
                yield e

    def spill_done(self, key: BlockKey, ok: bool, loc: SsdLoc | None = None) -> None:
        """The object store write of ``key`` finished (``ok``, at ``loc``) or failed (it is
        retried: a spill stays pending, a write-behind goes back to the queue's front)."""
        p = self.pending.get(key)
        if p is None:
            self._persist_done(key, ok, loc)
            return
        if not ok:
            p.in_flight = False
            self.stats.spill_failures += 1
            return
        del self.pending[key]
        self.pending_bytes -= p.entry.nbytes
        self.stats.spills += 1
        self.stats.spill_bytes += p.entry.nbytes
        self._ssd_add(key, loc or SsdLoc("", 0, p.entry.nbytes))
        self._event("ssd", "stored", [key[1]])
        if p.announced_dram:
            self._event("dram", "removed", [key[1]])

    def _persist_done(self, key: BlockKey, ok: bool, loc: SsdLoc | None) -> None:
        e = self.persisting.pop(key, None)
        if e is None:
            return
        if not ok:
            self.stats.spill_failures += 1
            if key in self.dram and key not in self.ssd:
                self.persist_q[key] = 0.0  # a retry: due now
                self.persist_q.move_to_end(key, last=False)
            return
        self.stats.persists += 1
        self.stats.spill_bytes += e.nbytes
        if key not in self.ssd and self._ssd_add(key, loc or SsdLoc("", 0, e.nbytes)):
            self._event("ssd", "stored", [key[1]])

    @property
    def writes_outstanding(self) -> int:
        """Blocks not yet committed to the SSD tier: pending spills, queued or in-flight
        write-behind (a graceful shutdown waits for 0)."""
        return len(self.pending) + len(self.persist_q) + len(self.persisting)

    def spill_abandoned(self, key: BlockKey) -> None:
        """No SSD tier: the pending block is dropped for good."""
        if self.persisting.pop(key, None) is not None:
            return
        p = self.pending.pop(key, None)
        if p is None:
            return
        self.pending_bytes -= p.entry.nbytes
        self.stats.spill_dropped += 1
        if p.announced_dram:
            self._event("dram", "removed", [key[1]])

    @property
    def last_seq(self) -> int:
        """Sequence number of the newest event queued so far."""
        return self._seq

    # ------------------------------------------------------------------ reads

    def lookup(self, key: BlockKey) -> Tier | None:
        if key in self.dram or key in self.pending:
            return "dram"
        if key in self.ssd:
            return "ssd"
        return None

    def acquire_local(self, key: BlockKey) -> tuple[Any, bool] | None:
        """``(payload, leased)`` from memory, counting a DRAM hit; None when not in memory.
        A leased payload (from the LRU) must be handed back with ``dram.release``."""
        payload = self.dram.acquire(key)
        if payload is not None:
            self._ssd_touch(key)
            self.stats.hits_dram += 1
            return payload, True
        p = self.pending.get(key)
        if p is not None:
            self.stats.hits_dram += 1
            return p.entry.payload, False
        return None

    def restored(self, key: BlockKey, payload: Any, nbytes: int, loc: SsdLoc) -> None:
        """A read found ``key`` in the object store at ``loc``: count the hit, promote it."""
        self.stats.hits_ssd += 1
        self.stats.restores += 1
        self.stats.restore_bytes += nbytes
        if key not in self.ssd:
            if self._ssd_add(key, loc):
                self._event("ssd", "stored", [key[1]])
        else:
            self._ssd_touch(key)
        self.put(key, payload, nbytes)

    def missed(self, key: BlockKey, *, forget: bool = True) -> None:
        """Neither tier had ``key``; if the SSD index claimed it, forget it (unless the store
        could not be asked: ``forget=False``)."""
        self.stats.misses += 1
        if forget and self._ssd_forget(key):
            self._event("ssd", "removed", [key[1]])

    def known_ssd(self, items: Iterable[tuple[BlockKey, SsdLoc]]) -> int:
        """Blocks found in the object store (listing at start-up or a refresh on a miss: written
        before a restart or by another instance); new ones announced per fingerprint and taken
        off the write-behind queue. Returns how many were new."""
        new: dict[str, list[str]] = {}
        for key, loc in items:
            if key not in self.ssd and self._ssd_add(key, loc):
                self.persist_q.pop(key, None)
                new.setdefault(key[0], []).append(key[1])
        for hashes in new.values():
            self._event("ssd", "stored", hashes)
        return sum(len(h) for h in new.values())

    # ------------------------------------------------------------------ SSD tier budget

    def _ssd_add(self, key: BlockKey, loc: SsdLoc) -> bool:
        """Index ``key`` at ``loc`` and count its object (the most recently used now). False
        (nothing indexed) when the object was evicted: a read or listing that raced its delete."""
        name = loc.obj or f"{key[0]}/{key[1]}"  # no name (core tests): one object per block
        if name in self.deleting or name in self._deleted:
            return False
        self.ssd[key] = loc
        obj = self.ssd_objects.get(name)
        if obj is None:
            obj = self.ssd_objects[name] = SsdObject(0, set())
        else:
            self.ssd_objects.move_to_end(name)
        obj.keys.add(key)
        size = loc.offset + loc.length  # a chunk's blocks lie back to back up to its end
        if size > obj.nbytes:
            self.ssd_bytes += size - obj.nbytes
            obj.nbytes = size
        return True

    def _ssd_touch(self, key: BlockKey) -> None:
        loc = self.ssd.get(key)
        if loc is not None:
            name = loc.obj or f"{key[0]}/{key[1]}"
            if name in self.ssd_objects:
                self.ssd_objects.move_to_end(name)

    def _ssd_forget(self, key: BlockKey) -> bool:
        loc = self.ssd.pop(key, None)
        if loc is None:
            return False
        name = loc.obj or f"{key[0]}/{key[1]}"
        obj = self.ssd_objects.get(name)
        if obj is not None:
            obj.keys.discard(key)
            if not obj.keys:  # nothing of it indexed any more: no longer counted
                del self.ssd_objects[name]
                self.ssd_bytes -= obj.nbytes
        return True

    def evict_ssd(self) -> list[str]:
        """While the SSD tier is over budget: take the least recently used objects out of the
        index, announce ``ssd removed`` for their blocks and return their names, to be deleted
        (then ``delete_done``). A block evicted here that is still in DRAM spills again when
        it leaves DRAM."""
        names: list[str] = []
        removed: dict[str, list[str]] = {}
        while self.ssd_budget and self.ssd_bytes > self.ssd_budget and self.ssd_objects:
            name, obj = self.ssd_objects.popitem(last=False)
            self.ssd_bytes -= obj.nbytes
            for key in obj.keys:
                del self.ssd[key]
                removed.setdefault(key[0], []).append(key[1])
            self.deleting[name] = obj.nbytes
            self.stats.ssd_evicted_objects += 1
            self.stats.ssd_evicted_blocks += len(obj.keys)
            self.stats.ssd_evicted_bytes += obj.nbytes
            names.append(name)
        for hashes in removed.values():
            self._event("ssd", "removed", hashes)
        return names

    def delete_done(self, name: str, ok: bool) -> None:
        """The delete of evicted object ``name`` committed (``ok``) or failed (retry it)."""
        if not ok or self.deleting.pop(name, None) is None:
            return
        self._deleted[name] = None
        while len(self._deleted) > 4096:
            self._deleted.popitem(last=False)

    # ------------------------------------------------------------------ introspection

    def tier_counts(self) -> dict[str, int]:
        return {
            "dram_blocks": len(self.dram),
            "dram_bytes": self.dram.used_bytes,
            "dram_budget_bytes": self.dram.budget_bytes,
            "dram_leased": self.dram.leased(),
            "pending_spill_blocks": len(self.pending),
            "pending_spill_bytes": self.pending_bytes,
            "ssd_blocks": len(self.ssd),
            "ssd_bytes": self.ssd_bytes,
            "ssd_budget_bytes": self.ssd_budget,
            "ssd_deleting_objects": len(self.deleting),
            "write_behind_blocks": len(self.persist_q) + len(self.persisting),
        }
