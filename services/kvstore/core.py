"""The kvstore's bookkeeping core: DRAM tier + what is known to be in the SSD tier + blocks
waiting to spill + the KV event outbox. Pure and synchronous (no NATS, gRPC or MinIO): the async
`KVStore` feeds it what happened and performs the I/O it asks for.

Tier semantics seen from outside (``lookup``):
- "dram": in the DRAM LRU, or evicted and still in memory waiting for its spill to commit;
- "ssd": committed in the object store (known from a write, a read or the start-up listing).

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
    restores: int = 0
    restore_bytes: int = 0


class KVStoreCore:
    """See the module docstring. ``spill_buffer_bytes`` bounds memory held by pending spills;
    when the object store is down for long, the oldest pending blocks are dropped (counted)."""

    def __init__(
        self,
        instance_id: str,
        incarnation: str,
        dram_bytes: int,
        spill_buffer_bytes: int | None = None,
        clock=time.time,
    ):
        self.instance_id = instance_id
        self.incarnation = incarnation
        self.dram = DramTier(dram_bytes)
        self.spill_buffer_bytes = dram_bytes if spill_buffer_bytes is None else spill_buffer_bytes
        self.pending: OrderedDict[BlockKey, Pending] = OrderedDict()
        self.pending_bytes = 0
        self.ssd: dict[BlockKey, int] = {}  # key -> object bytes
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
            self.stats.duplicate_puts += 1
            return False
        self.stats.puts += 1
        self._event("dram", "stored", [key[1]])
        self._evicted(res.evicted)
        return True

    def _evicted(self, entries: list[Entry]) -> None:
        gone = []
        for e in entries:
            if e.key in self.ssd:
                gone.append(e.key[1])
            else:
                self._queue_spill(e, announced_dram=True)
        if gone:
            self._event("dram", "removed", gone)

    def _queue_spill(self, entry: Entry, announced_dram: bool) -> None:
        self.pending[entry.key] = Pending(entry, announced_dram)
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

    def next_spills(self, max_n: int) -> list[Entry]:
        """Up to ``max_n`` pending blocks to write now (oldest first); marked in flight."""
        out = []
        for p in self.pending.values():
            if len(out) >= max_n:
                break
            if not p.in_flight:
                p.in_flight = True
                out.append(p.entry)
        return out

    def spill_done(self, key: BlockKey, ok: bool) -> None:
        """The object store write of ``key`` finished (``ok``) or failed (stays pending)."""
        p = self.pending.get(key)
        if p is None:
            return
        if not ok:
            p.in_flight = False
            self.stats.spill_failures += 1
            return
        del self.pending[key]
        self.pending_bytes -= p.entry.nbytes
        self.stats.spills += 1
        self.stats.spill_bytes += p.entry.nbytes
        self.ssd[key] = p.entry.nbytes
        self._event("ssd", "stored", [key[1]])
        if p.announced_dram:
            self._event("dram", "removed", [key[1]])

    def spill_abandoned(self, key: BlockKey) -> None:
        """No SSD tier: the pending block is dropped for good."""
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
            self.stats.hits_dram += 1
            return payload, True
        p = self.pending.get(key)
        if p is not None:
            self.stats.hits_dram += 1
            return p.entry.payload, False
        return None

    def restored(self, key: BlockKey, payload: Any, nbytes: int) -> None:
        """A read found ``key`` in the object store: count the hit, promote it to DRAM."""
        self.stats.hits_ssd += 1
        self.stats.restores += 1
        self.stats.restore_bytes += nbytes
        if key not in self.ssd:
            self.ssd[key] = nbytes
            self._event("ssd", "stored", [key[1]])
        self.put(key, payload, nbytes)

    def missed(self, key: BlockKey, *, forget: bool = True) -> None:
        """Neither tier had ``key``; if the SSD index claimed it, forget it (unless the store
        could not be asked: ``forget=False``)."""
        self.stats.misses += 1
        if forget and self.ssd.pop(key, None) is not None:
            self._event("ssd", "removed", [key[1]])

    def known_ssd(self, items: Iterable[tuple[BlockKey, int]]) -> None:
        """Objects found by listing the bucket at start-up; announced per fingerprint."""
        new: dict[str, list[str]] = {}
        for key, nbytes in items:
            if key not in self.ssd:
                self.ssd[key] = nbytes
                new.setdefault(key[0], []).append(key[1])
        for hashes in new.values():
            self._event("ssd", "stored", hashes)

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
            "ssd_bytes": sum(self.ssd.values()),
        }
