"""A decode instance that prefills beside its decodes (the colocated shape) reports the prefill
rate of its real work, not its warm-up's: `ModelRuntime.observe_stats` folds the engine's
mostly-prefill forwards (`EngineStats.prefill_tokens` / ``prefill_forward_s``, counted by the
engine: tests/engine/test_prefill_rate.py) into the cost model its load reports carry. The
warm-up ran while every instance of the box started at once; kept for life, it sent one
instance 1.3-1.5x the mean of the prompts (`loadtests.simulator.realreplay`)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from shared.engine.outputs import EngineStats
from shared.worker.config import WorkerConfig
from shared.worker.cost import ReuseCostModel
from shared.worker.runtime import ModelRuntime

ZERO = EngineStats(
    running=0,
    waiting=0,
    swapped=0,
    kv_blocks_total=64,
    kv_blocks_free=64,
    kv_usage=0.0,
    kv_pool_bytes=0,
    prefix_query_tokens=0,
    prefix_hit_tokens=0,
    preemptions=0,
    steps=0,
    forward_time_s=0.0,
    step_time_s=0.0,
    idle_gap_s=0.0,
)


def runtime(role: str, instance: str) -> tuple[ModelRuntime, dict]:
    cfg = WorkerConfig(instance_id=instance)
    rt = ModelRuntime(cfg, role)
    rt.cost = ReuseCostModel(cfg.block_size, prefill_s_per_token=1e-4)  # warm-up: 10k tok/s
    now = {"stats": ZERO}
    rt.port = SimpleNamespace(
        stats=lambda: now["stats"], drain_admissions=list, drain_step_times=list
    )
    return rt, now


@pytest.mark.parametrize("role", ["decode", "mixed"])
def test_the_reported_rate_follows_the_mostly_prefill_forwards(role):
    rt, now = runtime(role, f"rate-{role}")
    rate = lambda: 1.0 / rt.cost.prefill_s_per_token  # what its load reports carry  # noqa: E731
    assert rate() == pytest.approx(10_000)
    tokens, secs = 0, 0.0
    for _ in range(30):  # 2000 prompt tokens a second of forward
        tokens, secs = tokens + 1000, secs + 0.5
        now["stats"] = dataclasses.replace(ZERO, prefill_tokens=tokens, prefill_forward_s=secs)
        rt.observe_stats()
    assert rate() == pytest.approx(2000, rel=0.01)
    # under one block of prompt tokens since the last reading: no new measurement yet
    now["stats"] = dataclasses.replace(ZERO, prefill_tokens=tokens + 8, prefill_forward_s=secs + 1)
    rt.observe_stats()
    assert rate() == pytest.approx(2000, rel=0.01)


def test_a_prefill_instance_keeps_its_own_measure():
    """A prefill instance's forwards are all prefill: its rate comes from the prompt tokens it
    computed (``prefilled_tokens``) over all its forward time, as before."""
    rt, now = runtime("prefill", "rate-prefill")
    rt.prefilled_tokens = 3000
    now["stats"] = dataclasses.replace(
        ZERO, forward_time_s=1.0, prefill_tokens=99, prefill_forward_s=9
    )
    for _ in range(30):
        rt.observe_stats()
        rt.prefilled_tokens += 3000
        now["stats"] = dataclasses.replace(
            now["stats"], forward_time_s=now["stats"].forward_time_s + 1
        )
    assert 1.0 / rt.cost.prefill_s_per_token == pytest.approx(3000, rel=0.01)
