"""Discrete-event simulation of N prefill + M decode instances running the real policy classes.

Per request: route (the policy's `choose()` on live `InstanceView`s, in id order as the service
lists them, and the real `PrefixIndex`; the request view, the index's expectations after a route
and the cache footprints come from `services.scheduler.rules`, the functions `SchedulerCore`
runs), prefill on the chosen instance (FIFO; reuses its engine cache, then the pool's
continuation after it, by `shared.kvcache_rules`, the prefill worker's rule; TTFT = end of
prefill), then decode on the chosen instance (admitted when batch slot + KV fit; finish time from
the step cost at the batch size it joins). Caches announce stored/removed blocks as KV events.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass

from loadtests.simulator.cluster import LRU, Announcer, Job, Pool, SimConfig, SimInstance
from loadtests.simulator.trace import TraceRequest
from services.scheduler.policies import Policy
from services.scheduler.prefix_index import PrefixIndex
from services.scheduler.rules import apply_kv_event, expect_routed, request_view
from services.scheduler.types import ClusterState, InstanceView, RequestView, RouteDecision
from shared.kvcache_rules import plan_reuse
from shared.protocol.kv import KVEvent


@dataclass
class SimResult:
    policy: str
    requests: int
    rejected: int
    hit_rate: float  # prompt tokens reused from the prefilling instance's own engine cache
    pool_hit_rate: float  # prompt tokens loaded from the pool (after the local prefix)
    load_max_over_mean: float  # max / mean of prompt tokens computed per prefill instance
    ttft_p50: float
    ttft_p99: float
    slo_attainment: float  # TTFT <= SLO, over all requests (a rejection is a miss)
    throughput_tok_s: float  # output tokens / makespan
    req_per_s: float
    self_prefill_frac: float
    decision_p99_us: float
    ttfts: list[float]


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


class Simulation:
    def __init__(self, cfg: SimConfig, policy: Policy) -> None:
        self.cfg, self.policy = cfg, policy
        self.index = PrefixIndex()
        self.pool = Pool(cfg, self.on_kv_event)
        self.events: list = []
        self._n = 0
        prefill = [
            self._inst(f"p{i}", "prefill", i >= cfg.num_prefill - cfg.num_long)
            for i in range(cfg.num_prefill)
        ]
        decode = [self._inst(f"d{i}", "decode", False) for i in range(cfg.num_decode)]
        for i, x in enumerate(prefill + decode):  # reports spread over the period, as in a fleet
            x.next_report = cfg.load_interval_s * i / max(1, len(prefill) + len(decode))
        # in id order, as `Membership.live` lists them (ties and round robin depend on it)
        self.prefill = sorted(prefill, key=lambda x: x.view.instance_id)
        self.decode = sorted(decode, key=lambda x: x.view.instance_id)
        self.by_id = {x.view.instance_id: x for x in self.prefill + self.decode}
        self.done: list[Job] = []
        self.rejected = 0
        self.self_prefills = 0
        self.decision_s: list[float] = []
        # instances taken out of routing (AutoPD flips, autoscaling retirements): ids
        self.draining: set[str] | dict[str, float] = set()

    def _inst(self, iid: str, role: str, long: bool) -> SimInstance:
        c = self.cfg
        view = InstanceView(
            iid,
            role,
            prefill_tokens_per_s=c.prefill_tokens_per_s,
            block_size=c.block_tokens,
            reserved_long=long,
        )
        return SimInstance(
            view,
            LRU(c.engine_cache_blocks),
            Announcer(iid, self.on_kv_event),
            c.prefill_tokens_per_s,
        )

    def on_kv_event(self, ev: KVEvent) -> bool:
        """Every cache change, as the scheduler applies it (index + the instance's footprint)."""
        inst = self.by_id.get(ev.instance_id)
        return apply_kv_event(self.index, ev, inst.view if inst is not None else None)

    def at(self, t: float, fn, *args) -> None:
        self._n += 1
        heapq.heappush(self.events, (t, self._n, fn, args))

    # --- run ------------------------------------------------------------------------------------
    def run(self, trace: list[TraceRequest]) -> SimResult:
        for i, r in enumerate(trace):
            job = Job(i, r.arrival_s / self.cfg.rate_scale, r.input_len, r.output_len, r.hashes)
            self.at(job.arrival, self.route, job)
        now = 0.0
        while self.events:
            now, _, fn, args = heapq.heappop(self.events)
            fn(now, *args)
        return self.result(len(trace), now)

    def route(self, now: float, job: Job) -> None:
        for x in self.prefill + self.decode:
            if x.report_due(now, self.cfg.load_interval_s):
                x.refresh(now, self.cfg.decode_kv_blocks if x.view.role == "decode" else 0)
        m = self.index.lookup(list(job.hashes), now)
        req = request_view(
            str(job.rid),
            job.input_len,
            m,
            self.cfg.block_tokens,
            self.cfg.ttft_slo_s,
            max_tokens=job.output_len,
        )
        d = self.decide(now, job, req)
        if d.reject:
            self.rejected += 1
            return
        job.decode = self.by_id[d.decode_instance]
        target = self.by_id[d.prefill_instance] if d.prefill_instance else job.decode
        self.self_prefills += not d.prefill_instance
        expect_routed(self.index, target.view.instance_id, job.hashes, now, self.cfg.expect_ttl_s)
        est = max(1, job.input_len - d.cached_tokens)
        # what the scheduler adds to the instances' last reports until their next ones
        target.view.pending_tokens += max(0, job.input_len - d.cached_tokens)
        target.view.pending_requests += 1
        if target is not job.decode:
            job.decode.view.pending_requests += 1
        target.queued_tokens += est
        target.queue.append((job, est))
        if target.busy_until <= now and len(target.queue) == 1:
            self.start_prefill(now, target)

    def decide(self, now: float, job: Job, req: RequestView) -> RouteDecision:
        """The policy's decision on the instances as their latest load reports show them."""
        pre = [x.view for x in self.prefill if x.view.instance_id not in self.draining]
        dec = [x.view for x in self.decode if x.view.instance_id not in self.draining]
        state = ClusterState(pre, dec, now)
        t0 = time.perf_counter()
        d = self.policy.choose(req, state)
        self.decision_s.append(time.perf_counter() - t0)
        return d

    # --- prefill --------------------------------------------------------------------------------
    def start_prefill(self, now: float, inst: SimInstance) -> None:
        job, est = inst.queue.popleft()
        inst.queued_tokens -= est
        c, bt = self.cfg, self.cfg.block_tokens
        local = inst.cache.prefix(job.hashes)
        rates = {"dram": c.dram_tokens_per_s, "ssd": c.ssd_tokens_per_s}
        tiers = self.pool.tiers(job.hashes) if c.pool_enabled else []
        plan = plan_reuse(local, tiers, bt / inst.rate, lambda t: bt / rates[t])
        for t in plan.pool_tiers:
            self.pool.hit_blocks[t] += 1
        job.cached_tokens = plan.cached_tokens(job.input_len, bt)
        job.local_tokens = min(job.cached_tokens, local * bt)
        job.uncached = job.input_len - job.cached_tokens
        inst.prefilled_tokens += job.uncached
        inst.busy_until = now + job.uncached / inst.rate + plan.load_s
        self.at(inst.busy_until, self.end_prefill, inst, job)

    def end_prefill(self, now: float, inst: SimInstance, job: Job) -> None:
        job.ttft = now - job.arrival
        self.store(inst, job.hashes)
        if self.cfg.pool_enabled and self.cfg.pool_write_through:
            self.pool.offer(list(job.hashes))
        if inst.queue:
            self.start_prefill(now, inst)
        dec = job.decode
        if dec is not inst:
            self.store(dec, job.hashes)  # the KV was pushed to the decode instance
        dec.decode_wait.append(job)
        self.admit_decode(now, dec)

    def store(self, inst: SimInstance, hashes) -> None:
        new, gone = inst.cache.add(hashes)
        inst.emit("engine", "stored", new)
        if gone:
            inst.emit("engine", "removed", gone)
            if self.cfg.pool_enabled:
                self.pool.offer(gone)  # evicted blocks are offered to the pool, not dropped

    # --- decode ---------------------------------------------------------------------------------
    def admit_decode(self, now: float, dec: SimInstance) -> None:
        c = self.cfg
        while dec.decode_wait and dec.running < c.decode_max_batch:
            job = dec.decode_wait[0]
            need = -(-(job.input_len + job.output_len) // c.block_tokens)
            if dec.kv_used + need > c.decode_kv_blocks and dec.running:
                break
            dec.decode_wait.popleft()
            dec.running += 1
            dec.kv_used += need
            self.hold(dec, need - len(job.hashes))
            step = c.decode_step_s + c.decode_step_per_seq_s * dec.running
            self.at(now + (job.output_len - 1) * step, self.end_decode, dec, job, need)

    def end_decode(self, now: float, dec: SimInstance, job: Job, need: int) -> None:
        dec.running -= 1
        dec.kv_used -= need
        self.hold(dec, len(job.hashes) - need)
        job.finish = now
        self.done.append(job)
        self.admit_decode(now, dec)

    def hold(self, inst: SimInstance, blocks: int) -> None:
        """``cache_holds_running``: a running sequence's own blocks (not in the cache) take
        ``blocks`` more (or, when it ends, fewer) of the instance's cache; the LRU evicts to
        fit at once, announcing what it dropped."""
        if not self.cfg.cache_holds_running:
            return
        inst.private_blocks += blocks
        inst.cache.capacity = max(0, self.cfg.engine_cache_blocks - inst.private_blocks)
        self.store(inst, ())

    # --- report ---------------------------------------------------------------------------------
    def result(self, n: int, end: float) -> SimResult:
        done = self.done
        ttfts = [j.ttft for j in done]
        prompt = sum(j.input_len for j in done) or 1
        first = min((j.arrival for j in done), default=0.0)
        span = max(1e-9, end - first)
        slo_ok = sum(1 for t in ttfts if t <= self.cfg.ttft_slo_s)
        local = sum(j.local_tokens for j in done)
        # the instances that prefill: the prefill fleet, or (colocated) the decode instances
        work = [x.prefilled_tokens for x in self.prefill or self.decode]
        mean = sum(work) / len(work) if work else 0.0
        return SimResult(
            policy=self.policy.name,
            requests=n,
            rejected=self.rejected,
            hit_rate=local / prompt,
            pool_hit_rate=(sum(j.cached_tokens for j in done) - local) / prompt,
            load_max_over_mean=max(work) / mean if mean else float("nan"),
            ttft_p50=pct(ttfts, 0.5),
            ttft_p99=pct(ttfts, 0.99),
            slo_attainment=slo_ok / n,
            throughput_tok_s=sum(j.output_len for j in done) / span,
            req_per_s=len(done) / span,
            self_prefill_frac=self.self_prefills / max(1, n - self.rejected),
            decision_p99_us=pct(self.decision_s, 0.99) * 1e6,
            ttfts=ttfts,
        )
