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


# ----- fair share: the contention cap and batch-slot shares (FairShare) ----------------------
class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def fair_mk(step_tokens=8, window_s=5.0, fair=True, lead=False, slice_tokens=0, **kw):
    """A fair-queuing scheduler on a test clock; ``lead`` (`FairShare.lead`) off unless asked,
    so the other mechanisms are seen alone."""
    from shared.engine.fair_queue import FairQueue
    from shared.engine.scheduler import FairShare

    clock = Clock()
    bm = BlockManager(kw.pop("num_blocks", 64), kw.pop("bs", 4))
    s = Scheduler(
        bm,
        SALT,
        kw.pop("max_seqs", 4),
        kw.pop("budget", 32),
        eos_token_ids=[99],
        fair=FairQueue(fair),
        share=FairShare(step_tokens, window_s, clock, lead, slice_tokens),
    )
    return s, clock


def of(tenant, rid, n, start, prio=0, params=P):
    from shared.engine.fair_queue import Tenant

    x = seq(rid, n, prio=prio, params=params, start=start)
    x.tenant = Tenant(tenant)
    return x


def test_contending_tenants_cap_the_steps_prompt_tokens_and_one_tenant_keeps_the_budget():
    s, clock = fair_mk(step_tokens=8, budget=32)
    s.add(of("a", "a0", 30, 0))
    out = s.schedule()
    assert plan(out) == [("a0", 0, 30)] and s.contended_steps == 0  # alone: the full budget
    s.postprocess(out, [[1]])
    s.add(of("a", "a1", 30, 100))
    s.add(of("b", "b0", 30, 200))
    out = s.schedule()
    # two tenants: the running decode, then 8 prompt tokens, b's first (its tag is the lower)
    assert plan(out) == [("a0", 30, 1), ("b0", 0, 8)] and s.contended_steps == 1
    s.postprocess(out, [[2], []])
    s.finish(s.running[1], "abort")  # b0 gone; b's recent arrival keeps it contended
    assert plan(s.schedule()) == [("a0", 31, 1), ("a1", 0, 8)] and s.contended_steps == 2
    clock.t += 5.1  # b's last arrival is out of the window, only a is here
    out = s.schedule()  # (the step before was not run) a0's decode and all of a1's prompt
    assert plan(out) == [("a0", 31, 1), ("a1", 0, 30)] and s.contended_steps == 2


def test_the_cap_leaves_every_decode_in_the_step_and_is_off_without_fair_queuing():
    s, _ = fair_mk(step_tokens=2, budget=32, max_seqs=8)
    long = SamplingParams(max_tokens=100, temperature=0.0)
    for i in range(4):
        s.add(of("a", f"a{i}", 4, 10 * i, params=long))
    out = s.schedule()
    assert out.num_batched_tokens == 16  # one tenant: not capped
    s.postprocess(out, [[7]] * 4)
    s.add(of("b", "b0", 20, 50))
    out = s.schedule()
    assert plan(out) == [(f"a{i}", 4, 1) for i in range(4)] + [("b0", 0, 2)]
    off, _ = fair_mk(step_tokens=2, budget=32, fair=False)
    off.add(of("a", "a0", 20, 0))
    off.add(of("b", "b0", 20, 100))
    assert off.schedule().num_batched_tokens == 32 and off.contended_steps == 0


def test_a_tenant_under_its_share_of_a_full_batch_preempts_the_newest_of_the_one_over_it():
    s, _ = fair_mk(step_tokens=0, budget=64, max_seqs=4)
    a = [of("a", f"a{i}", 4, 10 * i) for i in range(4)]
    for x in a:
        s.add(x)
    s.postprocess(s.schedule(), [[7]] * 4)
    assert [x.request_id for x in s.running] == ["a0", "a1", "a2", "a3"]
    b0, b1, b2 = (of("b", f"b{i}", 4, 100 + 10 * i) for i in range(3))
    for x in (b0, b1, b2):
        s.add(x)
    out = s.schedule()
    # b's share is 2 of 4 slots: a3 then a2 (a's newest) make room for b0 and b1; b2 waits
    assert [x.request_id for x in out.preempted] == ["a3", "a2"]
    assert sorted(x.request_id for x in s.running) == ["a0", "a1", "b0", "b1"]
    assert s.share_preemptions == 2 and b2 in s.waiting and a[3].status == SequenceStatus.WAITING


def test_share_preemption_spares_better_classes_and_needs_fair_queuing():
    s, _ = fair_mk(step_tokens=0, budget=64, max_seqs=2)
    for i in range(2):
        s.add(of("a", f"a{i}", 4, 10 * i, prio=0))
    s.postprocess(s.schedule(), [[7]] * 2)
    s.add(of("b", "b0", 4, 100, prio=1))  # a worse class never takes a slot from a better one
    assert plan(s.schedule()) == [("a0", 4, 1), ("a1", 4, 1)] and s.share_preemptions == 0
    # nor from a tenant within its share: a (over it) runs only a better class, c is within it
    s, _ = fair_mk(step_tokens=0, budget=64, max_seqs=4)
    for x in [of("a", f"a{i}", 4, 10 * i, prio=0) for i in range(3)] + [of("c", "c0", 4, 40, 1)]:
        s.add(x)
    s.postprocess(s.schedule(), [[7]] * 4)
    s.add(of("b", "b0", 4, 100, prio=1))  # shares of 4 slots: 4/3 each
    assert not s.schedule().preempted and s.share_preemptions == 0
    off, _ = fair_mk(step_tokens=0, budget=64, max_seqs=2, fair=False)
    for i in range(2):
        off.add(of("a", f"a{i}", 4, 10 * i))
    off.postprocess(off.schedule(), [[7]] * 2)
    off.add(of("b", "b0", 4, 100))
    assert not off.schedule().preempted and off.share_preemptions == 0


def test_decode_ahead_yields_to_a_tenant_under_its_share():
    s, clock = fair_mk(step_tokens=0, budget=64, max_seqs=2)
    for i in range(2):
        s.add(of("a", f"a{i}", 4, 10 * i))
    out = s.schedule()
    s.postprocess(out, [[7]] * 2)
    out = s.schedule()
    assert s.schedule_decode_ahead(out) is not None  # one tenant: the fast path holds
    s.add(of("b", "b0", 4, 100))
    assert s.schedule_decode_ahead(out) is None


def test_a_light_tenants_prompt_goes_before_a_heavy_tenants_half_done_one():
    s, _ = fair_mk(step_tokens=8, budget=32)
    for i in range(2):
        s.add(of("a", f"a{i}", 30, 100 * i))
    out = s.schedule()  # one tenant: a0 whole, a1 chunked to the budget
    assert plan(out) == [("a0", 0, 30), ("a1", 0, 2)]
    s.postprocess(out, [[1], []])
    s.add(of("b", "b0", 6, 300))  # b's tag is the virtual time: below a1's
    out = s.schedule()
    assert plan(out) == [("a0", 30, 1), ("b0", 0, 6), ("a1", 2, 2)]
    off, _ = fair_mk(step_tokens=8, budget=32, fair=False)
    for i in range(2):
        off.add(of("a", f"a{i}", 30, 100 * i))
    out = off.schedule()
    off.postprocess(out, [[1], []])
    off.add(of("b", "b0", 6, 300))
    assert plan(off.schedule()) == [("a0", 30, 1), ("a1", 2, 28), ("b0", 0, 3)]  # running first


def test_a_light_tenants_new_request_gets_a_step_of_its_own_never_two_in_a_row():
    """``FairShare.lead``: while tenants contend, a new request of a tenant under its share of
    the slots runs its prompt without the heavy tenant's decodes (they wait that one step),
    and the other light tenants' new prompts waiting then join it whole (a burst starts
    together, as on an idle engine); the next step runs the decodes again even if another
    light arrival waits; with lead off (or fair queuing off) the prompt shares the step with
    the decodes."""

    def running_a(s):
        long = SamplingParams(max_tokens=100, temperature=0.0)
        for i in range(3):
            s.add(of("a", f"a{i}", 4, 10 * i, params=long))
        out = s.schedule()
        s.postprocess(out, [[7]] * 3)

    s, _ = fair_mk(step_tokens=8, budget=32, max_seqs=8, lead=True)
    running_a(s)
    s.add(of("b", "b0", 6, 100))
    s.add(of("c", "c0", 6, 200))
    out = s.schedule()
    assert plan(out) == [("b0", 0, 6), ("c0", 0, 6)] and s.lead_steps == 1  # b and c together
    s.postprocess(out, [[5], [6]])
    s.add(of("d", "d0", 6, 250))
    out = s.schedule()  # d is as light, but the decodes go first: then d beside them
    decodes = [(f"a{i}", 4, 1) for i in range(3)] + [("b0", 6, 1), ("c0", 6, 1)]
    assert plan(out) == decodes + [("d0", 0, 6)]
    assert s.lead_steps == 1
    s.postprocess(out, [[8]] * 6)
    s.add(of("b", "b1", 12, 300))  # longer than the cap: its first 8 tokens lead
    out = s.schedule()
    assert plan(out) == [("b1", 0, 8)] and s.lead_steps == 2
    # a tenant at its share of the slots (a: 3 running of 8 slots, share 8/3) gets no lead
    s.postprocess(out, [[]])
    s.add(of("a", "a9", 4, 400))
    assert s._light_arrival() is None

    for fair, lead in ((True, False), (False, True)):
        s, _ = fair_mk(step_tokens=8, budget=32, max_seqs=8, fair=fair, lead=lead)
        running_a(s)
        s.add(of("b", "b0", 6, 100))
        out = s.schedule()
        assert ("b0", 0, 6) in plan(out) and len(plan(out)) == 4 and s.lead_steps == 0


def test_a_lead_step_takes_more_light_prompts_only_whole_and_only_light_ones():
    """After the first light prompt of a lead step, the next light one in rank order joins it
    only whole, within ``max_num_batched_tokens`` (the first may be a chunk capped at
    ``step_tokens``), and the first that does not fit ends the step; the heavy tenant's
    waiting request never joins."""
    long = SamplingParams(max_tokens=100, temperature=0.0)
    s, _ = fair_mk(step_tokens=8, budget=20, max_seqs=8, lead=True)
    for i in range(3):
        s.add(of("a", f"a{i}", 4, 10 * i, params=long))
    s.postprocess(out := s.schedule(), [[7]] * 3)
    assert len(plan(out)) == 3
    s.add(of("a", "a9", 4, 50))  # heavy: 3 running + 1 waiting, past its share (8/3)
    s.add(of("b", "b0", 6, 100))
    s.add(of("c", "c0", 4, 200))  # light, 4 <= 20 - 6: joins
    s.add(of("d", "d0", 11, 300))  # light, but 11 > 10 left: not chunked in, it waits
    out = s.schedule()
    assert plan(out) == [("b0", 0, 6), ("c0", 0, 4)] and s.lead_steps == 1
    assert [x.request_id for x in s.waiting] == ["a9", "d0"]


def test_the_lead_is_for_a_light_tenant_not_a_heavy_one_holding_few_slots():
    """A tenant's waiting requests count toward its share: a heavy tenant whose short requests
    left it one running slot but a backlog of six (share 4 of 8) gets no lead step, which
    would make the light tenant's next arrival wait a step (no two leads in a row). And the
    light tenant's new request leads though the heavy tenant's next request ranks first (its
    tag: the light tenant's previous request moved its finish tag on)."""
    from shared.engine.scheduler import _rank

    long = SamplingParams(max_tokens=100, temperature=0.0)
    s, _ = fair_mk(step_tokens=8, budget=32, max_seqs=8, lead=True)
    s.add(of("b", "b0", 20, 0, params=long))  # cost 20: b's finish tag is 20
    out = s.schedule()  # b alone: an ordinary step
    s.postprocess(out, [[7]])
    s.add(of("a", "a0", 4, 100, params=long))
    out = s.schedule()
    assert plan(out) == [("a0", 0, 4)] and s.lead_steps == 1  # a is light: nothing queued
    s.postprocess(out, [[7]])
    backlog = [of("a", f"a{i}", 4, 100 + 10 * i, params=long) for i in range(1, 7)]
    for x in backlog:
        s.add(x)
    assert s._light_arrival() is None  # a: 1 running + 6 waiting, past its share of 4
    out = s.schedule()  # no lead: the decodes and 8 prompt tokens (a1, a2)
    assert plan(out) == [("b0", 20, 1), ("a0", 4, 1), ("a1", 0, 4), ("a2", 0, 4)]
    s.postprocess(out, [[7]] * 4)
    b1 = of("b", "b1", 4, 300, params=long)
    s.add(b1)
    assert _rank(backlog[2]) < _rank(b1)  # a3 (tag 12) ranks before b1 (tag 20)
    assert s._light_arrival() is b1  # b: 1 running + 1 waiting, within its share
    out = s.schedule()
    assert plan(out) == [("b1", 0, 4)] and s.lead_steps == 2


def test_a_light_arrival_leads_a_full_batch_too_by_share_preemption():
    s, _ = fair_mk(step_tokens=8, budget=32, max_seqs=3, lead=True)
    long = SamplingParams(max_tokens=100, temperature=0.0)
    for i in range(3):
        s.add(of("a", f"a{i}", 4, 10 * i, params=long))
    s.postprocess(s.schedule(), [[7]] * 3)
    s.add(of("b", "b0", 6, 100))
    out = s.schedule()
    assert [x.request_id for x in out.preempted] == ["a2"] and s.share_preemptions == 1
    assert plan(out) == [("b0", 0, 6)] and s.lead_steps == 1


def test_split_steps_run_prompt_slices_and_decodes_apart_at_the_capped_rate():
    """``FairShare.slice_tokens``: while tenants contend, a step runs either prompt chunks (at
    most a slice) or the decodes, the decodes after every ``step_tokens`` prompt tokens: the
    prompts advance as fast as with the cap alone, and the step in flight is never both."""
    s, _ = fair_mk(step_tokens=6, budget=32, max_seqs=8, slice_tokens=4)
    long = SamplingParams(max_tokens=100, temperature=0.0)
    for i in range(3):
        s.add(of("a", f"a{i}", 4, 10 * i, params=long))
    out = s.schedule()  # one tenant: no split
    assert plan(out) == [(f"a{i}", 0, 4) for i in range(3)] and s.split_steps == 0
    s.postprocess(out, [[7]] * 3)
    s.add(of("b", "b0", 20, 100))
    decodes = [(f"a{i}", 4, 1) for i in range(3)]
    out = s.schedule()
    assert plan(out) == [("b0", 0, 4)] and s.split_steps == 1  # a slice, no decodes
    s.postprocess(out, [[]])
    out = s.schedule()
    assert plan(out) == [("b0", 4, 2)]  # the rest of the 6 prompt tokens per decode step
    s.postprocess(out, [[]])
    out = s.schedule()
    assert plan(out) == decodes and s.split_steps == 3  # then the decodes alone
    s.postprocess(out, [[7]] * 3)
    out = s.schedule()
    assert plan(out) == [("b0", 6, 4)] and s.split_steps == 4
    # off: the decodes and up to step_tokens prompt tokens in every step
    s, _ = fair_mk(step_tokens=8, budget=32, max_seqs=8)
    for i in range(3):
        s.add(of("a", f"a{i}", 4, 10 * i, params=long))
    s.postprocess(s.schedule(), [[7]] * 3)
    s.add(of("b", "b0", 20, 100))
    assert plan(s.schedule()) == decodes + [("b0", 0, 8)] and s.split_steps == 0


def test_split_steps_need_both_kinds_of_work_and_fall_back_to_the_decodes():
    # two tenants' prompts and no decode: nothing to split, the capped step as without it
    s, _ = fair_mk(step_tokens=8, budget=32, max_seqs=8, slice_tokens=4)
    s.add(of("a", "a0", 20, 0))
    s.add(of("b", "b0", 20, 100))
    out = s.schedule()
    assert out.num_batched_tokens == 8 and s.split_steps == 0
    # a prompt step with nothing admissible (no KV block free) runs the decodes instead
    s, _ = fair_mk(step_tokens=8, budget=32, max_seqs=8, slice_tokens=4, num_blocks=1)
    long = SamplingParams(max_tokens=100, temperature=0.0)
    s.add(of("a", "a0", 3, 0, params=long))
    s.postprocess(s.schedule(), [[7]])
    s.add(of("b", "b0", 20, 100))
    assert plan(s.schedule()) == [("a0", 3, 1)] and s.split_steps == 0


def test_split_steps_fallback_never_runs_a_sequence_it_preempted():
    """The fallback to the decodes preempts for KV like any step: a victim (swapped out, so it
    still looks like a decode) is not scheduled after it left the running list."""
    from shared.engine.fair_queue import FairQueue
    from shared.engine.scheduler import FairShare

    bm = BlockManager(3, 4)
    share = FairShare(8, 5.0, Clock(), False, 4)
    s = Scheduler(bm, SALT, 8, 32, True, "swap", [99], FairQueue(True), share)
    long = SamplingParams(max_tokens=100, temperature=0.0)
    a0, a1 = of("a", "a0", 4, 0, params=long), of("a", "a1", 2, 10, params=long)
    a2 = of("a", "a2", 4, 20, params=long)
    for x in (a0, a1, a2):
        s.add(x)
    s.postprocess(s.schedule(), [[7]] * 3)  # one block each, none free
    s.add(of("b", "b0", 4, 100))  # contended; b0 cannot be admitted: no block
    out = s.schedule()
    # a0 needs a block and takes a2's (the worst); a1 has room in its own
    assert plan(out) == [("a0", 4, 1), ("a1", 2, 1)]
    assert [x.request_id for x in out.preempted] == ["a2"] and a2.status == SequenceStatus.SWAPPED
