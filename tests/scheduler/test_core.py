"""SchedulerCore: admission by degradation level, route replies, optimistic accounting."""

from __future__ import annotations

import pytest

from services.scheduler.config import SchedulerConfig
from services.scheduler.core import SchedulerCore
from shared.protocol.errors import StrataError
from shared.protocol.kv import KVEvent
from shared.protocol.load import LoadReport
from shared.protocol.sched import DegradeRules, RouteRequest


def core(**kw) -> SchedulerCore:
    cfg = SchedulerConfig.load([], role="scheduler", degrade_dwell_s=0.0, down_after=100, **kw)
    c = SchedulerCore(cfg)
    c.on_load(
        LoadReport(
            instance_id="p0",
            role="prefill",
            incarnation="a",
            ts=0,
            grpc_addr="h:1",
            prefill_tokens_per_s=1000.0,
        ),
        now=0.0,
    )
    c.on_load(
        LoadReport(
            instance_id="d0",
            role="decode",
            incarnation="a",
            ts=0,
            grpc_addr="h:2",
            kv_blocks_total=100,
            kv_blocks_free=100,
            prefill_tokens_per_s=1000.0,  # the same hardware as p0 (every instance reports it)
        ),
        now=0.0,
    )
    return c


def req(**kw) -> RouteRequest:
    return RouteRequest(request_id="r", num_prompt_tokens=kw.pop("n", 2000), **kw)


def test_route_reply_fields_and_pending_accounting():
    c = core(policy="prefix_aware")
    c.on_kv_event(
        KVEvent(
            instance_id="p0",
            incarnation="a",
            seq=1,
            tier="engine",
            kind="stored",
            hashes=["h1", "h2"],
        )
    )
    r = c.route(req(block_hashes=["h1", "h2", "h3"]))
    assert (r.prefill_instance, r.prefill_addr, r.decode_instance, r.decode_addr) == (
        "p0",
        "h:1",
        "d0",
        "h:2",
    )
    assert r.expected_cached_tokens == 32 and r.policy == "prefix_aware"
    assert r.predicted_ttft_ms == pytest.approx(1968.0)
    assert c.members.members["p0"].view.pending_tokens == 2000 - 32
    # The next request sees the queued work until the next load report clears it.
    assert c.route(req()).predicted_ttft_ms == pytest.approx(1968.0 + 2000.0)
    c.on_load(
        LoadReport(
            instance_id="p0", role="prefill", incarnation="a", ts=1, prefill_tokens_per_s=1000.0
        ),
        now=1.0,
    )
    assert c.members.members["p0"].view.pending_tokens == 0


def test_route_reply_counts_the_prompt_blocks_the_pool_holds():
    """``pool_blocks``: the prompt's blocks the index places in the pool (kvstore tiers), so a
    decode instance computing a cold prompt skips its pool lookup (0), and one whose prefix
    the pool holds looks it up."""
    c = core()
    assert c.route(req(block_hashes=["x1", "x2"])).pool_blocks == 0  # nothing anywhere
    for seq, (tier, hashes) in enumerate((("dram", ["h1", "h2"]), ("ssd", ["h3"])), 1):
        c.on_kv_event(
            KVEvent(
                instance_id="kv0",
                incarnation="a",
                seq=seq,
                tier=tier,
                kind="stored",
                hashes=hashes,
            )
        )
    assert c.route(req(block_hashes=["h1", "h2", "h3", "h4"])).pool_blocks == 3


def test_degradation_levels_gate_admission():
    c = core(policy="least_loaded", queue_target_s=1.0, batch_max_tokens_cap=64)
    p0 = c.members.members["p0"].view

    def level_at(queued_tokens: int, t: float) -> int:
        p0.waiting_tokens = queued_tokens  # 1000 tok/s -> queue seconds = load
        p0.pending_tokens = 0  # as if a load report had just arrived
        return c.tick(now=t)[0].degrade_level

    assert level_at(500, 1.0) == 0
    # the scheduler owns the rules and publishes them with its state (the gateway applies them)
    assert c.tick(now=1.0)[0].rules == DegradeRules(
        batch_max_tokens_cap=64, top_priority=0, retry_after_s=5.0
    )
    r = c.route(req(slo_class="batch"))
    assert (r.degrade_level, r.max_tokens_cap, r.speculation) == (0, 0, True)
    assert level_at(850, 2.0) == 1
    r = c.route(req(slo_class="batch"))
    assert (r.degrade_level, r.max_tokens_cap, r.speculation) == (1, 64, False)
    assert c.route(req()).max_tokens_cap == 0  # interactive keeps its max_tokens
    assert level_at(920, 3.0) == 2
    with pytest.raises(StrataError) as exc:
        c.route(req(slo_class="batch"))
    assert (exc.value.code, exc.value.http_status, exc.value.retry_after) == ("overloaded", 429, 5)
    assert c.route(req(priority=3)).degrade_level == 2
    assert level_at(990, 4.0) == 3
    with pytest.raises(StrataError):
        c.route(req(priority=1))
    assert c.route(req(priority=0)).degrade_level == 3
    assert level_at(100, 5.0) == 0


def test_slo_rejection_and_unavailable():
    c = core(policy="prefix_aware", slo_interactive_ms=1000)
    with pytest.raises(StrataError) as exc:
        c.route(req(n=3000))
    assert exc.value.code == "overloaded" and exc.value.retry_after == pytest.approx(2.0)
    assert c.route(req(n=3000, ttft_slo_ms=5000)).prefill_instance == "p0"
    with pytest.raises(StrataError) as exc:
        c.route(req(exclude=["d0"]))
    assert exc.value.code == "unavailable"


def test_bad_config_fails_fast():
    with pytest.raises(SystemExit, match="STRATA_POLICY"):
        SchedulerConfig.load(["--policy", "fastest"], role="scheduler")


def test_each_route_counts_its_prefill_path():
    from prometheus_client import REGISTRY

    def count(path):
        labels = {"policy": "prefix_aware", "path": path}
        return REGISTRY.get_sample_value("strata_scheduler_prefill_path_total", labels) or 0.0

    c = core(policy="prefix_aware")
    before = count("remote"), count("short_uncached")
    c.route(req(n=2000))
    c.route(req(n=100))
    assert (count("remote"), count("short_uncached")) == (before[0] + 1, before[1] + 1)
