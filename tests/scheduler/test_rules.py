"""The shared reuse / routing rules, and the simulator deciding exactly as the service does."""

from __future__ import annotations

import pytest

from loadtests.simulator.cluster import SimConfig
from loadtests.simulator.sim import Simulation
from loadtests.simulator.trace import load_trace
from services.scheduler.config import SchedulerConfig
from services.scheduler.core import SchedulerCore
from services.scheduler.policies import make_policy
from services.scheduler.prefix_index import PrefixIndex
from services.scheduler.rules import apply_kv_event, expect_routed, predicted_ttft, request_view
from services.scheduler.types import CostModel, InstanceView, RequestView
from shared.kvcache_rules import plan_reuse, pool_continuation
from shared.protocol.errors import StrataError
from shared.protocol.kv import KVEvent
from shared.protocol.load import LoadReport
from shared.protocol.sched import RouteRequest
from shared.worker.cost import ReuseCostModel as WorkerCost

LOAD_S = {"dram": 1.0, "ssd": 5.0}


def test_pool_continues_after_the_local_prefix():
    tiers = [None, "dram", "dram", None, "ssd"]  # block 0 never reached the pool
    assert pool_continuation(0, tiers) == []
    assert pool_continuation(1, tiers) == ["dram", "dram"]
    plan = plan_reuse(1, tiers, 2.0, LOAD_S.__getitem__)
    assert (plan.local_blocks, plan.pool_tiers, plan.load_s) == (1, ("dram", "dram"), 2.0)
    assert plan.cached_tokens(num_tokens=100, block_tokens=16) == 48
    assert plan.cached_tokens(num_tokens=40, block_tokens=16) == 39  # last token computed
    # an SSD block costs more to load (5) than to compute (2): the worker stops before it
    assert plan_reuse(0, ["dram", "ssd", "dram"], 2.0, LOAD_S.__getitem__).pool_tiers == ("dram",)
    # ... unless loading the run that follows pays it back
    assert plan_reuse(0, ["dram", "ssd"] + ["dram"] * 4, 2.0, LOAD_S.__getitem__).pool_blocks == 6


def test_worker_cost_model_uses_the_shared_rule():
    cost = WorkerCost(
        block_size=16, prefill_s_per_token=0.125, load_s_per_block={"dram": 1.0, "ssd": 5.0}
    )
    assert cost.blocks_to_load(["dram", "ssd", "dram"]) == 1
    assert cost.plan(1, [None, "dram", "dram"]).pool_tiers == ("dram", "dram")


def test_index_walks_pool_tiers_past_an_engine_prefix():
    idx = PrefixIndex()
    views = {"p0": InstanceView("p0", "prefill")}

    def ev(inst, seq, tier, hashes):
        return KVEvent(
            instance_id=inst, incarnation="a", seq=seq, tier=tier, kind="stored", hashes=hashes
        )

    assert apply_kv_event(idx, ev("p0", 1, "engine", ["a", "b"]), views["p0"])
    assert views["p0"].cached_blocks == 2
    apply_kv_event(idx, ev("pool", 1, "dram", ["b", "c"]), None)
    apply_kv_event(idx, ev("pool", 2, "ssd", ["d"]), None)
    m = idx.lookup(["a", "b", "c", "d", "e"])
    assert m.engine_blocks == {"p0": 2}
    assert m.pool_tiers == [None, "dram", "dram", "ssd"] and m.pool_blocks == 0
    cost = CostModel(prefill_tokens_per_s=100.0, dram_tokens_per_s=1600.0, ssd_tokens_per_s=800.0)
    req = request_view("r", 80, m, 16, 0.0)
    assert req.pool_tiers == (None, "dram", "dram", "ssd")
    ttft, cached = predicted_ttft(req, views["p0"], cost)
    # 2 own blocks, then pool blocks 2-3 (c: dram 0.01 s, d: ssd 0.02 s), 16 tokens computed
    assert cached == 64 and ttft == pytest.approx(16 / 100 + 0.01 + 0.02)
    # an instance without the prefix gets nothing from the pool (block 0 is not there)
    assert predicted_ttft(req, InstanceView("p1", "prefill"), cost) == (pytest.approx(0.8), 0)
    expect_routed(idx, "p1", ["a", "b"], now=10.0, ttl_s=5.0)
    assert idx.lookup(["a", "b"], now=14.0).engine_blocks == {"p0": 2, "p1": 2}
    assert idx.lookup(["a", "b"], now=15.0).engine_blocks == {"p0": 2}
    expect_routed(idx, "p1", ["a"], now=10.0, ttl_s=0.0)  # TTL 0: wait for the event
    assert idx.lookup(["a"], now=11.0).engine_blocks == {"p0": 1}


def test_request_view_without_match():
    assert request_view("r", 5, None, 16, 2.0, max_tokens=3) == RequestView(
        "r", 5, max_tokens=3, ttft_slo_s=2.0, block_tokens=16
    )


class _Mirrored(Simulation):
    """The simulator, with a `SchedulerCore` fed the same KV events and load reports deciding
    every request alongside it."""

    def __init__(self, cfg: SimConfig, core: SchedulerCore, policy) -> None:
        self.core = core
        self.pairs: list[tuple[tuple, tuple]] = []
        super().__init__(cfg, policy)

    def on_kv_event(self, ev: KVEvent) -> bool:
        self.core.on_kv_event(ev)
        return super().on_kv_event(ev)

    def decide(self, now, job, req):
        for x in self.prefill + self.decode:
            v = x.view
            self.core.on_load(
                LoadReport(
                    instance_id=v.instance_id,
                    role=v.role,
                    incarnation="sim",
                    ts=now,
                    num_running=v.num_running,
                    num_waiting=v.num_waiting,
                    waiting_tokens=v.waiting_tokens,
                    kv_blocks_total=v.kv_blocks_total,
                    kv_blocks_free=v.kv_blocks_free,
                    prefill_tokens_per_s=v.prefill_tokens_per_s,
                    block_size=v.block_size,
                ),
                now=now,
            )
        d = super().decide(now, job, req)
        route = RouteRequest(
            request_id=req.request_id,
            num_prompt_tokens=job.input_len,
            block_hashes=list(job.hashes),
            max_tokens=job.output_len,
            ttft_slo_ms=self.cfg.ttft_slo_s * 1000,
        )
        try:
            r = self.core.route(route, now=now)
            svc = (r.prefill_instance, r.decode_instance, r.expected_cached_tokens, False)
        except StrataError as exc:
            assert exc.code == "overloaded"
            svc = ("", "", 0, True)
        sim = (
            ("", "", 0, True)
            if d.reject
            else (d.prefill_instance, d.decode_instance, d.cached_tokens, False)
        )
        self.pairs.append((sim, svc))
        return d


@pytest.mark.parametrize("policy", ["prefix_aware", "round_robin"])
def test_simulator_routes_as_the_service_on_the_mooncake_trace(policy):
    trace = load_trace(limit=200)
    cfg = SimConfig(
        num_prefill=4,
        num_decode=2,
        engine_cache_blocks=300,
        pool_dram_blocks=200,
        pool_write_through=False,
        rate_scale=4.0,
        ttft_slo_s=3.0,
    )
    scfg = SchedulerConfig.load(
        [], role="scheduler", policy=policy, down_after=10**6, block_size=cfg.block_tokens
    )
    core = SchedulerCore(scfg)
    sim = _Mirrored(cfg, core, make_policy(policy, scfg.cost_model(), **scfg.policy_options()))
    sim.run(trace)
    assert len(sim.pairs) == 200
    mismatched = [(i, a, b) for i, (a, b) in enumerate(sim.pairs) if a != b]
    assert mismatched == []
    # the replay exercised every shared rule: holders, pool continuations, expectations,
    # cache footprints, more than one prefill instance, and (prefix_aware) rejections
    routed = [a for a, _ in sim.pairs if not a[3]]
    assert len({a[0] for a in routed if a[0]}) == 4
    assert sum(a[2] > 0 for a in routed) > 50
    assert sim.pool.hit_blocks["dram"] + sim.pool.hit_blocks["ssd"] > 0
    assert core.index._expected and min(v.cached_blocks for v in core.members.live("prefill")) > 0
    if policy == "prefix_aware":
        assert 0 < sum(a[3] for a, _ in sim.pairs) < 100
