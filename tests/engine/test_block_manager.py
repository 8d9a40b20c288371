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


def test_duplicate_hash_not_registered_twice_and_insert_cached():
    bm = BlockManager(3, 2)
    a: list[int] = []
    b: list[int] = []
    bm.allocate_slots(a, 2)
    bm.allocate_slots(b, 2)
    bm.cache_full_blocks(a, [H[5]], 0, 1)
    bm.cache_full_blocks(b, [H[5]], 0, 1)
    assert bm.cached == {H[5]: 0} and bm.block_hash[1] is None
    assert bm.insert_cached(H[5]) is None
    blk = bm.insert_cached(H[6])
    assert blk == 2 and bm.ref_counts[2] == 0 and bm.find_cached_prefix([H[6]]) == [2]
    assert bm.num_free_blocks == 1


def test_prefix_caching_disabled():
    bm = BlockManager(2, 2, enable_prefix_caching=False)
    a: list[int] = []
    bm.allocate_slots(a, 2)
    bm.cache_full_blocks(a, [H[0]], 0, 1)
    assert bm.find_cached_prefix([H[0]]) == [] and bm.drain_events() == []


def test_computed_blocks_recorded_for_write_through_only_when_asked():
    """`drain_computed`: blocks cached because this engine computed them, in order; not blocks
    written from elsewhere (``computed=False``) or loaded (`insert_cached`), and nothing
    without ``record_computed``."""
    h = [bytes([i]) * 16 for i in range(6)]
    bm = BlockManager(8, 4, record_computed=True)
    t1, t2 = [], []
    assert bm.allocate_slots(t1, 8) and bm.allocate_slots(t2, 8)
    bm.cache_full_blocks(t1, h[:2], 0, 2)
    bm.cache_full_blocks(t2, h[2:4], 0, 2, computed=False)  # pushed KV
    bm.insert_cached(h[4])
    assert bm.drain_computed() == [(h[0], t1[0]), (h[1], t1[1])]
    assert bm.drain_computed() == []
    off = BlockManager(8, 4)
    t3 = []
    assert off.allocate_slots(t3, 4)
    off.cache_full_blocks(t3, h[5:], 0, 1)
    assert off.drain_computed() == []
