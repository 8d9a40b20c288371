"""The simulator runs the real policies on the real Mooncake trace (first requests only)."""

from __future__ import annotations

import os

import pytest

from loadtests.simulator.cluster import SimConfig
from loadtests.simulator.run import run_all, table
from loadtests.simulator.trace import DEFAULT_TRACE, load_trace

REL = os.path.join("loadtests", "data", "mooncake", "conversation_trace.jsonl")


def test_trace_is_vendored_in_the_repo():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert os.path.samefile(DEFAULT_TRACE, os.path.join(root, REL))
    tr = load_trace(limit=5)
    assert [r.input_len for r in tr] == [6758, 7322, 7236, 2290, 6760]
    assert tr[0].hashes[:2] == ("0", "1") and tr[1].hashes[:2] == ("0", "e")


def test_policies_on_trace_prefix():
    trace = load_trace(limit=400)
    cfg = SimConfig(num_prefill=2, num_decode=2, rate_scale=1.0, ttft_slo_s=5.0)
    res = dict(run_all(cfg, trace))
    rr, pa = res["round_robin"], res["prefix_aware"]
    assert rr.requests == pa.requests == 400
    assert rr.rejected == pa.rejected == 0
    # Write-through pool: every policy reuses about the same prefix (own cache first, then the
    # pool's continuation; a prompt prefilled on decode weighs loading at decode's rate);
    # prefix_aware finds more of it locally and is faster.
    reuse = rr.hit_rate + rr.pool_hit_rate
    assert pa.hit_rate + pa.pool_hit_rate == pytest.approx(reuse, rel=0.01)
    assert 0.05 < pa.hit_rate + pa.pool_hit_rate < 0.6
    assert pa.hit_rate > rr.hit_rate and rr.pool_hit_rate > pa.pool_hit_rate > 0
    assert pa.ttft_p50 < rr.ttft_p50
    assert res["prefix_aware+slo_reject"].rejected > 0
    assert "| x1 | prefix_aware |" in table([(1.0, k, v) for k, v in res.items()], 5.0)
