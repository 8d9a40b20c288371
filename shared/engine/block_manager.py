"""Fixed pool of KV blocks with refcounts and hash-based prefix caching (plain Python, no torch).

Free blocks wait in one queue ordered for reuse: blocks without a hash at the front (nothing to
lose), then cached blocks in least-recently-freed order. A cached block stays findable by its
hash while it sits in the queue, so a later request can revive it; it is evicted only when the
queue hands it out for new data. Evictions are recorded so the engine can copy the bytes out to
the KV pool before the block is overwritten (``drain_evicted``), every change to the set of
cached hashes is recorded as a ``CacheEvent`` (``drain_events``), and with ``record_computed``
every block that became cached because this engine computed it (not one loaded from outside) is
recorded too (``drain_computed``), so the engine can write it through to the pool.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CacheEvent:
    """Blocks that became findable (``stored``) or stopped being findable (``removed``)."""

    kind: str  # "stored" | "removed"
    hashes: list[str]  # hex


class BlockManager:
    """Owns block ids ``0..num_blocks-1``; callers hold them in per-sequence block tables."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        record_computed: bool = False,
    ):
        if num_blocks < 1:
            raise ValueError("BlockManager needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.record_computed = record_computed
        self._evicted: list[tuple[bytes, int]] = []
        self._computed: list[tuple[bytes, int]] = []
        self._events: list[CacheEvent] = []

    # ----- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner (cached-but-unused ones included)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """Block ids of the longest run of leading ``hashes`` already cached (no side effects)."""
        if not self.enable_prefix_caching:
            return []
        out: list[int] = []
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    # ----- allocation ----------------------------------------------------------------------
    def can_allocate(
        self, block_table: Sequence[int], num_tokens: int, cached_blocks: Sequence[int] = ()
    ) -> bool:
        need = self.blocks_for(num_tokens) - len(block_table) - len(cached_blocks)
        revived = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        return max(0, need) + revived <= len(self.free_queue)

    def allocate_slots(
        self, block_table: list[int], num_tokens: int, cached_blocks: Sequence[int] = ()
    ) -> bool:
        """Grow ``block_table`` in place so it holds ``num_tokens`` tokens.

        ``cached_blocks`` (from :meth:`find_cached_prefix`, only for an empty table) are shared
        first. Returns False, changing nothing, when the free queue is too short.
        """
        if not self.can_allocate(block_table, num_tokens, cached_blocks):
            return False
        for b in cached_blocks:
            if self.ref_counts[b] == 0:
                del self.free_queue[b]
            self.ref_counts[b] += 1
            block_table.append(b)
        while len(block_table) < self.blocks_for(num_tokens):
            block_table.append(self._pop_free())
        return True

    def free(self, block_table: Sequence[int]) -> None:
        """Drop one reference to each block; tail blocks enter the queue first (evicted first)."""
        for b in reversed(block_table):
            self.ref_counts[b] -= 1
            assert self.ref_counts[b] >= 0, f"double free of block {b}"
            if self.ref_counts[b] == 0:
                self.free_queue[b] = None
                if self.block_hash[b] is None:
                    self.free_queue.move_to_end(b, last=False)

    def cache_full_blocks(
        self,
        block_table: Sequence[int],
        block_hashes: Sequence[bytes],
        start: int,
        end: int,
        computed: bool = True,
    ) -> int:
        """Make blocks ``[start, end)`` of a table findable by hash; returns the new ``end``.
        ``computed``: this engine computed their KV (False: it was written from elsewhere, a
        push, and is not recorded for `drain_computed`)."""
        if not self.enable_prefix_caching:
            return end
        stored: list[str] = []
        for i in range(start, end):
            b, h = block_table[i], block_hashes[i]
            if self.block_hash[b] is None and h not in self.cached:
                self.block_hash[b] = h
                self.cached[h] = b
                stored.append(h.hex())
                if computed and self.record_computed:
                    self._computed.append((h, b))
        if stored:
            self._events.append(CacheEvent("stored", stored))
        return end

    def insert_cached(self, h: bytes) -> int | None:
        """Take a free block for externally loaded data under hash ``h``; None if already cached.

        The block is left unowned at the warm end of the free queue, findable by ``h``.
        """
        if h in self.cached or not self.free_queue:
            return None
        b = self._pop_free()
        self.ref_counts[b] = 0
        self.free_queue[b] = None
        self.block_hash[b] = h
        self.cached[h] = b
        self._events.append(CacheEvent("stored", [h.hex()]))
        return b

    def _pop_free(self) -> int:
        b, _ = self.free_queue.popitem(last=False)
        h = self.block_hash[b]
        if h is not None:
            self.block_hash[b] = None
            if self.cached.get(h) == b:
                del self.cached[h]
                self._evicted.append((h, b))
                self._events.append(CacheEvent("removed", [h.hex()]))
        self.ref_counts[b] = 1
        return b

    # ----- outbox --------------------------------------------------------------------------
    def drain_evicted(self) -> list[tuple[bytes, int]]:
        """Cached blocks handed out for new data since the last call: (hash, block id).

        Their bytes are intact until the next forward writes them.
        """
        out, self._evicted = self._evicted, []
        return out

    def drain_computed(self) -> list[tuple[bytes, int]]:
        """Blocks cached by `cache_full_blocks` since the last call (with ``record_computed``):
        (hash, block id). A block evicted meanwhile no longer holds that hash."""
        out, self._computed = self._computed, []
        return out

    def drain_events(self) -> list[CacheEvent]:
        out, self._events = self._events, []
        return out
