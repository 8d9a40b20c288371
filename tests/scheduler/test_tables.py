"""Numpy role tables, optimistic index entries, the index digest and the new-prefix balance rule:
exact choices, and the vectorised policies against a brute-force Python reference."""

from __future__ import annotations

import random

import numpy as np

from services.scheduler.config import SchedulerConfig
from services.scheduler.core import SchedulerCore
from services.scheduler.policies import make_policy
from services.scheduler.policies.basic import decode_load, predicted_ttft
from services.scheduler.prefix_index import PrefixIndex
from services.scheduler.table import RoleTable, first_min
from services.scheduler.types import ClusterState, CostModel, InstanceView, RequestView
from shared.protocol.kv import KVEvent
from shared.protocol.load import LoadReport
from shared.protocol.sched import RouteRequest

COST = CostModel(prefill_tokens_per_s=1000.0)


def ev(inst, seq, kind, hashes, tier="engine", inc="a"):
    return KVEvent(instance_id=inst, incarnation=inc, seq=seq, tier=tier, kind=kind, hashes=hashes)


def test_role_table_columns_follow_views():
    a = InstanceView(
        "a",
        "prefill",
        waiting_tokens=100,
        prefill_tokens_per_s=500.0,
        kv_blocks_free=3,
        kv_blocks_total=4,
        block_size=16,
        num_running=2,
    )
    b = InstanceView("b", "prefill", reserved_long=True, cached_blocks=7)
    t = RoleTable([a, b])
    assert t.pos == {"a": 0, "b": 1}
    assert t.queued.tolist() == [100, 0]
    assert t.kv_free_tokens.tolist() == [48, 0]
    assert t.kv_used.tolist() == [0.25, 0.0]
    assert t.reserved.tolist() == [False, True]
    assert t.cached_blocks.tolist() == [0, 7]
    assert t.prefill_rates(1000.0).tolist() == [500.0, 1000.0]
    a.pending_tokens, a.pending_requests = 50, 1
    t.refresh(a)
    assert (t.queued[0], t.batch[0]) == (150, 3)
    t.refresh(InstanceView("zz", "prefill"))  # not in the table: ignored


def test_core_keeps_tables_current_through_reports_routes_and_events():
    core = SchedulerCore(SchedulerConfig.load([], role="scheduler", policy="least_loaded"))
    for iid, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")):
        core.on_load(
            LoadReport(
                instance_id=iid, role=role, incarnation="a", ts=0.0, prefill_tokens_per_s=1000.0
            ),
            now=0.0,
        )
    core.route(RouteRequest(request_id="r1", num_prompt_tokens=300))
    t = core.members.table("prefill")
    assert t.queued.tolist() == [300, 0]  # optimistic pending work is in the table
    assert core.route(RouteRequest(request_id="r2", num_prompt_tokens=10)).prefill_instance == "p1"
    core.on_kv_event(ev("p1", 1, "stored", ["h1", "h2"]))
    assert core.members.table("prefill").cached_blocks.tolist() == [0, 2]
    core.on_load(
        LoadReport(
            instance_id="p0",
            role="prefill",
            incarnation="a",
            ts=0.0,
            waiting_tokens=5,
            prefill_tokens_per_s=1000.0,
        ),
        now=0.1,
    )
    assert core.members.table("prefill").queued.tolist() == [5, 10]


def test_expected_blocks_count_until_deadline_or_removal():
    idx = PrefixIndex()
    idx.expect("p1", ["h1", "h2"], deadline=10.0)
    assert idx.lookup(["h1", "h2", "h3"], now=1.0).engine_blocks == {"p1": 2}
    assert idx.lookup(["h1", "h2"]).engine_blocks == {}  # confirmed state only without `now`
    idx.apply(ev("p0", 1, "stored", ["h1"]))
    assert idx.lookup(["h1", "h2"], now=1.0).engine_blocks == {"p0": 1, "p1": 2}
    idx.apply(ev("p1", 1, "removed", ["h2"]))  # evicted before it was even announced
    assert idx.lookup(["h1", "h2"], now=1.0).engine_blocks == {"p0": 1, "p1": 1}
    assert idx.lookup(["h1", "h2"], now=10.0).engine_blocks == {"p0": 1}
    assert idx._expected == {}  # expired entries are gone


def test_digest_is_order_independent_and_tracks_content():
    a, b = PrefixIndex(), PrefixIndex()
    a.apply(ev("p0", 1, "stored", ["h1", "h2"]))
    a.apply(ev("p1", 1, "stored", ["h2"]))
    b.apply(ev("p1", 1, "stored", ["h2"]))
    b.apply(ev("p0", 1, "stored", ["h2", "h1"]))
    assert a.digest() == b.digest() != PrefixIndex().digest()
    b.expect("p2", ["h9"], 1e9)
    assert a.digest() == b.digest()  # expectations are not state
    b.apply(ev("p0", 2, "removed", ["h1"]))
    assert a.digest() != b.digest()
    assert 0 <= a.digest() < 2**48


def test_new_prefix_goes_to_least_filled_cache_among_least_queued():
    pol = make_policy("prefix_aware", COST, short_prompt_tokens=0)
    pre = [
        InstanceView("p0", "prefill", cached_blocks=90, prefill_tokens_per_s=2000.0),
        InstanceView("p1", "prefill", cached_blocks=10, waiting_tokens=20),
        InstanceView("p2", "prefill", cached_blocks=5, waiting_tokens=5000),
        InstanceView("p3", "prefill", cached_blocks=40),
    ]
    st = ClusterState(prefill=pre, decode=[InstanceView("d0", "decode")])
    # no cache anywhere: p2 is too busy, p1 (20 tokens queued = 0.02 s) is within the slack
    assert pol.choose(RequestView("r", 800), st).prefill_instance == "p1"
    # a real hit wins over the footprint rule
    hit = RequestView("r", 800, cached_tokens={"p0": 768})
    assert pol.choose(hit, st).prefill_instance == "p0"
    # a small hit (< cache_match_min of the prompt) does not
    small = RequestView("r", 800, cached_tokens={"p3": 64})
    assert pol.choose(small, st).prefill_instance == "p1"


def _brute_least_loaded(req: RequestView, st: ClusterState) -> tuple[str, str]:
    dec = min(st.decode, key=lambda d: (decode_load(d), d.instance_id))
    pre = min(st.prefill, key=lambda p: (COST.queue_s(p), p.batch, p.instance_id))
    return pre.instance_id, dec.instance_id


def _brute_prefix_aware(req: RequestView, st: ClusterState) -> tuple[str, str, int]:
    """The pre-numpy loop of `PrefixAware`, cache hits only (so no new-prompt balance rule)."""
    total = req.num_prompt_tokens + req.max_tokens
    room = [
        d for d in st.decode if d.kv_blocks_total <= 0 or d.kv_blocks_free * d.block_size >= total
    ] or st.decode
    least = min(room, key=lambda d: (decode_load(d), d.instance_id))
    aff = [d for d in room if req.cached_tokens.get(d.instance_id, 0) > 0]
    dec = least
    if aff:
        a = min(
            aff, key=lambda d: (-req.cached_tokens[d.instance_id], decode_load(d), d.instance_id)
        )
        if decode_load(a) - decode_load(least) <= 0.25:
            dec = a
    # cache affinity within the load bound (1.5 x mean queue, or 4 s above the shortest)
    qs = [COST.queue_s(p) for p in st.prefill]
    cap = max(min(qs) + 4.0, 1.5 * sum(qs) / len(qs))
    ok = []
    for i, p in enumerate(st.prefill):
        ttft, cached = predicted_ttft(req, p, COST)
        held = req.cached_tokens.get(p.instance_id, 0) > 0
        if held and COST.queue_s(p) <= cap and cached >= 0.25 * req.num_prompt_tokens:
            ok.append((-cached, ttft, i))
    if ok:
        neg, _, i = min(ok)
        return st.prefill[i].instance_id, dec.instance_id, -neg
    best = min(
        (predicted_ttft(req, p, COST)[0], -predicted_ttft(req, p, COST)[1], p.instance_id)
        for p in st.prefill
    )
    return best[2], dec.instance_id, -best[1]


def test_vectorised_policies_match_brute_force_on_random_fleets():
    rng = random.Random(0)
    ll = make_policy("least_loaded", COST)
    pa = make_policy("prefix_aware", COST, short_prompt_tokens=0)
    for _ in range(300):
        pre = [
            InstanceView(
                f"p{i}",
                "prefill",
                waiting_tokens=rng.randrange(0, 5000),
                prefill_tokens_per_s=rng.choice([0.0, 500.0, 2000.0]),
                num_running=rng.randrange(3),
            )
            for i in range(12)
        ]
        dec = [
            InstanceView(
                f"d{i}",
                "decode",
                num_running=rng.randrange(40),
                kv_blocks_total=100,
                kv_blocks_free=rng.randrange(0, 101),
            )
            for i in range(8)
        ]
        n = rng.randrange(100, 1500)
        holders = rng.sample([v.instance_id for v in pre + dec], 4)
        req = RequestView(
            "r", n, max_tokens=16, cached_tokens={h: rng.randrange(n // 2, n + 1) for h in holders}
        )
        st = ClusterState(prefill=pre, decode=dec)
        d = ll.choose(req, st)
        assert (d.prefill_instance, d.decode_instance) == _brute_least_loaded(req, st)
        d = pa.choose(req, st)
        if any(h.startswith("p") for h in holders):  # a real hit: min-TTFT path
            assert (d.prefill_instance, d.decode_instance, d.cached_tokens) == _brute_prefix_aware(
                req, st
            )


def test_first_min_is_the_first_row_of_the_lexsort():
    """`first_min` answers what ``np.lexsort((secondary, primary))[0]`` does (the order the
    policies used): smallest primary, ties to the smallest secondary, then the lowest row;
    with few distinct values (ties everywhere), one row, and NaNs (sorted last)."""
    rng = np.random.default_rng(7)
    for trial in range(2000):
        n = int(rng.integers(1, 40))
        primary = rng.integers(0, 1 + trial % 4, n).astype(float)
        secondary = rng.integers(0, 1 + trial % 3, n).astype(float)
        if trial % 10 == 0:
            primary[rng.integers(0, n)] = np.nan
        want = int(np.lexsort((secondary, primary))[0])
        assert first_min(primary, secondary) == want, (primary, secondary)
