"""Failover routing at toy size: an excluded prefill instance is never chosen (decode prefills
when none is left), an excluded decode instance likewise; an instance whose main bus connection
is down (``LoadReport.connected=False``) is a member but not routable until it reconnects."""

from __future__ import annotations

import pytest

from services.scheduler.config import SchedulerConfig
from services.scheduler.core import SchedulerCore
from shared.protocol.errors import StrataError
from shared.protocol.load import LoadReport
from shared.protocol.sched import RouteRequest

POLICIES = ("round_robin", "least_loaded", "prefix_aware")


def report(iid: str, role: str, **kw) -> LoadReport:
    return LoadReport(
        instance_id=iid,
        role=role,
        incarnation="a",
        ts=0.0,
        grpc_addr=f"{iid}:1",
        kv_blocks_total=100,
        kv_blocks_free=100,
        **kw,
    )


def core(policy: str, prefills=("p0",), decodes=("d0",)) -> SchedulerCore:
    # short_prompt_tokens=0: prefix_aware disaggregates every prompt while a prefill is left
    cfg = SchedulerConfig.load(
        [], role="scheduler", policy=policy, down_after=100, short_prompt_tokens=0
    )
    c = SchedulerCore(cfg)
    for p in prefills:
        c.on_load(report(p, "prefill"), now=0.0)
    for d in decodes:
        c.on_load(report(d, "decode"), now=0.0)
    return c


def route(c: SchedulerCore, exclude=()) -> tuple[str, str]:
    r = c.route(RouteRequest(request_id="r", num_prompt_tokens=600, exclude=list(exclude)))
    return r.prefill_instance, r.decode_instance


@pytest.mark.parametrize("policy", POLICIES)
def test_excluded_only_prefill_falls_back_to_decode_prefill(policy):
    c = core(policy)
    assert route(c) == ("p0", "d0")  # disaggregated while the prefill instance is usable
    assert route(c, exclude=["p0"]) == ("", "d0")  # the decode instance prefills itself


@pytest.mark.parametrize("policy", POLICIES)
def test_excluded_prefill_is_never_chosen_when_another_is_left(policy):
    c = core(policy, prefills=("p0", "p1"))
    for _ in range(4):  # round robin would alternate: the exclusion must hold every time
        assert route(c, exclude=["p0"]) == ("p1", "d0")


@pytest.mark.parametrize("policy", POLICIES)
def test_excluded_decode_keeps_the_prefill_and_the_last_one_is_unavailable(policy):
    c = core(policy, decodes=("d0", "d1"))
    assert route(c, exclude=["d0"]) == ("p0", "d1")
    with pytest.raises(StrataError) as e:
        route(c, exclude=["d0", "d1"])
    assert e.value.code == "unavailable"


def test_disconnected_instance_is_not_routable_but_not_down():
    c = core("least_loaded")
    c.on_load(report("p0", "prefill", connected=False), now=1.0)
    assert route(c) == ("", "d0")  # the prefill cannot take submits: decode prefills
    state, newly_down = c.tick(now=1.0)
    assert newly_down == [] and state.down == [] and "p0" in state.live
    assert [i.alive for i in c.instances("prefill").instances] == [True]
    c.on_load(report("d0", "decode", connected=False), now=1.0)
    with pytest.raises(StrataError) as e:
        route(c)
    assert e.value.code == "unavailable"
    c.on_load(report("p0", "prefill"), now=2.0)  # reconnected
    c.on_load(report("d0", "decode"), now=2.0)
    assert route(c) == ("p0", "d0")
