"""The simulator runs the real policies on the real Mooncake trace (first requests only)."""

from __future__ import annotations

import os

import pytest

from loadtests.loadgen.trace import DEFAULT_TRACE as MOONCAKE
from loadtests.loadgen.trace import TraceScale, row_prompt, scaled_lengths
from loadtests.loadgen.trace import load_trace as load_mooncake
from loadtests.simulator.cluster import Job, SimConfig
from loadtests.simulator.realreplay import sim_trace, token_block_hashes
from loadtests.simulator.run import run_all, table
from loadtests.simulator.sim import Simulation
from loadtests.simulator.trace import DEFAULT_TRACE, load_trace
from services.scheduler.policies import make_policy

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


def _colocated(**kw) -> Simulation:
    cfg = SimConfig(
        num_prefill=0,
        num_decode=2,
        block_tokens=16,
        engine_cache_blocks=64,
        decode_kv_blocks=64,
        pool_enabled=False,
        **kw,
    )
    return Simulation(cfg, make_policy("prefix_aware"))


def test_between_load_reports_the_policy_sees_what_was_routed_since():
    """Load reports every 10 s: two prompts routed at the same moment see the first report
    plus what the scheduler routed since (as `SchedulerCore` counts it), so the second goes to
    the other instance; with a report at every decision the views carry nothing pending."""
    sim = _colocated(load_interval_s=10.0)
    a, b = (Job(i, 1.0, 320, 4, ()) for i in range(2))
    sim.route(1.0, a)
    first = a.decode.view
    assert (first.pending_tokens, first.pending_requests) == (320, 1)
    sim.route(1.0, b)
    assert b.decode is not a.decode  # the first one's pending prompt counts against it
    sim.route(11.0, Job(2, 11.0, 32, 4, ()))  # a report arrived meanwhile: pending cleared
    assert sum(x.view.pending_requests for x in sim.decode) == 1
    fresh = _colocated()
    fresh.route(1.0, Job(0, 1.0, 320, 4, ()))
    fresh.route(1.0, Job(1, 1.0, 32, 4, ()))
    assert sum(x.view.pending_requests for x in fresh.decode) <= 1


def test_report_due_follows_the_instances_own_period():
    sim = _colocated(load_interval_s=0.5)
    x = sim.decode[1]
    assert x.next_report == pytest.approx(0.25)  # phases spread over the period
    assert not x.report_due(0.2, 0.5) and x.report_due(0.3, 0.5)
    assert x.next_report == pytest.approx(0.75)
    assert x.report_due(2.0, 0.5) and x.next_report == pytest.approx(2.25)


def test_running_sequences_take_their_blocks_from_the_cache():
    """`cache_holds_running`: a running sequence's output and partial blocks shrink the cache
    it shares with them, and the blocks evicted for it are announced (the index drops them);
    when it ends the cache has its capacity back. Off, the cache keeps its size."""
    sim = _colocated(cache_holds_running=True)
    inst = sim.decode[0]
    hashes = [f"h{i}" for i in range(60)]
    sim.store(inst, hashes)
    assert sim.index.lookup(hashes, 0.0).engine_blocks == {inst.view.instance_id: 60}
    job = Job(0, 0.0, 16 * 4, 16 * 8, tuple(hashes[:4]))  # 4 prompt blocks, 8 output blocks
    inst.decode_wait.append(job)
    sim.admit_decode(0.0, inst)
    assert inst.cache.capacity == 64 - 8 and len(inst.cache.d) == 56
    assert sim.index.lookup(hashes, 0.0).engine_blocks == {}  # h0.. were the oldest: evicted
    sim.end_decode(1.0, inst, job, 12)
    assert inst.cache.capacity == 64
    off = _colocated()
    off.store(off.decode[0], hashes)
    off.decode[0].decode_wait.append(Job(0, 0.0, 64, 128, tuple(hashes[:4])))
    off.admit_decode(0.0, off.decode[0])
    assert len(off.decode[0].cache.d) == 60


def test_the_replay_hashes_the_real_token_blocks():
    """The real-cluster replay feeds the simulator the prompts' token ids, hashed per full block
    over the ids up to its end (an engine's prefix-cache key): prompts that share 40 tokens
    share two 16-token blocks, the third differs, a partial block has no hash."""
    base = list(range(100, 140))
    one, two = token_block_hashes(base + [1] * 20, 16), token_block_hashes(base + [2] * 20, 16)
    assert len(one) == len(two) == 3
    assert one[:2] == two[:2] and one[2] != two[2]
    assert token_block_hashes(list(range(31)), 16) == token_block_hashes(list(range(16)), 16)
    assert token_block_hashes([5] * 32, 16)[0] != token_block_hashes([5] * 32, 16)[1]


def test_the_replay_counts_the_served_models_tokens():
    from services.cluster_config import ensure_model
    from shared.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(ensure_model(""))
    scale = TraceScale(time_scale=0.15, max_requests=20)
    rows = load_mooncake(MOONCAKE, 20)
    words, tokens = sim_trace(rows, scale), sim_trace(rows, scale, tok)
    for w, t, row in zip(words, tokens, rows, strict=True):
        ids = tok.encode(row_prompt(row, scale), True)
        assert t.input_len == len(ids) and len(t.hashes) == len(ids) // 16
        assert w.input_len == scaled_lengths(row, scale)[0]
    assert sum(t.input_len for t in tokens) > sum(w.input_len for w in words)
