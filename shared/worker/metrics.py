"""Engine metrics of a prefill / decode instance (names follow vLLM's ``vllm:`` ones).

Updated from `EngineStats` at every load report, labelled by role and instance so one Grafana
panel can show the whole cluster.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_L = ("role", "instance")
KV_USAGE = Gauge("strata:kv_cache_usage_perc", "Engine KV blocks in use (0-1)", _L)
KV_BLOCKS_FREE = Gauge("strata:kv_cache_free_blocks", "Engine KV blocks free", _L)
KV_BLOCKS_TOTAL = Gauge("strata:kv_cache_total_blocks", "Engine KV blocks in the cache", _L)
KV_BLOCKS_CACHED = Gauge(
    "strata:kv_cache_cached_blocks",
    "Engine KV blocks holding a prefix-cached block (in use or evictable); equal to the total "
    "once the cache has filled",
    _L,
)
ENGINE_RUNNING = Gauge("strata:engine_num_requests_running", "Sequences in the running batch", _L)
ENGINE_WAITING = Gauge("strata:engine_num_requests_waiting", "Sequences waiting or swapped", _L)
PREFIX_QUERIES = Counter(
    "strata:prefix_cache_queries", "Prompt tokens looked up in the engine prefix cache", _L
)
PREFIX_HITS = Counter(
    "strata:prefix_cache_hits", "Prompt tokens found in the engine prefix cache", _L
)
PREEMPTIONS = Counter("strata:num_preemptions", "Sequences preempted for KV or priority", _L)
SHARE_PREEMPTIONS = Counter(
    "strata_fair_share_preemptions",
    "Running sequences preempted so a tenant under its weighted share of the batch got a slot",
    _L,
)
CONTENDED_STEPS = Counter(
    "strata_fair_contended_steps",
    "Engine steps whose token budget was capped because two or more tenants contended",
    _L,
)
SPLIT_STEPS = Counter(
    "strata_fair_split_steps",
    "Engine steps that ran only prompt chunks or only decodes because tenants contended "
    "(STRATA_FAIR_SLICE_TOKENS)",
    _L,
)
STEPS = Counter("strata:engine_steps", "Engine steps taken (schedule, forward, sample)", _L)
STEP_SECONDS = Histogram(
    "strata:engine_step_seconds",
    "Seconds of each engine step that ran a batch (schedule, forward, sample); what a request "
    "arriving mid-step waits before it can be scheduled",
    _L,
    buckets=(0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5, 10),
)
SPEC_DRAFTS = Counter(
    "strata:spec_decode_num_draft_tokens", "Draft tokens proposed (speculative decoding)", _L
)
SPEC_ACCEPTED = Counter(
    "strata:spec_decode_num_accepted_tokens",
    "Draft tokens the target model accepted (speculative decoding)",
    _L,
)
POOL_RECORDED = Counter(
    "strata_kv_pool_recorded_blocks",
    "Blocks the engine's save policy (kv_pool_save) recorded for the KV pool, by reason: "
    "computed (policy all), reused (a second request used it), returned (computed again after "
    "leaving memory unsaved), flush (a graceful stop)",
    (*_L, "reason"),
)
EXTERNAL_BLOCKS = Counter(
    "strata_kv_external_blocks",
    "Pool blocks a request brought to the engine (ExternalKV), by outcome at its admission: "
    "used (taken in like a prefix hit) or skipped (held by then, or not continuing the local "
    "prefix)",
    (*_L, "outcome"),
)
_T = (*_L, "tenant")
TENANT_ADMITTED = Counter(
    "strata_tenant_admitted", "Requests taken from the engine's waiting queue, by tenant", _T
)
TENANT_QUEUE_WAIT = Histogram(
    "strata_tenant_queue_wait_seconds",
    "Seconds a request waited in the engine's queue before its first admission, by tenant",
    _T,
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)


class EngineMetrics:
    """Turns cumulative `EngineStats` counters into Prometheus counter increments."""

    def __init__(self, role: str, instance: str):
        self.labels = (role, instance)
        self._last = {"q": 0, "h": 0, "p": 0, "s": 0, "f": 0, "c": 0, "x": 0, "d": 0, "a": 0}

    def update(self, s) -> None:
        lab = self.labels
        KV_USAGE.labels(*lab).set(s.kv_usage)
        KV_BLOCKS_FREE.labels(*lab).set(s.kv_blocks_free)
        KV_BLOCKS_TOTAL.labels(*lab).set(s.kv_blocks_total)
        KV_BLOCKS_CACHED.labels(*lab).set(s.kv_blocks_cached)
        ENGINE_RUNNING.labels(*lab).set(s.running)
        ENGINE_WAITING.labels(*lab).set(s.waiting)
        for key, counter, value in (
            ("q", PREFIX_QUERIES, s.prefix_query_tokens),
            ("h", PREFIX_HITS, s.prefix_hit_tokens),
            ("p", PREEMPTIONS, s.preemptions),
            ("s", STEPS, s.steps),
            ("f", SHARE_PREEMPTIONS, s.share_preemptions),
            ("c", CONTENDED_STEPS, s.contended_steps),
            ("x", SPLIT_STEPS, s.split_steps),
            ("d", SPEC_DRAFTS, s.spec_draft_tokens),
            ("a", SPEC_ACCEPTED, s.spec_accepted_tokens),
        ):
            delta = value - self._last[key]
            if delta > 0:
                counter.labels(*lab).inc(delta)
            self._last[key] = value
        for outcome, value in s.external_blocks.items():
            key = f"external:{outcome}"
            delta = value - self._last.get(key, 0)
            if delta > 0:
                EXTERNAL_BLOCKS.labels(*lab, outcome).inc(delta)
            self._last[key] = value
        for reason, value in s.pool_recorded.items():
            delta = value - self._last.get(reason, 0)
            if delta > 0:
                POOL_RECORDED.labels(*lab, reason).inc(delta)
            self._last[reason] = value

    def stepped(self, seconds: list[float]) -> None:
        """Observe engine step durations (`EnginePort.drain_step_times`)."""
        h = STEP_SECONDS.labels(*self.labels)
        for x in seconds:
            h.observe(x)

    def admitted(self, admissions: list[tuple[str, float]]) -> None:
        """Count first admissions ``(tenant, seconds queued)`` (`EnginePort.drain_admissions`)."""
        for tenant, wait in admissions:
            TENANT_ADMITTED.labels(*self.labels, tenant).inc()
            TENANT_QUEUE_WAIT.labels(*self.labels, tenant).observe(wait)
