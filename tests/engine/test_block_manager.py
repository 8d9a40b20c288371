from shared.engine.block_manager import BlockManager

H = [bytes([i]) * 16 for i in range(10)]


def test_allocate_free_order_and_refcounts():
    bm = BlockManager(4, 2)
    t: list[int] = []
    assert bm.allocate_slots(t, 3)
    assert t == [0, 1] and bm.ref_counts == [1, 1, 0, 0]
    assert bm.allocate_slots(t, 4) and t == [0, 1]
    assert bm.allocate_slots(t, 5) and t == [0, 1, 2]
    assert not bm.allocate_slots(t, 9) and t == [0, 1, 2]  # no partial allocation
    bm.free(t)
    # uncached blocks go to the front, tail first
    assert list(bm.free_queue) == [0, 1, 2, 3]
    assert bm.num_free_blocks == 4 and bm.ref_counts == [0, 0, 0, 0]


def test_prefix_cache_hit_revive_and_lru_eviction():
    bm = BlockManager(4, 2)
    a: list[int] = []
    bm.allocate_slots(a, 4)  # blocks 0,1
    bm.cache_full_blocks(a, [H[0], H[1]], 0, 2)
    ev = bm.drain_events()
    assert [(e.kind, e.hashes) for e in ev] == [("stored", [H[0].hex(), H[1].hex()])]
    # shared by a second sequence: refcount 2
    b: list[int] = []
    assert bm.find_cached_prefix([H[0], H[1], H[2]]) == [0, 1]
    assert bm.allocate_slots(b, 5, [0, 1])
    assert b == [0, 1, 2] and bm.ref_counts[:3] == [2, 2, 1]
    bm.free(b)
    bm.free(a)
    # cached blocks wait at the back in LRU order (tail of each table first), blank block 2 front
    assert list(bm.free_queue) == [2, 3, 1, 0]
    assert bm.find_cached_prefix([H[0], H[1]]) == [0, 1]  # still findable while free
    c: list[int] = []
    assert bm.allocate_slots(c, 6)  # takes 2, 3, then evicts 1
    assert c == [2, 3, 1]
    assert bm.drain_evicted() == [(H[1], 1)]
    assert [(e.kind, e.hashes) for e in bm.drain_events()] == [("removed", [H[1].hex()])]
    assert bm.find_cached_prefix([H[0], H[1]]) == [0]
    # reviving block 0 takes it out of the free queue
    d: list[int] = []
    assert bm.allocate_slots(d, 2, [0]) and d == [0] and bm.num_free_blocks == 0


def test_duplicate_hash_not_registered_twice():
    bm = BlockManager(3, 2)
    a: list[int] = []
    b: list[int] = []
    bm.allocate_slots(a, 2)
    bm.allocate_slots(b, 2)
    bm.cache_full_blocks(a, [H[5]], 0, 1)
    bm.cache_full_blocks(b, [H[5]], 0, 1)
    assert bm.cached == {H[5]: 0} and bm.block_hash[1] is None
    assert bm.num_free_blocks == 1


def test_prefix_caching_disabled():
    bm = BlockManager(2, 2, enable_prefix_caching=False)
    a: list[int] = []
    bm.allocate_slots(a, 2)
    bm.cache_full_blocks(a, [H[0]], 0, 1)
    assert bm.find_cached_prefix([H[0]]) == [] and bm.drain_events() == []


def test_computed_blocks_recorded_for_write_through_only_when_asked():
    """`drain_computed` with policy "all": blocks cached because this engine computed them, in
    order; not blocks written from elsewhere (``computed=False``: pushed or pool KV), and nothing
    with policy "off"."""
    h = [bytes([i]) * 16 for i in range(6)]
    bm = BlockManager(8, 4, save="all")
    t1, t2 = [], []
    assert bm.allocate_slots(t1, 8) and bm.allocate_slots(t2, 8)
    bm.cache_full_blocks(t1, h[:2], 0, 2)
    bm.cache_full_blocks(t2, h[2:4], 0, 2, computed=False)  # pushed KV
    assert bm.drain_computed() == [(h[0], t1[0]), (h[1], t1[1])]
    assert bm.drain_computed() == []
    off = BlockManager(8, 4)
    t3 = []
    assert off.allocate_slots(t3, 4)
    off.cache_full_blocks(t3, h[5:], 0, 1)
    assert off.drain_computed() == []


def _compute(bm: BlockManager, hashes: list[bytes]) -> list[int]:
    """A request that computes ``hashes`` (its cached prefix shared) and finishes."""
    cached = bm.find_cached_prefix(hashes)
    t: list[int] = []
    assert bm.allocate_slots(t, 4 * len(hashes), cached)
    bm.cache_full_blocks(t, hashes, len(cached), len(hashes))
    bm.free(t)
    return t


def test_reused_policy_records_a_block_when_a_second_request_uses_it():
    """Policy "reused": a one-off prompt's blocks are not recorded; a prefix hit records the
    blocks hit (once), not the new ones computed after them."""
    h = [bytes([i]) * 16 for i in range(8)]
    bm = BlockManager(16, 4, save="reused")
    t1 = _compute(bm, h[:3])
    assert bm.drain_computed() == []
    _compute(bm, h[:2] + h[4:5])  # shares the first two blocks
    assert bm.drain_computed() == [(h[0], t1[0]), (h[1], t1[1])]
    assert bm.recorded["reused"] == 2
    _compute(bm, h[:2] + h[5:6])  # hit again: already given to the pool
    assert bm.drain_computed() == []
    assert bm.offer_all() == 3  # the rest, at a graceful stop: h[2], h[4], h[5]
    assert {x for x, _ in bm.drain_computed()} == {h[2], h[4], h[5]}
    assert bm.offer_all() == 0


def test_reused_policy_records_a_block_computed_again_after_an_unsaved_eviction():
    """An unsaved block that leaves memory is remembered (ghost); computed again, it is recorded
    ("returned"). A recorded block evicted before its copy left is kept for the pool; a pooled
    one is not copied again."""
    h = [bytes([i]) * 16 for i in range(12)]
    bm = BlockManager(4, 4, save="reused")
    _compute(bm, h[:4])
    _compute(bm, h[4:8])  # evicts h[0..3] unsaved
    assert bm.drain_evicted() == [] and set(bm.ghosts) == set(h[:4])
    t = _compute(bm, h[:1])  # h[0] returns
    assert bm.drain_computed() == [(h[0], t[0])] and bm.recorded["returned"] == 1
    assert h[0] not in bm.ghosts
    _compute(bm, h[:1] + h[8:9])  # hit on h[0] (pooled now): nothing recorded
    assert bm.drain_computed() == []
    # a block recorded by a hit, evicted before the engine copied it: kept for the pool
    bm2 = BlockManager(2, 4, save="reused")
    _compute(bm2, h[:1])
    _compute(bm2, h[:1])  # recorded (reused), not drained yet
    _compute(bm2, h[9:11])  # evicts it
    assert bm2.drain_evicted() == [(h[0], 0)] and not bm2.ghosts
    # policy "all": a pooled block is not copied again when it leaves memory
    bm3 = BlockManager(2, 4, save="all")
    _compute(bm3, h[:1])
    assert len(bm3.drain_computed()) == 1
    _compute(bm3, h[9:11])
    assert bm3.drain_evicted() == []
