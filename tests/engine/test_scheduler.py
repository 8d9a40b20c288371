from shared.engine.block_manager import BlockManager
from shared.engine.scheduler import Scheduler
from shared.engine.sequence import Sequence, SequenceStatus
from shared.protocol.sampling import SamplingParams

SALT = b"s" * 16
P = SamplingParams(max_tokens=4, temperature=0.0)


def mk(num_blocks=8, bs=4, budget=8, max_seqs=4, chunked=True, mode="recompute"):
    bm = BlockManager(num_blocks, bs)
    return Scheduler(bm, SALT, max_seqs, budget, chunked, mode, eos_token_ids=[99])


def seq(rid, n, prio=0, params=P, start=0):
    return Sequence(rid, list(range(start, start + n)), n, params, priority=prio)


def plan(out):
    return [(s.seq.request_id, s.start, s.num_new_tokens) for s in out.scheduled]


def test_chunked_prefill_mixed_with_decode_under_budget():
    s = mk(budget=8)
    a, b = seq("a", 3), seq("b", 13)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert plan(out) == [("a", 0, 3), ("b", 0, 5)]  # b chunked to the remaining budget
    assert a.block_table == [0] and b.block_table == [1, 2]
    s.postprocess(out, [[50], []])
    assert a.token_ids[-1] == 50 and a.num_computed_tokens == 3 and b.num_computed_tokens == 5
    out = s.schedule()
    assert plan(out) == [("a", 3, 1), ("b", 5, 7)]  # decode first, then the next chunk
    s.postprocess(out, [[51], []])
    out = s.schedule()
    assert plan(out) == [("a", 4, 1), ("b", 12, 1)]
    assert a.block_table == [0, 4] and b.block_table == [1, 2, 3, 5]


def test_unchunked_prompt_waits_for_whole_budget():
    s = mk(budget=8, chunked=False)
    a, b = seq("a", 3), seq("b", 7)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert plan(out) == [("a", 0, 3)]
    s.postprocess(out, [[1]])
    assert plan(s.schedule()) == [("a", 3, 1), ("b", 0, 7)]


def test_max_tokens_eos_stop_ids_free_blocks():
    s = mk(budget=16)
    a = seq("a", 4, params=SamplingParams(max_tokens=2, temperature=0))
    b = seq("b", 4, params=SamplingParams(max_tokens=9, stop_token_ids=[7]))
    c = seq("c", 4)
    for x in (a, b, c):
        s.add(x)
    out = s.schedule()
    s.postprocess(out, [[1], [2], [99]])
    assert c.finish_reason == "stop" and c.block_table == []
    out = s.schedule()
    s.postprocess(out, [[3], [7]])
    assert a.finish_reason == "length" and a.output_token_ids == [1, 3]
    assert b.finish_reason == "stop" and b.output_token_ids == [2, 7]
    assert not s.has_unfinished() and s.bm.num_free_blocks == 8


def test_prefix_hit_counts_and_last_token_recomputed():
    s = mk(budget=16)
    a = seq("a", 9)
    s.add(a)
    s.postprocess(s.schedule(), [[5]])
    assert s.bm.cached and len(s.bm.cached) == 2  # two full blocks committed
    b = seq("b", 9)  # same prompt
    s.add(b)
    out = s.schedule()
    assert plan(out)[-1] == ("b", 8, 1) and b.block_table[:2] == a.block_table[:2]
    assert s.bm.ref_counts[a.block_table[0]] == 2 and b.num_cached_tokens == 8
    c = seq("c", 8)  # exact block multiple: last block recomputed
    s.add(c)
    out = s.schedule()
    assert plan(out)[-1] == ("c", 4, 4)
    assert (s.prefix_query_tokens, s.prefix_hit_tokens) == (26, 12)


def test_out_of_kv_preempts_lowest_class_latest_arrival_recompute():
    s = mk(num_blocks=3, bs=4, budget=16)
    hi, lo1, lo2 = seq("hi", 4, 0), seq("lo1", 4, 1), seq("lo2", 3, 1)
    for x in (hi, lo1, lo2):
        s.add(x)
    out = s.schedule()
    assert plan(out) == [("hi", 0, 4), ("lo1", 0, 4), ("lo2", 0, 3)]
    s.postprocess(out, [[1], [1], [1]])
    # hi and lo1 need a new block each, pool is full: lo2 (worst, latest) goes, then lo1
    out = s.schedule()
    assert [x.request_id for x in out.preempted] == ["lo2", "lo1"]
    assert plan(out) == [("hi", 4, 1)]
    assert lo2.status == SequenceStatus.WAITING and lo2.num_computed_tokens == 0
    assert s.num_preemptions == 2 and lo1.block_table == [] and hi.block_table == [0, 2]
    s.postprocess(out, [[2]])
    # recompute: lo1 re-prefills prompt + its output token (prefix hit on its full block)
    out = s.schedule()
    assert plan(out) == [("hi", 5, 1), ("lo1", 4, 1)]
    # first admissions only (the queue-wait metric): lo1 taken again is not a new one
    assert [x.request_id for x in s.newly_admitted] == ["hi", "lo1", "lo2"]


def test_waiting_high_priority_preempts_running_batch_slot():
    s = mk(max_seqs=1, budget=8)
    lo = seq("lo", 3, prio=5)
    s.add(lo)
    s.postprocess(s.schedule(), [[1]])
    hi = seq("hi", 3, prio=0, start=100)
    s.add(hi)
    out = s.schedule()
    assert [x.request_id for x in out.preempted] == ["lo"]
    assert plan(out) == [("hi", 0, 3)]  # lo's decode was unscheduled and its budget refunded
    s.postprocess(out, [[2]])
    same = seq("same", 3, prio=0, start=200)
    s.add(same)
    out = s.schedule()
    assert out.preempted == [] and plan(out) == [("hi", 3, 1)]  # equal class never preempts


def test_swap_mode_lists_blocks_out_and_in():
    s = mk(num_blocks=3, bs=4, budget=16, mode="swap")
    hi, lo = seq("hi", 4, 0), seq("lo", 7, 1, start=50)
    s.add(hi)
    s.add(lo)
    out = s.schedule()
    s.postprocess(out, [[1], [1]])
    assert lo.block_table == [1, 2]
    out = s.schedule()  # hi needs a block: lo swapped out
    assert [(x.request_id, b) for x, b in out.swap_out] == [("lo", [1, 2])]
    assert lo.status == SequenceStatus.SWAPPED and lo.num_computed_tokens == 7
    s.postprocess(out, [[2]])
    s.finish(hi, "abort")
    out = s.schedule()
    assert [(x.request_id, b) for x, b in out.swap_in] == [("lo", [2, 1])]
    assert plan(out) == [("lo", 7, 1)]


def test_max_num_seqs_limits_batch():
    s = mk(max_seqs=2, budget=8)
    for i in range(3):
        s.add(seq(f"r{i}", 2, start=10 * i))
    assert [p[0] for p in plan(s.schedule())] == ["r0", "r1"]


def test_spec_draft_tokens_scheduled_and_accepted():
    s = mk(budget=16)
    a = seq("a", 4, params=SamplingParams(max_tokens=10, temperature=0))
    s.add(a)
    s.postprocess(s.schedule(), [[4]])
    a.draft_token_ids = [5, 6, 7]
    out = s.schedule()
    assert plan(out) == [("a", 4, 4)] and out.scheduled[0].num_draft_tokens == 3
    s.postprocess(out, [[5, 6, 9]])  # two drafts accepted + bonus token
    assert a.output_token_ids == [4, 5, 6, 9] and a.num_computed_tokens == 7


def test_blocks_committed_when_finishing_in_the_same_step():
    s = mk(budget=16)
    a = seq("a", 9, params=SamplingParams(max_tokens=1))
    s.add(a)
    s.postprocess(s.schedule(), [[5]])
    assert a.finish_reason == "length" and len(s.bm.cached) == 2
    assert s.bm.num_free_blocks == 8


def test_waiting_queue_is_fair_between_tenants_within_a_priority_class():
    from shared.engine.fair_queue import Tenant

    s = mk(num_blocks=64, bs=4, budget=64, max_seqs=1)
    a, b = Tenant("a", weight=3), Tenant("b")
    seqs = [seq(f"a{i}", 4, prio=1, start=10 * i) for i in range(4)]
    seqs += [seq(f"b{i}", 4, prio=1, start=50 + 10 * i) for i in range(2)]
    seqs.append(seq("urgent", 4, prio=0, start=90))  # tenant b, past its share, better class
    for x in seqs:
        x.tenant = a if x.request_id.startswith("a") else b
        s.add(x)
    order = []
    while s.waiting:
        s.schedule()
        (x,) = s.newly_admitted
        order.append(x.request_id)
        s.newly_admitted.clear()
        s.finish(x, "stop")
    # cost 4 tokens: a's tags 0, 4/3, 8/3, 4; b's 0, 4, then 8 for urgent (class 0 wins anyway)
    assert order == ["urgent", "a0", "b0", "a1", "a2", "a3", "b1"]
