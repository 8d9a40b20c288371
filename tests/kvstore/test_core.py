"""DRAM tier and kvstore core: LRU order, byte budget, leases, idempotent puts, event order."""

from __future__ import annotations

import pytest

from services.kvstore.chunks import SsdLoc
from services.kvstore.core import KVStoreCore
from services.kvstore.dram import DramTier


def k(h: str, fp: str = "m1") -> tuple[str, str]:
    return (fp, h)


def test_lru_order_and_byte_budget():
    d = DramTier(100)
    for h in "abc":
        assert d.put(k(h), h, 30).stored
    assert d.used_bytes == 90 and d.keys() == [k("a"), k("b"), k("c")]
    assert d.get(k("a")) == "a"  # a becomes most recent
    res = d.put(k("d"), "d", 30)  # needs 20 more bytes -> evicts b (LRU)
    assert res.stored and [e.key for e in res.evicted] == [k("b")]
    assert d.keys() == [k("c"), k("a"), k("d")] and d.used_bytes == 90
    res = d.put(k("e"), "e", 70)  # evicts c, a (oldest first) -> 30 + 70 = 100
    assert [e.key for e in res.evicted] == [k("c"), k("a")] and d.used_bytes == 100
    assert d.put(k("huge"), "x", 101).refused and d.used_bytes == 100


def test_idempotent_put_refreshes_recency_only():
    d = DramTier(100)
    d.put(k("a"), "a", 40)
    d.put(k("b"), "b", 40)
    res = d.put(k("a"), "other", 40)
    assert not res.stored and not res.refused and res.evicted == []
    assert d.used_bytes == 80 and d.peek(k("a")) == "a" and d.keys() == [k("b"), k("a")]


def test_leased_blocks_are_not_evicted():
    d = DramTier(100)
    d.put(k("a"), "a", 50)
    d.put(k("b"), "b", 50)
    assert d.acquire(k("a")) == "a"  # a is leased (and most recent)
    d.get(k("b"))  # b most recent now; a is LRU but leased
    res = d.put(k("c"), "c", 50)
    assert [e.key for e in res.evicted] == [k("b")] and k("a") in d
    assert d.leased() == 1
    assert d.acquire(k("c")) == "c"
    assert d.put(k("x"), "x", 10).refused  # everything leased: refused, nothing evicted
    assert len(d) == 2
    d.release(k("a"))
    assert [e.key for e in d.put(k("x"), "x", 10).evicted] == [k("a")]


def test_fingerprints_never_mix():
    d = DramTier(100)
    d.put(("m1", "h"), "one", 10)
    assert d.put(("m2", "h"), "two", 10).stored
    assert d.get(("m1", "h")) == "one" and d.get(("m2", "h")) == "two"


def events(core):
    return [(e.seq, e.tier, e.kind, e.hashes) for e in core.drain_events()]


def test_core_event_order_spill_and_restore():
    c = KVStoreCore("kv0", "inc", dram_bytes=100, clock=lambda: 1.0)
    assert c.put(k("a"), "A", 60)
    assert not c.put(k("a"), "A", 60)  # duplicate: no event
    assert c.put(k("b"), "B", 60)  # evicts a -> pending spill; no "removed" yet
    assert events(c) == [(1, "dram", "stored", ["a"]), (2, "dram", "stored", ["b"])]
    assert c.lookup(k("a")) == "dram" and c.acquire_local(k("a")) == ("A", False)
    [entry] = c.next_spills(8)
    assert entry.key == k("a") and c.next_spills(8) == []  # in flight, not handed out twice
    c.spill_done(k("a"), ok=False)  # store down: stays pending
    assert c.lookup(k("a")) == "dram" and c.stats.spill_failures == 1 and events(c) == []
    [entry] = c.next_spills(8)
    c.spill_done(k("a"), ok=True)
    assert events(c) == [(3, "ssd", "stored", ["a"]), (4, "dram", "removed", ["a"])]
    assert c.lookup(k("a")) == "ssd" and c.acquire_local(k("a")) is None
    c.restored(k("a"), "A", 60, SsdLoc("m1/a", 0, 60))  # promote: evicts b (not in ssd -> pending)
    assert events(c) == [(5, "dram", "stored", ["a"])]
    assert c.lookup(k("a")) == "dram" and k("b") in c.pending
    c.next_spills(8)
    c.spill_done(k("b"), ok=True)
    assert events(c) == [(6, "ssd", "stored", ["b"]), (7, "dram", "removed", ["b"])]
    c.put(k("b"), "B", 60)  # b back to dram; a is in ssd -> removed right away
    assert events(c) == [(8, "dram", "stored", ["b"]), (9, "dram", "removed", ["a"])]
    assert c.tier_counts()["ssd_blocks"] == 2 and c.tier_counts()["dram_blocks"] == 1
    c.missed(k("a"))
    assert events(c) == [(10, "ssd", "removed", ["a"])] and c.stats.misses == 1


def test_core_spill_buffer_bound_drops_oldest():
    c = KVStoreCore("kv0", "inc", dram_bytes=50, spill_buffer_bytes=100)
    for h in "abc":
        c.put(k(h), h, 50)
    assert list(c.pending) == [k("a"), k("b")] and c.pending_bytes == 100
    c.drain_events()
    c.put(k("d"), "d", 50)  # c evicted -> pending would be 150 > 100: oldest (a) dropped
    assert list(c.pending) == [k("b"), k("c")] and c.pending_bytes == 100
    assert c.stats.spill_dropped == 1
    assert [(t, kd, h) for _, t, kd, h in events(c)] == [
        ("dram", "stored", ["d"]),
        ("dram", "removed", ["a"]),
    ]
    assert c.lookup(k("a")) is None


def test_core_refused_put_goes_straight_to_spill_and_restart_listing():
    c = KVStoreCore("kv0", "inc", dram_bytes=10, spill_buffer_bytes=100)
    assert c.put(k("big"), "B", 20)  # larger than DRAM: queued for ssd only
    assert events(c) == [] and c.lookup(k("big")) == "dram"
    c.next_spills(1)
    c.spill_done(k("big"), ok=True)
    assert events(c) == [(1, "ssd", "stored", ["big"])]  # never announced in dram
    fresh = KVStoreCore("kv0", "inc2", dram_bytes=10)
    locs = [(k("x"), SsdLoc("o", 0, 5)), (k("y", "m2"), SsdLoc("o2", 0, 5))]
    assert fresh.known_ssd([*locs, (k("z"), SsdLoc("o", 5, 5, True))]) == 3
    assert fresh.known_ssd(locs) == 0
    got = sorted((e.tier, e.hashes) for e in fresh.drain_events())
    assert got == [("ssd", ["x", "z"]), ("ssd", ["y"])]
    assert fresh.lookup(k("y", "m2")) == "ssd" and fresh.lookup(k("y")) is None


def test_write_behind_persists_and_eviction_needs_no_spill():
    now = [10.0]
    c = KVStoreCore("kv0", "i", dram_bytes=100, clock=lambda: now[0], write_behind_blocks=8)
    c.put(k("a"), "A", 40)
    c.put(k("b"), "B", 40)
    assert list(c.persist_q) == [k("a"), k("b")] and c.writes_outstanding == 2
    assert c.write_delay(0.05) == pytest.approx(0.05)  # just queued: wait for the push to end
    now[0] += 0.03
    assert c.write_delay(0.05) == pytest.approx(0.02)
    now[0] += 0.03
    assert c.write_delay(0.05) == 0.0
    batch = c.next_spills(8, max_bytes=1000, small_bytes=50)  # both small: one chunk
    assert [e.key for e in batch] == [k("a"), k("b")] and not c.persist_q
    c.spill_done(k("a"), True, SsdLoc("m1/chunk/1", 8, 40, True))
    c.spill_done(k("b"), False)  # failed: back to the queue's front, due now
    assert list(c.persist_q) == [k("b")] and c.stats.spill_failures == 1
    assert events(c)[2:] == [(3, "ssd", "stored", ["a"])]
    assert c.lookup(k("a")) == "dram" and c.ssd[k("a")].ranged
    c.put(k("c"), "C", 40)  # evicts a (persisted): removed at once, no spill
    assert events(c) == [(4, "dram", "stored", ["c"]), (5, "dram", "removed", ["a"])]
    assert not c.pending and c.stats.persists == 1
    [eb] = c.next_spills(1, max_bytes=1000, small_bytes=50)
    assert eb.key == k("b") and c.next_spills(8, 1000, 50)[0].key == k("c")
    c.put(k("d"), "D", 40)  # evicts b while its write is in flight: becomes an in-flight spill
    assert k("b") in c.pending and c.pending[k("b")].in_flight
    assert c.next_spills(8, 1000, 50) == [c.dram.entry(k("d"))]
    c.spill_done(k("b"), True, SsdLoc("m1/b", 0, 40))
    assert [(t, kd, h) for _, t, kd, h in events(c)] == [
        ("dram", "stored", ["d"]),
        ("ssd", "stored", ["b"]),
        ("dram", "removed", ["b"]),
    ]
    assert c.stats.spills == 1 and c.writes_outstanding == 2  # c, d in flight
    c.restored(k("b"), "B", 40, SsdLoc("m1/b", 0, 40))  # already persisted: not queued again
    assert k("b") not in c.persist_q


def test_next_spills_batching_rules():
    c = KVStoreCore("kv0", "i", dram_bytes=1000, write_behind_blocks=10)
    for key, n in [(k("s1"), 10), (k("big"), 100), (k("s2"), 10), (k("o1", "m2"), 10)]:
        c.put(key, "", n)
    c.put(k("s3"), "", 10)
    c.put(k("s4"), "", 10)

    def take(**kw):
        return [e.key for e in c.next_spills(**kw)]

    small = dict(max_n=8, max_bytes=25, small_bytes=50)
    assert take(**small) == [k("s1"), k("s2")]  # same model, small, up to 25 bytes
    assert take(**small) == [k("big")]  # a big block goes alone
    assert take(**small) == [k("o1", "m2")]  # fingerprints never mix
    assert take(max_n=1, max_bytes=25, small_bytes=50) == [k("s3")]  # block count cap
    assert take(max_n=8, max_bytes=0, small_bytes=50) == [k("s4")]  # chunks off: one by one
    assert take(**small) == [] and len(c.persisting) == 6

    b = KVStoreCore("kv0", "i", dram_bytes=1000, write_behind_blocks=2)
    for h in ("x", "y", "z"):
        b.put(k(h), "", 10)
    assert list(b.persist_q) == [k("y"), k("z")] and b.stats.persist_skipped == 1
    assert b.lookup(k("x")) == "dram" and b.writes_outstanding == 2


def test_ssd_budget_evicts_least_recently_used_objects_whole():
    c = KVStoreCore("kv1", "inc1", dram_bytes=1000, ssd_bytes=100)
    chunk1, chunk2 = "m1/chunk/1", "m1/chunk/2"
    loc_a, loc_b = SsdLoc(chunk1, 8, 20, True), SsdLoc(chunk1, 28, 20, True)
    loc_c = SsdLoc(chunk2, 8, 30, True)
    assert c.known_ssd([(k("a"), loc_a), (k("b"), loc_b), (k("c"), loc_c)]) == 3
    assert c.known_ssd([(k("d"), SsdLoc("m1/d", 0, 30))]) == 1  # a per-block object
    assert c.ssd_bytes == 48 + 38 + 30 and list(c.ssd_objects) == [chunk1, chunk2, "m1/d"]
    c.drain_events()
    c.restored(k("a"), "A", 20, loc_a)  # a read of a: its whole chunk becomes most recent
    assert list(c.ssd_objects) == [chunk2, "m1/d", chunk1]
    c.drain_events()

    assert c.evict_ssd() == [chunk2]  # 116 > 100: the LRU object goes, 78 left
    assert c.ssd_bytes == 78 and k("c") not in c.ssd and c.deleting == {chunk2: 38}
    assert [(e.tier, e.kind, e.hashes) for e in c.drain_events()] == [("ssd", "removed", ["c"])]
    assert c.evict_ssd() == []
    c.restored(k("c"), "C", 30, loc_c)  # a read that raced the delete: not indexed again
    assert k("c") not in c.ssd and c.ssd_bytes == 78
    assert c.known_ssd([(k("c"), loc_c)]) == 0  # nor by a listing
    c.delete_done(chunk2, ok=False)
    assert c.deleting == {chunk2: 38}  # a failed delete is retried
    c.delete_done(chunk2, ok=True)
    assert c.deleting == {} and c.known_ssd([(k("c"), loc_c)]) == 0
    assert (c.stats.ssd_evicted_objects, c.stats.ssd_evicted_blocks) == (1, 1)
    assert c.stats.ssd_evicted_bytes == 38

    c.missed(k("d"))  # the store lost d: its object is no longer counted
    assert c.ssd_bytes == 48 and list(c.ssd_objects) == [chunk1]
    c.ssd_budget = 40
    c.drain_events()
    assert c.evict_ssd() == [chunk1]  # both blocks of the chunk go together
    assert c.ssd == {} and c.ssd_bytes == 0
    assert [sorted(e.hashes) for e in c.drain_events()] == [["a", "b"]]


def test_unbounded_ssd_tier_never_evicts():
    c = KVStoreCore("kv1", "inc1", dram_bytes=1000)
    c.known_ssd([(k(h), SsdLoc(f"m1/{h}", 0, 1 << 40)) for h in "abc"])
    assert c.evict_ssd() == [] and len(c.ssd) == 3 and c.ssd_bytes == 3 << 40
