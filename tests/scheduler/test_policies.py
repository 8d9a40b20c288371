"""Routing policies on hand-built states: exact choices, including imbalance cases."""

from __future__ import annotations

import pytest

from services.scheduler.policies import make_policy
from services.scheduler.types import ClusterState, CostModel, InstanceView, RequestView

COST = CostModel(prefill_tokens_per_s=1000.0, dram_tokens_per_s=10_000.0, ssd_tokens_per_s=2000.0)


def P(iid, waiting=0, rate=0.0, long=False, running=0):
    return InstanceView(
        iid,
        "prefill",
        waiting_tokens=waiting,
        prefill_tokens_per_s=rate,
        reserved_long=long,
        num_running=running,
    )


def D(iid, running=0, free=100, total=100, bs=16):
    return InstanceView(
        iid,
        "decode",
        num_running=running,
        kv_blocks_free=free,
        kv_blocks_total=total,
        block_size=bs,
    )


def R(n, cached=None, dram=0, ssd=0, slo=0.0, max_tokens=16):
    return RequestView(
        "r",
        n,
        cached_tokens=cached or {},
        pool_dram_tokens=dram,
        pool_ssd_tokens=ssd,
        ttft_slo_s=slo,
        max_tokens=max_tokens,
    )


def test_round_robin_cycles_by_id():
    pol = make_policy("round_robin", COST)
    st = ClusterState(prefill=[P("p0"), P("p1")], decode=[D("d0"), D("d1"), D("d2")])
    got = [
        (x.prefill_instance, x.decode_instance) for x in (pol.choose(R(100), st) for _ in range(4))
    ]
    assert got == [("p0", "d0"), ("p1", "d1"), ("p0", "d2"), ("p1", "d0")]


def test_least_loaded_picks_emptiest_queue_and_decode():
    pol = make_policy("least_loaded", COST)
    st = ClusterState(
        prefill=[P("p0", waiting=500), P("p1", waiting=100), P("p2", waiting=100)],
        decode=[D("d0", running=8), D("d1", running=2, free=50), D("d2", running=4)],
    )
    d = pol.choose(R(100), st)
    # d1: 0.5 KV used + 2/64 = 0.53; d2: 0 + 4/64 = 0.06; d0: 8/64 = 0.125
    assert (d.prefill_instance, d.decode_instance) == ("p1", "d2")
    assert d.predicted_ttft_s == pytest.approx(0.1 + 0.1)


def test_no_prefill_means_decode_prefills():
    d = make_policy("least_loaded", COST).choose(R(100), ClusterState([], [D("d0")]))
    assert (d.prefill_instance, d.decode_instance) == ("", "d0")


def test_prefix_aware_prefers_cached_instance():
    pol = make_policy("prefix_aware", COST)
    st = ClusterState(prefill=[P("p0"), P("p1")], decode=[D("d0")])
    d = pol.choose(R(4000, cached={"p1": 3000}), st)
    assert d.prefill_instance == "p1" and d.cached_tokens == 3000
    assert d.predicted_ttft_s == pytest.approx(1.0)


def test_prefix_aware_cache_holder_with_long_queue_loses():
    pol = make_policy("prefix_aware", COST)
    # p1 holds 3000 of 4000 tokens but has 5000 queued: 5 s + 1 s; p0: 0 + 4 s.
    st = ClusterState(prefill=[P("p0"), P("p1", waiting=5000)], decode=[D("d0")])
    d = pol.choose(R(4000, cached={"p1": 3000}), st)
    assert d.prefill_instance == "p0" and d.cached_tokens == 0
    assert d.predicted_ttft_s == pytest.approx(4.0)
    # With a shorter queue (1500 -> 1.5 s + 1 s = 2.5 s) the cache holder wins again.
    st = ClusterState(prefill=[P("p0"), P("p1", waiting=1500)], decode=[D("d0")])
    assert pol.choose(R(4000, cached={"p1": 3000}), st).prefill_instance == "p1"


def test_prefix_aware_uses_measured_rate_and_pool_load_time():
    pol = make_policy("prefix_aware", COST)
    # p0 is measured 4x faster; pool has 2000 tokens in DRAM (0.2 s to load).
    st = ClusterState(prefill=[P("p0", rate=4000.0), P("p1")], decode=[D("d0")])
    d = pol.choose(R(4000, dram=2000), st)
    assert d.prefill_instance == "p0" and d.cached_tokens == 2000
    assert d.predicted_ttft_s == pytest.approx(2000 / 4000 + 0.2)
    # SSD hits load 5x slower than DRAM (8 ms a 16-token block): p0 recomputes a block in 4 ms,
    # so it loads none (the worker's cost rule, shared.kvcache_rules); p1 (16 ms) would load.
    d = pol.choose(R(4000, ssd=2000), st)
    assert d.prefill_instance == "p0" and d.cached_tokens == 0
    assert d.predicted_ttft_s == pytest.approx(1.0)
    st = ClusterState(prefill=[P("p1")], decode=[D("d0")])
    d = pol.choose(R(4000, ssd=2000), st)
    assert d.cached_tokens == 2000 and d.predicted_ttft_s == pytest.approx(2.0 + 1.0)


def test_decode_affinity_kept_unless_hot():
    pol = make_policy("prefix_aware", COST, short_prompt_tokens=0)
    st = ClusterState(prefill=[P("p0")], decode=[D("d0", running=10), D("d1", running=2)])
    # d0 holds the prefix and is only mildly busier (10/64 vs 2/64): affinity kept.
    assert pol.choose(R(4000, cached={"d0": 2000}), st).decode_instance == "d0"
    # d0 is hot (40 running: 0.625 vs 0.03): imbalance beyond 0.25 breaks affinity.
    st = ClusterState(prefill=[P("p0")], decode=[D("d0", running=40), D("d1", running=2)])
    assert pol.choose(R(4000, cached={"d0": 2000}), st).decode_instance == "d1"


def test_decode_without_kv_room_is_skipped():
    pol = make_policy("prefix_aware", COST, short_prompt_tokens=0)
    # 4000 + 16 tokens need 251 blocks of 16: d0 has 200 free, d1 has 300 (but is busier).
    st = ClusterState(
        prefill=[P("p0")],
        decode=[D("d0", free=200, total=1000), D("d1", running=20, free=300, total=1000)],
    )
    assert pol.choose(R(4000), st).decode_instance == "d1"


def test_conditional_disaggregation_short_uncached_prompt():
    pol = make_policy("prefix_aware", COST, short_prompt_tokens=512)
    st = ClusterState(prefill=[P("p0")], decode=[D("d0")])
    d = pol.choose(R(300), st)
    assert (d.prefill_instance, d.decode_instance) == ("", "d0")
    # Long prompt, but mostly cached on the decode instance: 4000 - 3700 = 300 uncached.
    d = pol.choose(R(4000, cached={"d0": 3700}), st)
    assert d.prefill_instance == "" and d.cached_tokens == 3700
    # Long uncached prompt: disaggregated.
    assert pol.choose(R(4000), st).prefill_instance == "p0"
    # Short, but the decode instance is busy (40/64 > 0.5): disaggregated.
    busy = ClusterState(prefill=[P("p0")], decode=[D("d0", running=40)])
    assert pol.choose(R(300), busy).prefill_instance == "p0"


def test_length_aware_reserved_instances():
    pol = make_policy("prefix_aware", COST, long_prompt_tokens=10_000)
    st = ClusterState(
        prefill=[P("p0"), P("p1", waiting=100), P("long0", long=True)], decode=[D("d0", total=0)]
    )
    assert pol.choose(R(20_000), st).prefill_instance == "long0"
    # Normal prompts never use the reserved instance even when it is idle.
    assert pol.choose(R(2000), st).prefill_instance == "p0"
    assert (
        pol.choose(R(2000), ClusterState([P("long0", long=True)], [D("d0")])).prefill_instance
        == "long0"
    )


def test_slo_early_rejection_with_retry_after():
    pol = make_policy("prefix_aware", COST)
    st = ClusterState(prefill=[P("p0", waiting=3000)], decode=[D("d0")])
    d = pol.choose(R(2000, slo=2.0), st)  # 3 s queue + 2 s compute = 5 s > 2 s
    assert d.reject and d.retry_after_s == pytest.approx(3.0)
    assert not pol.choose(R(2000, slo=6.0), st).reject
    assert (
        not make_policy("prefix_aware", COST, slo_reject=False).choose(R(2000, slo=2.0), st).reject
    )


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="round_robin"):
        make_policy("nope")


def test_hot_prefix_stays_on_its_holders_until_they_pass_the_load_bound():
    # 4000-token prompts sharing a 3000-token system prompt that p0 holds; 1000 tok/s each.
    pol = make_policy("prefix_aware", COST, short_prompt_tokens=0)
    hot = {"p0": 3000}

    def pick(waits, cached=hot):
        st = ClusterState(
            prefill=[P(f"p{i}", waiting=w) for i, w in enumerate(waits)], decode=[D("d0")]
        )
        d = pol.choose(R(4000, cached=cached), st)
        return d.prefill_instance, d.cached_tokens, pol.last_reason

    # p0 is 3.5 s behind idle peers: min TTFT would move the prompt (4.5 s vs 4.0 s), but the
    # holder is within the bound (4 s above the shortest queue) and keeps it
    assert pick([3500, 0, 0, 0]) == ("p0", 3000, "cache holder within the load bound")
    # 4.5 s behind: past the bound; the prompt goes to the min-TTFT instance, which computes
    # the prefix and becomes a second holder
    assert pick([4500, 0, 0, 0]) == ("p1", 0, "min predicted ttft")
    # two holders: the hot prefix's traffic goes to the one within the bound, less queued first
    two = {"p0": 3000, "p1": 3000}
    assert pick([4500, 1000, 0, 0], two) == ("p1", 3000, "cache holder within the load bound")
    assert pick([1000, 2000, 0, 0], two) == ("p0", 3000, "cache holder within the load bound")
    # everyone busy: the bound is 1.5 x the mean queue (10.1 s here), so 9 s still holds
    assert pick([9000, 6000, 6000, 6000])[0] == "p0"
    assert pick([11000, 6000, 6000, 6000])[0] == "p1"
    # affinity off: minimum predicted TTFT alone
    off = make_policy("prefix_aware", COST, short_prompt_tokens=0, affinity_load_bound=0)
    st = ClusterState(prefill=[P("p0", waiting=3500), P("p1")], decode=[D("d0")])
    assert off.choose(R(4000, cached=hot), st).prefill_instance == "p1"


def test_per_request_disaggregation_by_predicted_ttft():
    """A long uncached prompt goes to decode only when the remote path's time to a continuing
    stream (prefill's TTFT + the KV push) is worse than decode's own TTFT by more than the time
    that prefill takes decode away from its streams; each choice names its path."""
    pol = make_policy("prefix_aware", COST, short_prompt_tokens=512)
    d0 = InstanceView("d0", "decode", kv_blocks_total=0, prefill_tokens_per_s=1000.0)

    def route(waiting, dec=d0):
        d = pol.choose(R(2000), ClusterState(prefill=[P("p0", waiting=waiting)], decode=[dec]))
        return d.prefill_instance, d.path, round(d.predicted_ttft_s, 3)

    # idle prefill: remote 2.0 s + 0.005 s push vs decode's 2.0 s: decode's 2 s is not worth it
    assert route(0) == ("p0", "remote", 2.0)
    # prefill 1.9 s queued: 3.905 s vs 2.0 s, a 1.905 s gain < the 2 s decode would spend
    assert route(1900) == ("p0", "remote", 3.9)
    # 2.1 s queued: the gain (2.105 s) outweighs decode's 2 s: decode prefills
    assert route(2100) == ("", "decode_faster", 2.0)
    # a busy decode instance (40 of 64 running) never takes the prompt
    busy = InstanceView(
        "d0", "decode", kv_blocks_total=0, prefill_tokens_per_s=1000.0, num_running=40
    )
    assert route(9000, busy)[:2] == ("p0", "decode_busy")
    # a decode instance that reports no rate is not moved to on a guess
    assert route(9000, D("d0", total=0))[:2] == ("p0", "remote")
    assert pol.choose(R(300), ClusterState([P("p0")], [d0])).path == "short_uncached"
    assert pol.choose(R(3000), ClusterState([], [d0])).path == "no_prefill"


def test_colocated_prefix_aware_places_prompts_by_the_prefill_rule():
    """No prefill fleet: the decode instance prefills, so the prefill rule places the prompt
    over the decode instances: a shared first block alone (under ``cache_match_min`` of the
    prompt) is no reason to pile onto its holder (the least-filled cache takes a new prompt),
    a real prefix hit keeps its holder while its queue is within the load bound, and an
    instance without room for the request's KV is left out."""
    pol = make_policy("prefix_aware", COST)

    def dec(iid, waiting=0, blocks=0, free=100):
        v = D(iid, free=free)
        v.waiting_tokens, v.cached_blocks, v.prefill_tokens_per_s = waiting, blocks, 1000.0
        return v

    fleet = [dec("d0", blocks=50), dec("d1", blocks=10), dec("d2", blocks=30)]
    one_block = pol.choose(R(1000, cached={"d0": 16}), ClusterState([], fleet))
    assert (one_block.decode_instance, one_block.path) == ("d1", "no_prefill")
    hit = pol.choose(R(1000, cached={"d2": 800}), ClusterState([], fleet))
    assert (hit.decode_instance, hit.cached_tokens) == ("d2", 800)
    busy = [dec("d0", blocks=50), dec("d1", blocks=10), dec("d2", waiting=9000, blocks=30)]
    assert pol.choose(R(1000, cached={"d2": 800}), ClusterState([], busy)).decode_instance != "d2"
    full = [dec("d0", blocks=50), dec("d1", blocks=10, free=1), dec("d2", blocks=30)]
    assert pol.choose(R(1000), ClusterState([], full)).decode_instance == "d2"
