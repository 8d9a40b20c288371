"""Fixed pool of KV blocks with refcounts and hash-based prefix caching (plain Python, no torch).

Free blocks wait in one queue ordered for reuse: blocks without a hash at the front (nothing to
lose), then cached blocks in least-recently-freed order. A cached block stays findable by its
hash while it sits in the queue, so a later request can revive it; it is evicted only when the
queue hands it out for new data. Evictions are recorded so the engine can copy the bytes out to
the KV pool before the block is overwritten (``drain_evicted``), every change to the set of
cached hashes is recorded as a ``CacheEvent`` (``drain_events``), and blocks this engine computed
(not ones loaded from outside) are recorded for the pool (``drain_computed``) by a save policy:

- ``"all"``: every block as it becomes cached (write-through);
- ``"reused"``: a block when a second request uses it (a prefix hit), or when it is computed
  again after leaving memory unsaved (its hash is in a bounded ghost list of such evictions):
  prefixes that recur reach the pool, one-off prompts cost nothing (`offer_all` records the
  rest, e.g. at a graceful stop);
- ``"off"``: none.

Each block's pool state (nothing yet, recorded, or the pool has it) is tracked, so with a policy
on only a recorded block whose copy has not left yet is kept at eviction (``drain_evicted``);
with ``"off"`` every evicted block is.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

SAVE_POLICIES = ("off", "reused", "all")
RECORD_REASONS = ("computed", "reused", "returned", "flush")
"""Why a block was recorded for the pool: ``computed`` (policy "all"), ``reused`` (a prefix hit),
``returned`` (computed again after an unsaved eviction), ``flush`` (`offer_all`)."""
UNSAVED, RECORDED, POOLED = 0, 1, 2
GHOST_MAX = 1 << 18  # ghost hashes kept at most (~100 B each)


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
        save: str = "off",
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
        # never-used blocks leave the queue in ascending order, so blocks [0, high_water) are
        # the ones ever handed out (`shared.engine.prefault` faults pages in past it)
        self.high_water = 0
        if save not in SAVE_POLICIES:
            raise ValueError(f"save policy {save!r}: expected one of {', '.join(SAVE_POLICIES)}")
        self.save = save
        # pool state per block: UNSAVED, RECORDED (in `_computed`, copy not taken yet), POOLED
        # (copied out for the pool, or its KV came from outside)
        self.pool_state = bytearray(num_blocks)
        # hashes evicted UNSAVED ("reused" policy): computed again, they are recorded
        self.ghosts: OrderedDict[bytes, None] = OrderedDict()
        self.ghost_capacity = min(4 * num_blocks, GHOST_MAX)
        self.recorded = dict.fromkeys(RECORD_REASONS, 0)  # blocks recorded, by reason
        self._evicted: list[tuple[bytes, int]] = []
        self._computed: deque[tuple[bytes, int]] = deque()
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
            if self.save == "reused" and self.pool_state[b] == UNSAVED:
                self._record(b, "reused")
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
                if not computed:
                    self.pool_state[b] = POOLED  # written from elsewhere: not ours to save
                elif self.save == "all":
                    self._record(b, "computed")
                elif self.save == "reused" and self.ghosts.pop(h, 0) is None:
                    self._record(b, "returned")
        if stored:
            self._events.append(CacheEvent("stored", stored))
        return end

    def _record(self, b: int, reason: str) -> None:
        self.pool_state[b] = RECORDED
        self._computed.append((self.block_hash[b], b))
        self.recorded[reason] += 1

    def offer_all(self) -> int:
        """Record every cached block not yet recorded or pooled (a graceful stop hands what
        engine memory holds to the pool); returns how many."""
        n = 0
        for h, b in self.cached.items():
            if self.pool_state[b] == UNSAVED and self.block_hash[b] == h:
                self._record(b, "flush")
                n += 1
        return n

    def forget_unowned(self) -> None:
        """Drop the hashes of every cached block no request holds (the warm-up's synthetic
        prompt): not findable, not for the pool, first to be reused; no event is recorded."""
        for h, b in list(self.cached.items()):
            if self.ref_counts[b] == 0:
                del self.cached[h]
                self.block_hash[b] = None
                self.pool_state[b] = UNSAVED
                self.free_queue.move_to_end(b, last=False)

    def _pop_free(self) -> int:
        b, _ = self.free_queue.popitem(last=False)
        h = self.block_hash[b]
        if h is not None:
            self.block_hash[b] = None
            if self.cached.get(h) == b:
                del self.cached[h]
                state = self.pool_state[b]
                if self.save == "off" or state == RECORDED:
                    self._evicted.append((h, b))  # its copy for the pool is taken now
                elif state == UNSAVED and self.save == "reused":
                    self.ghosts[h] = None
                    if len(self.ghosts) > self.ghost_capacity:
                        self.ghosts.popitem(last=False)
                self._events.append(CacheEvent("removed", [h.hex()]))
        self.pool_state[b] = UNSAVED
        self.ref_counts[b] = 1
        if b >= self.high_water:
            self.high_water = b + 1
        return b

    # ----- outbox --------------------------------------------------------------------------
    def drain_evicted(self) -> list[tuple[bytes, int]]:
        """Cached blocks handed out for new data since the last call whose bytes the pool
        should get (every one with policy "off", else those recorded and not copied yet):
        (hash, block id). Their bytes are intact until the next forward writes them.
        """
        out, self._evicted = self._evicted, []
        return out

    def drain_computed(self, limit: int = 0) -> list[tuple[bytes, int]]:
        """Blocks recorded for the pool since the last call (see the save policies) that still
        hold their hash, the oldest ``limit`` of them when set (fewer means none is left):
        (hash, block id), now marked as pooled (the caller copies them out). One evicted
        meanwhile is skipped: its copy left through `drain_evicted`."""
        out: list[tuple[bytes, int]] = []
        while self._computed and (not limit or len(out) < limit):
            h, b = self._computed.popleft()
            if self.block_hash[b] == h:
                self.pool_state[b] = POOLED
                out.append((h, b))
        return out

    def drain_events(self) -> list[CacheEvent]:
        out, self._events = self._events, []
        return out
