"""Baselines: round robin and least loaded. Neither looks at the prefix index for its choice,
but both report the cached tokens and predicted TTFT of what they chose (for the simulator)."""

from __future__ import annotations

import numpy as np

from services.scheduler.rules import predicted_ttft
from services.scheduler.table import first_min, table_of
from services.scheduler.types import (
    ClusterState,
    CostModel,
    InstanceView,
    RequestView,
    RouteDecision,
)

__all__ = ["LeastLoaded", "RoundRobin", "decode_load", "predicted_ttft"]


def decode_load(inst: InstanceView, batch_norm: float = 64.0) -> float:
    """Load score of a decode instance: KV use plus running batch (0 = idle)."""
    return inst.kv_used_frac + inst.batch / batch_norm


class RoundRobin:
    """Cycle through prefill and decode instances (in id order) independently."""

    name = "round_robin"

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self._next = {"prefill": 0, "decode": 0}

    def _pick(self, role: str, insts: list[InstanceView]) -> InstanceView:
        inst = insts[self._next[role] % len(insts)]
        self._next[role] += 1
        return inst

    def choose(self, request: RequestView, state: ClusterState) -> RouteDecision:
        dec = self._pick("decode", state.decode)
        target = self._pick("prefill", state.prefill) if state.prefill else dec
        ttft, cached = predicted_ttft(request, target, self.cost)
        return RouteDecision(
            decode_instance=dec.instance_id,
            prefill_instance=target.instance_id if state.prefill else "",
            cached_tokens=cached,
            predicted_ttft_s=ttft,
            reason="round_robin",
        )


class LeastLoaded:
    """Prefill: fewest queued prompt tokens (then batch, then id). Decode: lowest KV use plus
    running batch (then id)."""

    name = "least_loaded"

    def __init__(self, cost: CostModel, batch_norm: float = 64.0) -> None:
        self.cost = cost
        self.batch_norm = batch_norm

    def choose(self, request: RequestView, state: ClusterState) -> RouteDecision:
        dt = table_of(state.decode, state.decode_table)
        dec = state.decode[int(np.argmin(dt.decode_loads(self.batch_norm)))]  # first = lowest id
        if state.prefill:
            pt = table_of(state.prefill, state.prefill_table)
            queue_s = pt.queued / pt.prefill_rates(self.cost.prefill_tokens_per_s)
            pre = state.prefill[first_min(queue_s, pt.batch)]  # then batch, then id order
        else:
            pre = dec
        ttft, cached = predicted_ttft(request, pre, self.cost)
        return RouteDecision(
            decode_instance=dec.instance_id,
            prefill_instance=pre.instance_id if state.prefill else "",
            cached_tokens=cached,
            predicted_ttft_s=ttft,
            reason="least_loaded",
        )
