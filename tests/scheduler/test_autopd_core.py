"""AutoPD in `SchedulerCore`: the planner's flip becomes a `RoleChange`, the instance is marked
draining (routed nothing more) until it comes back under its new role and incarnation."""

from __future__ import annotations

from services.scheduler.config import SchedulerConfig
from services.scheduler.core import SchedulerCore
from shared.protocol.load import LoadReport
from shared.protocol.sched import RouteRequest


def report(iid: str, role: str, inc: str = "a", **kw) -> LoadReport:
    return LoadReport(
        instance_id=iid,
        role=role,
        incarnation=inc,
        ts=0,
        grpc_addr=f"h:{iid}",
        kv_blocks_total=100,
        kv_blocks_free=100,
        prefill_tokens_per_s=1000.0,
        **kw,
    )


def make(autopd: bool = True) -> SchedulerCore:
    cfg = SchedulerConfig.load(
        [],
        role="scheduler",
        down_after=100,
        autopd=autopd,
        autopd_ratio=2.0,
        autopd_min_pressure=0.5,
        autopd_hold_ticks=2,
        autopd_cooldown_ticks=5,
    )
    return SchedulerCore(cfg)


def burst(c: SchedulerCore, now: float) -> None:
    # 8000 queued prompt tokens at 1000 tok/s = 8 s backlog: prefill pressure 4 (target 2 s)
    c.on_load(report("p0", "prefill", waiting_tokens=8000, num_waiting=4), now=now)
    c.on_load(report("d0", "decode", num_running=3), now=now)
    c.on_load(report("d1", "decode", num_running=1), now=now)


def test_flip_ordered_after_hold_and_instance_drains():
    c = make()
    burst(c, 0.0)
    assert c.plan_roles(0.0) == []
    changes = c.plan_roles(0.5)
    assert [(x.instance_id, x.incarnation, x.from_role, x.to_role) for x in changes] == [
        ("d1", "a", "decode", "prefill")
    ]
    assert [v.instance_id for v in c.members.live("decode")] == ["d0"]
    # a report sent before the instance saw the command does not make it routable again
    burst(c, 0.6)
    assert [v.instance_id for v in c.members.live("decode")] == ["d0"]
    for i in range(4):
        r = c.route(RouteRequest(request_id=f"r{i}", num_prompt_tokens=2000))
        assert r.decode_instance == "d0"
    info = {i.instance_id: i for i in c.instances().instances}
    assert info["d1"].draining and not info["d0"].draining
    # the flipped instance reports as prefill under a new incarnation: routable as prefill
    c.on_load(report("d1", "prefill", inc="b"), now=1.0)
    assert [v.instance_id for v in c.members.live("prefill")] == ["d1", "p0"]
    info = {i.instance_id: i for i in c.instances().instances}
    assert (info["d1"].role, info["d1"].incarnation, info["d1"].draining) == ("prefill", "b", False)


def test_off_by_default_orders_nothing():
    c = make(autopd=False)
    assert SchedulerConfig.load([], role="scheduler").autopd is False
    for t in range(10):
        burst(c, t * 0.5)
        assert c.plan_roles(t * 0.5) == []


def test_scheduler_mark_expires_when_the_instance_never_drains():
    """A change the instance ignored (say it restarted): its reports say it is not draining,
    so once the scheduler's own mark runs out it is routable again."""
    c = make()
    burst(c, 0.0)
    c.plan_roles(0.0)
    assert c.plan_roles(0.5)[0].instance_id == "d1"
    until = c.members.members["d1"].drain_until
    burst(c, until - 0.01)
    assert [v.instance_id for v in c.members.live("decode")] == ["d0"]
    burst(c, until + 0.01)
    assert [v.instance_id for v in c.members.live("decode")] == ["d0", "d1"]
    # and the instance's own draining report keeps it out whatever the mark says
    c.on_load(report("d1", "decode", draining=True), now=until + 1)
    assert [v.instance_id for v in c.members.live("decode")] == ["d0"]
