"""The autoscaling rule (`services.scheduler.autoscale`): pressure per instance against the SLO
targets, the need within bounds, hold and cooldown ticks, the least-loaded retirement; the
scheduler core turning a retirement into a `RoleChange` to "retired" and exporting the need;
the launcher's side (the need parsed from metrics, a retired exit that is not a crash)."""

from __future__ import annotations

import sys

import pytest

from services.infra.scaler import parse_need
from services.infra.supervisor import RETIRED_EXIT as SUP_RETIRED_EXIT
from services.infra.supervisor import ProcSpec, Supervisor
from services.scheduler.autoscale import RETIRED, Autoscaler, ScaleConfig
from services.scheduler.config import SchedulerConfig
from services.scheduler.core import SchedulerCore
from services.scheduler.planner import RoleLoad
from shared.protocol.load import LoadReport
from shared.protocol.sched import RETIRED_EXIT

CFG = ScaleConfig(
    min_decode=1,
    max_decode=3,
    up_ticks=2,
    down_ticks=3,
    cooldown_ticks=2,
    batch_norm=4,
    tpot_s=0.05,
    ttft_s=1.0,
    default_rate=1000.0,
)


def dec(iid: str, seqs: int = 0, step_s: float = 0.0, queued: int = 0, draining=False):
    return RoleLoad(
        iid, "decode", queued_tokens=queued, num_running=seqs, step_s=step_s, draining=draining
    )


def run(a: Autoscaler, loads, ticks: int):
    out = []
    for _ in range(ticks):
        out += a.tick(loads)
    return out


def test_pressure_is_the_larger_of_batch_and_backlog():
    a = Autoscaler(CFG)
    assert a.pressure(dec("d", seqs=2)) == 0.5
    assert a.pressure(dec("d", queued=3000)) == 3.0  # 3 s of prompts at 1000 tok/s, 1 s TTFT
    pre = RoleLoad("p", "prefill", queued_tokens=500, prefill_tokens_per_s=250.0)
    assert a.pressure(pre) == 2.0


def test_steps_over_the_tpot_target_call_for_one_more_and_block_retiring():
    a = Autoscaler(CFG)  # tpot 50 ms, utilization 0.7
    assert a.needed("decode", [dec("d0", seqs=1), dec("d1", seqs=0)]) == (1, 2)
    assert a.needed("decode", [dec("d0", seqs=1, step_s=0.06), dec("d1")]) == (3, 2)
    # steps at 40 ms: within the target but above 0.7 of it: keep the fleet, retire none
    assert a.needed("decode", [dec("d0", seqs=1, step_s=0.04), dec("d1")]) == (2, 2)


def test_adds_after_the_hold_and_not_beyond_max():
    a = Autoscaler(CFG)
    hot = [dec("d0", seqs=8)]  # pressure 2 -> need ceil(2 / 0.7) = 3
    assert a.tick(hot) == []  # one tick is not enough
    (act,) = a.tick(hot)
    assert (act.role, act.action, act.need) == ("decode", "add", 3)
    assert run(a, hot, 2) == []  # cooldown
    assert [x.action for x in run(a, hot, 2)] == ["add"]  # still short: one more
    full = [dec("d0", seqs=8), dec("d1", seqs=8), dec("d2", seqs=8)]
    assert run(a, full, 10) == []  # at max: never more


def test_retires_the_least_loaded_after_the_longer_hold_and_keeps_min():
    a = Autoscaler(CFG)
    calm = [dec("d0", seqs=1), dec("d1", seqs=0), dec("d2", seqs=1)]  # 0.5 -> need 1
    assert run(a, calm, 2) == []
    (act,) = a.tick(calm)
    assert (act.action, act.instance_id, act.need) == ("retire", "d1", 1)
    one = [dec("d0", seqs=0)]
    assert run(a, one, 20) == []  # never below min_decode
    # draining instances count for nothing: the rest is what is weighed
    a = Autoscaler(CFG)
    assert a.needed("decode", [dec("d0", seqs=8, draining=True), dec("d1")]) == (1, 1)


def test_a_role_without_room_is_not_scaled():
    a = Autoscaler(CFG)  # max_prefill 0: the colocated shape
    pre = [RoleLoad("p0", "prefill", queued_tokens=10**6)]
    assert run(a, pre + [dec("d0")], 10) == []
    assert "prefill" not in a.need


def _report(iid: str, running: int, inc: str = "a") -> LoadReport:
    return LoadReport(
        instance_id=iid,
        role="decode",
        incarnation=inc,
        ts=0.0,
        num_running=running,
        kv_blocks_total=10,
        kv_blocks_free=10,
    )


def test_core_orders_a_retirement_and_stops_routing_there():
    cfg = SchedulerConfig(
        autoscale=True,
        autoscale_min_decode=1,
        autoscale_max_decode=2,
        batch_norm=4,
        autoscale_up_ticks=1,
        autoscale_down_ticks=2,
        autoscale_cooldown_ticks=0,
    )
    core = SchedulerCore(cfg)
    for iid, n in (("d0", 0), ("d1", 1)):
        core.on_load(_report(iid, n), now=0.0)
    assert core.plan_scale(now=0.1) == []
    (change,) = core.plan_scale(now=0.2)
    assert (change.instance_id, change.from_role, change.to_role) == ("d0", "decode", RETIRED)
    assert change.incarnation == "a"
    assert [v.instance_id for v in core.members.live("decode")] == ["d1"]
    from prometheus_client import REGISTRY

    assert REGISTRY.get_sample_value("strata_scheduler_desired_instances", {"role": "decode"}) == 1
    with pytest.raises(ValueError, match="autoscale_min_decode 3 is above autoscale_max_decode 2"):
        SchedulerConfig(autoscale_min_decode=3, autoscale_max_decode=2)


def test_without_retire_the_need_falls_and_no_instance_is_retired():
    """Kubernetes (``autoscale_retire`` off): the gauge drops as with `strata up`, but the
    scheduler orders no retirement and keeps routing to every instance: KEDA or the HPA removes
    a pod, and that pod drains in its preStop hook."""
    cfg = SchedulerConfig(
        autoscale=True,
        autoscale_retire=False,
        autoscale_min_decode=1,
        autoscale_max_decode=2,
        batch_norm=4,
        autoscale_up_ticks=1,
        autoscale_down_ticks=2,
        autoscale_cooldown_ticks=0,
    )
    core = SchedulerCore(cfg)
    for iid, n in (("d0", 0), ("d1", 1)):
        core.on_load(_report(iid, n), now=0.0)
    assert core.plan_scale(now=0.1) == [] and core.plan_scale(now=0.2) == []
    assert [v.instance_id for v in core.members.live("decode")] == ["d0", "d1"]
    from prometheus_client import REGISTRY

    assert REGISTRY.get_sample_value("strata_scheduler_desired_instances", {"role": "decode"}) == 1


def test_need_is_read_from_the_schedulers_metrics():
    text = (
        "# HELP strata_scheduler_desired_instances x\n"
        'strata_scheduler_desired_instances{role="prefill"} 0.0\n'
        'strata_scheduler_desired_instances{role="decode"} 2.0\n'
    )
    assert parse_need(text, "decode") == 2
    assert parse_need("", "decode") is None


def test_a_retired_exit_is_on_purpose_a_crash_is_not(tmp_path):
    assert SUP_RETIRED_EXIT == RETIRED_EXIT
    sup = Supervisor()
    for name, code in (("decode-0", RETIRED_EXIT), ("decode-1", 1)):
        argv = [sys.executable, "-c", f"raise SystemExit({code})"]
        sup.start(ProcSpec(name, argv, {}, ready=False))
    for p in sup.procs.values():
        p.proc.wait(10)
    assert not sup.wanted("decode-0") and sup.wanted("decode-1")
    assert [p.name for p in sup.exited()] == ["decode-1"]


def test_simulated_wave_autoscaled_nearly_matches_the_max_fleet_at_far_less_cost():
    """loadtests/simulator/autoscale.py, the same rule on a quiet-peak-quiet trace: goodput
    near the fixed max fleet's, at well under its decode instance-seconds, where the fixed min
    fleet misses most of the TPOT target."""
    from loadtests.simulator.autoscale import compare

    lo, hi, auto, fast, ahead = compare()
    assert lo.goodput < 0.2 and hi.goodput == 1.0
    assert auto.adds >= 2 and auto.retires >= 2 and auto.peak_decode == 4
    assert auto.goodput > 0.8 and fast.goodput > 0.95
    assert auto.decode_instance_s < 0.7 * hi.decode_instance_s
    # looking ahead along the load's trend starts instances earlier: more goodput, more cost
    assert auto.goodput < ahead.goodput and auto.decode_instance_s < ahead.decode_instance_s


def test_a_max_below_the_starting_fleet_is_one_start_up_line():
    from services.cluster_config import ClusterConfig, check_autoscale

    with pytest.raises(RuntimeError, match="--autoscale-max-decode 1 is below --decode 2"):
        check_autoscale(ClusterConfig(decode=2, autoscale_max_decode=1))
    check_autoscale(ClusterConfig(decode=2, autoscale_max_decode=0))  # off: a fixed fleet
