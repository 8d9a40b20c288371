"""Scheduler rules that the service (`core.py`) and the simulator (`loadtests/simulator/sim.py`)
both run, so the two cannot drift apart:

- `request_view`: a routing request as the policies see it, from the prefix index's match;
- `reuse_plan` / `predicted_ttft`: what an instance would reuse of a prompt (its own prefix,
  then the pool's continuation after it, `shared.kvcache_rules`) and the TTFT that gives;
- `apply_kv_event`: a KV event into the index, and the instance's cache footprint
  (`InstanceView.cached_blocks`) kept in step;
- `expect_routed`: what the index expects after a route (the prompt's blocks counted as held by
  the instance it went to until their "stored" event or the TTL).
"""

from __future__ import annotations

from collections.abc import Sequence

from services.scheduler.prefix_index import IndexMatch, PrefixIndex
from services.scheduler.types import CostModel, InstanceView, RequestView
from shared.kvcache_rules import ReusePlan, plan_reuse
from shared.protocol.kv import KVEvent


def request_view(
    request_id: str,
    num_prompt_tokens: int,
    match: IndexMatch | None,
    block_tokens: int,
    ttft_slo_s: float,
    *,
    priority: int = 0,
    slo_class: str = "interactive",
    max_tokens: int = 16,
    exclude: frozenset[str] = frozenset(),
) -> RequestView:
    """The `RequestView` of a prompt whose block hashes matched ``match`` in the index."""
    bt = block_tokens
    return RequestView(
        request_id=request_id,
        num_prompt_tokens=num_prompt_tokens,
        priority=priority,
        slo_class=slo_class,
        max_tokens=max_tokens,
        ttft_slo_s=ttft_slo_s,
        exclude=exclude,
        cached_tokens={i: n * bt for i, n in match.engine_blocks.items()} if match else {},
        pool_dram_tokens=match.pool_dram_blocks * bt if match else 0,
        pool_ssd_tokens=match.pool_ssd_blocks * bt if match else 0,
        pool_tiers=tuple(match.pool_tiers) if match else (),
        block_tokens=bt,
    )


def reuse_plan(request: RequestView, local_tokens: int, rate: float, cost: CostModel) -> ReusePlan:
    """What an instance prefilling at ``rate`` tokens/s that holds ``local_tokens`` of the
    prompt in its engine cache reuses: that prefix, then the pool blocks worth loading after
    it (load time per tier from ``cost``)."""
    bt = request.block_tokens
    return plan_reuse(
        local_tokens // bt, request.pool_tiers, bt / rate, lambda tier: bt / cost.tier_rate(tier)
    )


def predicted_ttft(request: RequestView, inst: InstanceView, cost: CostModel) -> tuple[float, int]:
    """(TTFT estimate, cached tokens) for prefilling ``request`` on ``inst``: queue time +
    uncached tokens at the instance's rate + load time of the pool blocks it would load."""
    n = request.num_prompt_tokens
    local = min(request.cached_tokens.get(inst.instance_id, 0), n)
    rate = cost.prefill_rate(inst)
    plan = reuse_plan(request, local, rate, cost)
    cached = plan.cached_tokens(n, request.block_tokens, local)
    return cost.queue_s(inst) + (n - cached) / rate + plan.load_s, cached


def apply_kv_event(index: PrefixIndex, ev: KVEvent, view: InstanceView | None) -> bool:
    """Apply ``ev`` to ``index``; ``view`` (the event's instance, if it is a member) gets its
    cache footprint updated. Returns False for a stale or duplicate event."""
    ok = index.apply(ev)
    if ok and view is not None:
        view.cached_blocks = index.blocks_of(ev.instance_id)
    return ok


def expect_routed(
    index: PrefixIndex, instance_id: str, hashes: Sequence[str], now: float, ttl_s: float
) -> None:
    """A prompt was routed to ``instance_id`` (the instance that prefills it): its blocks count
    as held there for ``ttl_s`` (its "stored" event comes only once the prompt is computed)."""
    if hashes and ttl_s > 0:
        index.expect(instance_id, list(hashes), now + ttl_s)
