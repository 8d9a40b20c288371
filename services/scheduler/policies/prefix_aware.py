"""Prefix- and load-aware routing (the production policy).

Prefill: minimum estimated TTFT = queue time + uncached tokens x per-token prefill cost of that
instance + load time of pool-hit tokens by tier (see `basic.predicted_ttft`).
Decode: the instance holding most of the prompt's prefix (cache affinity), unless its load exceeds
the least loaded one by more than ``affinity_imbalance``; instances without room for the request's
KV are skipped while any other has room.
Conditional disaggregation: when the prompt left uncached on the chosen decode instance is shorter
than ``short_prompt_tokens`` and that instance is not busy, it prefills the prompt itself.
Length-aware: prompts of ``long_prompt_tokens`` or more go to prefill instances reserved for them
(``InstanceView.reserved_long``); other prompts avoid those instances while any other exists.
SLO early rejection: when even the best prediction breaks the request's TTFT SLO, reject with a
retry-after of the excess.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.policies.basic import decode_load, predicted_ttft
from services.scheduler.types import (
    ClusterState,
    CostModel,
    Decision,
    InstanceView,
    RequestView,
)


@dataclass(frozen=True)
class PrefixAwareOptions:
    """Knobs of `PrefixAware`.

    Fields:
        short_prompt_tokens: uncached prompt below this prefills on the decode instance itself.
        self_prefill_max_load: ... but only while that decode instance's load score is below this.
        long_prompt_tokens: prompts this long go to prefill instances reserved for long prompts.
        affinity_imbalance: keep decode cache affinity unless its load score exceeds the minimum
            by more than this.
        batch_norm: running sequences that count as a load score of 1.0 on a decode instance.
        slo_reject: reject early when the predicted TTFT breaks the request's SLO.
        min_retry_after_s: floor of the retry-after of a rejection.
    """

    short_prompt_tokens: int = 512
    self_prefill_max_load: float = 0.5
    long_prompt_tokens: int = 32768
    affinity_imbalance: float = 0.25
    batch_norm: float = 64.0
    slo_reject: bool = True
    min_retry_after_s: float = 1.0


class PrefixAware:
    name = "prefix_aware"

    def __init__(self, cost: CostModel, **options) -> None:
        self.cost = cost
        self.opt = PrefixAwareOptions(**options)

    # --- decode -------------------------------------------------------------------------------
    def choose_decode(self, request: RequestView, decode: list[InstanceView]) -> InstanceView:
        least, least_load, affine, affine_load = self._scan_decode(request, decode, True)
        if least is None:  # nobody has room for the request's KV: choose among all
            least, least_load, affine, affine_load = self._scan_decode(request, decode, False)
        if affine is None or affine_load - least_load > self.opt.affinity_imbalance:
            return least
        return affine

    def _scan_decode(self, request: RequestView, decode: list[InstanceView], need_room: bool):
        """One pass: (least loaded, its load, most-cached (then least loaded), its load)."""
        total = request.num_prompt_tokens + request.max_tokens
        bn, cached = self.opt.batch_norm, request.cached_tokens
        least = affine = None
        least_load = 0.0
        affine_key = (0, 0.0)
        for d in decode:  # ids ascend: on ties the first one wins
            if need_room and d.kv_blocks_total > 0 and d.kv_blocks_free * d.block_size < total:
                continue
            load = decode_load(d, bn)
            if least is None or load < least_load:
                least, least_load = d, load
            hit = cached.get(d.instance_id, 0)
            if hit > 0 and (affine is None or (-hit, load) < affine_key):
                affine, affine_key = d, (-hit, load)
        return least, least_load, affine, affine_key[1]

    # --- prefill ------------------------------------------------------------------------------
    def prefill_candidates(self, request: RequestView, prefill: list[InstanceView]):
        reserved = [p for p in prefill if p.reserved_long]
        normal = [p for p in prefill if not p.reserved_long]
        if request.num_prompt_tokens >= self.opt.long_prompt_tokens:
            return reserved or normal
        return normal or reserved

    def choose(self, request: RequestView, state: ClusterState) -> Decision:
        dec = self.choose_decode(request, state.decode)
        self_ttft, self_cached = predicted_ttft(request, dec, self.cost)
        uncached_on_decode = request.num_prompt_tokens - self_cached
        if not state.prefill or (
            uncached_on_decode < self.opt.short_prompt_tokens
            and decode_load(dec, self.opt.batch_norm) < self.opt.self_prefill_max_load
        ):
            why = "no prefill instance" if not state.prefill else "short uncached prompt"
            return self._admit(
                request,
                Decision(
                    decode_instance=dec.instance_id,
                    cached_tokens=self_cached,
                    predicted_ttft_s=self_ttft,
                    reason=f"decode prefills: {why}",
                ),
            )
        best: tuple[float, int, str] | None = None
        best_inst = None
        for p in self.prefill_candidates(request, state.prefill):
            ttft, cached = predicted_ttft(request, p, self.cost)
            key = (ttft, -cached, p.instance_id)
            if best is None or key < best:
                best, best_inst = key, p
        assert best is not None and best_inst is not None
        return self._admit(
            request,
            Decision(
                decode_instance=dec.instance_id,
                prefill_instance=best_inst.instance_id,
                cached_tokens=-best[1],
                predicted_ttft_s=best[0],
                reason="min predicted ttft",
            ),
        )

    def _admit(self, request: RequestView, d: Decision) -> Decision:
        slo = request.ttft_slo_s
        if self.opt.slo_reject and slo > 0 and d.predicted_ttft_s > slo:
            retry = max(self.opt.min_retry_after_s, d.predicted_ttft_s - slo)
            return Decision(
                decode_instance=d.decode_instance,
                prefill_instance=d.prefill_instance,
                cached_tokens=d.cached_tokens,
                predicted_ttft_s=d.predicted_ttft_s,
                reject=True,
                retry_after_s=retry,
                reason=f"predicted ttft {d.predicted_ttft_s:.3f}s > slo {slo:.3f}s",
            )
        return d
