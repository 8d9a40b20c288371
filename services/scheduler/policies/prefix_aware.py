"""Prefix- and load-aware routing (the production policy).

Prefill: a prompt whose prefix some candidate holds (at least ``cache_match_min`` of it) goes to
the holder with the most of it cached, as long as that holder's queue is within the load bound:
at most ``affinity_slack_s`` above the shortest queue or ``affinity_load_bound`` x the mean queue
(consistent hashing with bounded loads, as SGLang's router keeps cache affinity until the
imbalance passes its thresholds). A holder past the bound loses the prompt to the minimum
estimated TTFT = queue time + uncached tokens x per-token prefill cost of that instance + load
time of the pool blocks it would load after its own prefix (`rules.predicted_ttft`), so a hot
prefix is copied to another instance only when its holders are overloaded, and every copy then
shares its traffic. When no candidate
holds at least ``cache_match_min`` of the prompt in its engine cache, the prompt costs about the
same anywhere, so among the candidates whose queue is within ``balance_slack_s`` of the shortest
it goes to the one with the smallest cache footprint (then the lowest TTFT): new prefixes spread
over the fleet's caches instead of piling onto the fastest instance and evicting each other (the
rule SGLang's cache-aware router uses). All of it is a few numpy operations over `RoleTable`
columns plus a Python step per instance that holds the prefix.
Decode: the instance holding most of the prompt's prefix (cache affinity), unless its load exceeds
the least loaded one by more than ``affinity_imbalance``; instances without room for the request's
KV are skipped while any other has room. With no prefill fleet (the colocated shape) the decode
instance prefills the prompt itself, so the prefill rule above places it over the decode
instances with room for its KV.
Per-request disaggregation: the chosen decode instance prefills the prompt itself when it is not
busy and either the prompt left uncached there is shorter than ``short_prompt_tokens`` (cheap
enough to run beside its decodes) or the remote path's predicted time to a continuing stream (the
best prefill instance's TTFT plus pushing the prompt's KV to decode) exceeds the decode instance's own predicted
TTFT by more than the time that prefill would take the decode instance away from its streams
(its uncached tokens at decode's measured prefill rate; an instance that reports none is not
moved to by this rule): a congested prefill fleet, or a prefix decode
already holds, keeps the prompt on decode; otherwise it is disaggregated. The reason is
`RouteDecision.path` (`PREFILL_PATHS`), counted by the scheduler per route.
Length-aware: prompts of ``long_prompt_tokens`` or more go to prefill instances reserved for them
(``InstanceView.reserved_long``); other prompts avoid those instances while any other exists.
SLO early rejection: when even the best prediction breaks the request's TTFT SLO, reject with a
retry-after of the excess.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.scheduler.rules import predicted_ttft, reuse_plan
from services.scheduler.table import RoleTable, first_min, table_of
from services.scheduler.types import (
    ClusterState,
    CostModel,
    InstanceView,
    RequestView,
    RouteDecision,
)

PREFILL_PATHS = {
    "no_prefill": "no prefill instance: decode prefills",
    "short_uncached": "decode prefills: short uncached prompt",
    "decode_faster": "decode prefills: remote TTFT worse by more than the decode time it costs",
    "decode_busy": "disaggregated: decode instance busy",
    "remote": "disaggregated: remote prefill predicted no worse, counting decode's time",
}
"""`RouteDecision.path` values of `PrefixAware` and what each means."""


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
        cache_match_min: engine-cache hit (fraction of the prompt) below which a prompt counts
            as new and goes to the least-filled cache instead of the minimum TTFT.
        balance_slack_s: queue seconds above the shortest queue still counted as "not busier"
            when placing a new prompt.
        affinity_load_bound: a cache holder keeps a prompt while its queue is at most this
            times the candidates' mean queue (or within ``affinity_slack_s`` of the shortest);
            0 = no affinity rule (minimum predicted TTFT only).
        affinity_slack_s: queue seconds above the shortest queue a cache holder may have and
            still keep the prompt (the bound's floor at light load).
    """

    short_prompt_tokens: int = 512
    self_prefill_max_load: float = 0.5
    long_prompt_tokens: int = 32768
    affinity_imbalance: float = 0.25
    batch_norm: float = 64.0
    slo_reject: bool = True
    min_retry_after_s: float = 1.0
    cache_match_min: float = 0.25
    balance_slack_s: float = 0.05
    affinity_load_bound: float = 1.5
    affinity_slack_s: float = 4.0


class PrefixAware:
    name = "prefix_aware"

    def __init__(self, cost: CostModel, **options) -> None:
        self.cost = cost
        self.opt = PrefixAwareOptions(**options)
        self.last_reason = ""

    # --- decode -------------------------------------------------------------------------------
    def choose_decode(
        self, request: RequestView, decode: list[InstanceView], table: RoleTable | None = None
    ) -> tuple[InstanceView, float]:
        """(decode instance, its load score)."""
        t = table_of(decode, table)
        load = t.decode_loads(self.opt.batch_norm)
        total = request.num_prompt_tokens + request.max_tokens
        room = (t.kv_total <= 0) | (t.kv_free_tokens >= total)
        if not room.any():  # nobody has room for the request's KV: choose among all
            room[:] = True
        masked = np.where(room, load, np.inf)
        least = int(np.argmin(masked))  # ties: the first (lowest id)
        affine, affine_key = -1, None
        for inst, hit in request.cached_tokens.items():  # only instances holding the prefix
            i = t.pos.get(inst)
            if i is None or hit <= 0 or not room[i]:
                continue
            key = (-hit, load[i], inst)
            if affine_key is None or key < affine_key:
                affine, affine_key = i, key
        if affine < 0 or load[affine] - masked[least] > self.opt.affinity_imbalance:
            return decode[least], float(masked[least])
        return decode[affine], float(load[affine])

    # --- prefill ------------------------------------------------------------------------------
    def _candidates(self, request: RequestView, t: RoleTable) -> np.ndarray:
        """Length-aware mask: long prompts to reserved instances, others avoid them."""
        reserved = t.reserved
        want = reserved if request.num_prompt_tokens >= self.opt.long_prompt_tokens else ~reserved
        return want if want.any() else np.ones(len(t), dtype=bool)

    def choose_prefill(
        self, request: RequestView, prefill: list[InstanceView], table: RoleTable | None = None
    ) -> tuple[InstanceView, float, int]:
        """(prefill instance, predicted TTFT, cached tokens)."""
        t = table_of(prefill, table)
        cand = self._candidates(request, t)
        n = request.num_prompt_tokens
        rate = t.prefill_rates(self.cost.prefill_tokens_per_s)
        queue_s = t.queued / rate
        # Instances without the prefix in their engine cache: only the pool can help (how much
        # of it is worth loading depends on the instance's rate: one plan per distinct rate).
        ttft = queue_s + n / rate
        cached = np.zeros(len(t), dtype=np.int64)
        if request.pool_tiers:
            for r in np.unique(rate):
                plan = reuse_plan(request, 0, float(r), self.cost)
                c = plan.cached_tokens(n, request.block_tokens)
                sel = rate == r
                ttft[sel] = queue_s[sel] + (n - c) / r + plan.load_s
                cached[sel] = c
        best_hit = 0
        holders = []
        for inst, hit in request.cached_tokens.items():
            i = t.pos.get(inst)
            if i is None or not cand[i] or hit <= 0:
                continue
            ttft[i], cached[i] = predicted_ttft(request, t.views[i], self.cost)
            best_hit = max(best_hit, min(hit, n))
            holders.append(i)
        ttft = np.where(cand, ttft, np.inf)
        hit_min = self.opt.cache_match_min * n
        if best_hit >= hit_min and self.opt.affinity_load_bound > 0:
            qc = queue_s[cand]
            cap = max(
                qc.min() + self.opt.affinity_slack_s,
                self.opt.affinity_load_bound * float(qc.mean()),
            )
            ok = [i for i in holders if queue_s[i] <= cap and cached[i] >= hit_min]
            if ok:
                i = min(ok, key=lambda j: (-cached[j], ttft[j], j))
                self.last_reason = "cache holder within the load bound"
                return prefill[i], float(ttft[i]), int(cached[i])
        if best_hit >= hit_min:
            best = float(ttft.min())
            ties = np.flatnonzero(ttft == best)
            i = int(ties[np.argmax(cached[ties])])  # then most cached, then lowest id
            self.last_reason = "min predicted ttft"
        else:
            self.last_reason = "new prompt: least-filled cache"
            near = np.flatnonzero(
                cand & (queue_s <= queue_s[cand].min() + self.opt.balance_slack_s)
            )
            i = int(near[first_min(t.cached_blocks[near], ttft[near])])  # footprint, then TTFT
        return prefill[i], float(ttft[i]), int(cached[i])

    def choose(self, request: RequestView, state: ClusterState) -> RouteDecision:
        if not state.prefill:
            return self._colocated(request, state)
        dec, dec_load = self.choose_decode(request, state.decode, state.decode_table)
        self_ttft, self_cached = predicted_ttft(request, dec, self.cost)
        uncached_on_decode = request.num_prompt_tokens - self_cached

        def on_decode(path: str) -> RouteDecision:
            return self._admit(
                request,
                RouteDecision(
                    decode_instance=dec.instance_id,
                    cached_tokens=self_cached,
                    predicted_ttft_s=self_ttft,
                    reason=PREFILL_PATHS[path],
                    path=path,
                ),
            )

        if not state.prefill:
            return on_decode("no_prefill")
        busy = dec_load >= self.opt.self_prefill_max_load
        if not busy and uncached_on_decode < self.opt.short_prompt_tokens:
            return on_decode("short_uncached")
        pre, ttft, cached = self.choose_prefill(request, state.prefill, state.prefill_table)
        # prefill emits the first token itself; its KV then moves to decode before the second
        transfer_s = request.num_prompt_tokens / self.cost.transfer_tokens_per_s
        decode_time = uncached_on_decode / self.cost.prefill_rate(dec)
        measured = dec.prefill_tokens_per_s > 0  # a guessed decode rate moves no long prompt
        if measured and not busy and ttft + transfer_s - self_ttft > decode_time:
            return on_decode("decode_faster")
        path = "decode_busy" if busy else "remote"
        return self._admit(
            request,
            RouteDecision(
                decode_instance=dec.instance_id,
                prefill_instance=pre.instance_id,
                cached_tokens=cached,
                predicted_ttft_s=ttft,
                reason=self.last_reason,
                path=path,
            ),
        )

    def _colocated(self, request: RequestView, state: ClusterState) -> RouteDecision:
        """No prefill fleet: the decode instance prefills the prompt itself, so the prefill
        rule places it over the decode instances with room for its KV (cache affinity bounded
        by the prefill queue, a prompt with less than ``cache_match_min`` of it cached anywhere
        to the least-filled cache among the least queued). The decode rule's affinity (any
        cached block, kept until 16 more sequences than the least loaded) let one shared first
        block pin a whole trace's traffic to one instance (`loadtests.simulator.realreplay`)."""
        t = table_of(state.decode, state.decode_table)
        room = (t.kv_total <= 0) | (
            t.kv_free_tokens >= request.num_prompt_tokens + request.max_tokens
        )
        views = [v for v, ok in zip(state.decode, room, strict=True) if ok] or state.decode
        dec, ttft, cached = self.choose_prefill(
            request, views, t if len(views) == len(state.decode) else None
        )
        return self._admit(
            request,
            RouteDecision(
                decode_instance=dec.instance_id,
                cached_tokens=cached,
                predicted_ttft_s=ttft,
                reason=f"{PREFILL_PATHS['no_prefill']} ({self.last_reason})",
                path="no_prefill",
            ),
        )

    def _admit(self, request: RequestView, d: RouteDecision) -> RouteDecision:
        slo = request.ttft_slo_s
        if self.opt.slo_reject and slo > 0 and d.predicted_ttft_s > slo:
            retry = max(self.opt.min_retry_after_s, d.predicted_ttft_s - slo)
            return RouteDecision(
                decode_instance=d.decode_instance,
                prefill_instance=d.prefill_instance,
                cached_tokens=d.cached_tokens,
                predicted_ttft_s=d.predicted_ttft_s,
                reject=True,
                retry_after_s=retry,
                reason=f"predicted ttft {d.predicted_ttft_s:.3f}s > slo {slo:.3f}s",
                path=d.path,
            )
        return d
