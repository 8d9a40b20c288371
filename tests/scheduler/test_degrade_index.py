"""Degradation hysteresis, the prefix index and membership (pure cores)."""

from __future__ import annotations

import pytest

from services.scheduler.degrade import Degrader, DegradeThresholds, cluster_load
from services.scheduler.membership import Membership
from services.scheduler.prefix_index import PrefixIndex
from shared.protocol.kv import KVEvent
from shared.protocol.load import LoadReport


def test_degrade_levels_with_hysteresis():
    g = Degrader(DegradeThresholds(up=(0.8, 0.9, 0.97), down=(0.7, 0.82, 0.9), min_dwell_s=1.0))
    seq = [(0.5, 0), (0.81, 1), (0.75, 1), (0.89, 1), (0.95, 2), (0.99, 3)]
    t = 0.0
    for load, level in seq:
        t += 2.0
        assert g.update(load, t) == level, (load, t)
    # Falling: below 0.9 leaves 3, but only after the dwell time.
    assert g.update(0.85, t + 0.5) == 3
    assert g.update(0.85, t + 1.5) == 2  # 0.85 >= 0.82: stays at 2
    assert g.update(0.83, t + 3.0) == 2
    assert g.update(0.60, t + 5.0) == 0  # below every 'down': straight to 0
    # Hovering around an 'up' threshold does not flap.
    levels = [g.update(x, t + 6 + i * 2) for i, x in enumerate([0.8, 0.78, 0.81, 0.79, 0.8])]
    assert levels == [1, 1, 1, 1, 1]


def test_degrade_thresholds_validated():
    with pytest.raises(ValueError):
        DegradeThresholds(up=(0.8, 0.9, 0.97), down=(0.85, 0.8, 0.9))


def test_cluster_load_is_worst_of_prefill_and_decode():
    assert cluster_load([1.0, 3.0], [0.1], [0.2], queue_target_s=2.0) == pytest.approx(1.0)
    assert cluster_load([0.0], [0.9, 0.5], [0.1, 0.7], 2.0) == pytest.approx(0.8)
    assert cluster_load([], [], [], 2.0) == 0.0


def ev(inst, seq, kind, hashes, tier="engine", inc="a"):
    return KVEvent(instance_id=inst, incarnation=inc, seq=seq, tier=tier, kind=kind, hashes=hashes)


def test_prefix_index_longest_prefix_per_instance_and_pool_tiers():
    ix = PrefixIndex()
    assert ix.apply(ev("p0", 1, "stored", ["a", "b", "c"]))
    assert ix.apply(ev("p1", 1, "stored", ["a", "c"]))  # holds a and c but not b
    assert ix.apply(ev("kv0", 1, "stored", ["a", "b"], tier="dram"))
    assert ix.apply(ev("kv0", 2, "stored", ["c", "d"], tier="ssd"))
    m = ix.lookup(["a", "b", "c", "d", "e"])
    assert m.engine_blocks == {"p0": 3, "p1": 1}
    assert (m.pool_dram_blocks, m.pool_ssd_blocks) == (2, 2)
    assert len(ix) == 4
    # Removal from one tier keeps the others; duplicates and stale seqs are ignored.
    assert ix.apply(ev("kv0", 3, "removed", ["b"], tier="dram"))
    assert not ix.apply(ev("kv0", 3, "removed", ["a"], tier="dram"))
    m = ix.lookup(["a", "b", "c"])
    assert (m.pool_dram_blocks, m.pool_ssd_blocks) == (1, 0)
    assert m.engine_blocks == {"p0": 3, "p1": 1}


def test_prefix_index_incarnation_change_drops_old_blocks():
    ix = PrefixIndex()
    ix.apply(ev("d0", 5, "stored", ["a", "b"], inc="old"))
    assert ix.lookup(["a", "b"]).engine_blocks == {"d0": 2}
    ix.apply(ev("d0", 1, "stored", ["x"], inc="new"))  # seq restarts with the process
    assert ix.lookup(["a", "b"]).engine_blocks == {}
    assert not ix.apply(ev("d0", 6, "stored", ["a"], inc="old"))  # late event of a dead process
    assert ix.blocks_of("d0") == 1 and len(ix) == 1


def rep(iid, inc="i", role="decode", **kw):
    return LoadReport(instance_id=iid, role=role, incarnation=inc, ts=0.0, **kw)


def test_membership_down_after_missed_reports_and_new_incarnation():
    m = Membership(interval_s=1.0, down_after=3)
    assert m.observe(rep("d0", num_running=2), now=0.0).new
    assert m.observe(rep("tok0", role="tokenizer"), now=0.0) is None
    assert [v.instance_id for v in m.live("decode")] == ["d0"]
    assert m.tick(3.0) == []  # exactly 3 intervals: not yet
    assert m.tick(3.01) == ["d0"]
    assert m.tick(4.0) == []  # declared once
    assert m.live("decode") == [] and m.down() == ["d0"]
    o = m.observe(rep("d0"), now=5.0)
    assert o.revived and not o.restarted
    m.live("decode")[0].pending_tokens = 99
    o = m.observe(rep("d0", inc="j", num_running=0), now=6.0)
    assert o.restarted and not o.new
    v = m.live("decode")[0]
    assert (v.pending_tokens, v.num_running, m.members["d0"].incarnation) == (0, 0, "j")
