"""Gateway metrics with vLLM-like names (``vllm:`` -> ``strata:``)."""

from __future__ import annotations

import weakref

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

TTFT = Histogram("strata:time_to_first_token_seconds", "Arrival to first token", buckets=_LAT)
ITL = Histogram("strata:inter_token_latency_seconds", "Gap between streamed tokens", buckets=_ITL)
TPOT = Histogram(
    "strata:time_per_output_token_seconds", "Decode time / output tokens", buckets=_ITL
)
E2E = Histogram("strata:e2e_request_latency_seconds", "Arrival to last token", buckets=_LAT)
QUEUE = Histogram(
    "strata:request_queue_time_seconds", "Arrival to submit (tokenize, encode, route)", buckets=_LAT
)
TOKENIZE = Histogram("strata:tokenize_seconds", "Tokenizer round trip", buckets=_LAT)
VISION = Histogram("strata:vision_encode_seconds", "Vision encode round trip", buckets=_LAT)
EPD_OVERLAP = Histogram(
    "strata:epd_overlap_seconds", "Time tokenize and encode ran together", buckets=_LAT
)
RUNNING = Gauge("strata:num_requests_running", "Streams past their first token")
WAITING = Gauge("strata:num_requests_waiting", "Requests before their first token")
PROMPT_TOKENS = Counter("strata:prompt_tokens", "Prompt tokens of finished requests")
GENERATION_TOKENS = Counter("strata:generation_tokens", "Generated tokens")
CACHED_TOKENS = Counter("strata:prompt_tokens_cached", "Prompt tokens served from cache")
REQUESTS = Counter("strata:request_success", "Finished requests", ["finished_reason"])
HTTP = Counter("strata:http_requests", "HTTP requests by route and status", ["route", "status"])
FAILOVERS = Counter("strata:stream_failovers", "Streams re-routed to another instance", ["why"])
STALLS_WAITED = Counter(
    "strata:stream_stalls_waited",
    "Silent streams kept waiting: a probe found the request still worked on (not a failover)",
)
TENANT_REQUESTS = Counter(
    "strata_tenant_requests",
    "Requests admitted by the gateway, by tenant (API key name)",
    ["tenant"],
)
CANCELS = Counter("strata:request_cancelled", "Requests cancelled (client gone)")
NATS_API_REFUSED = Counter(
    "strata:nats_api_refused",
    "NATS API operations refused for naming another client's request or inbox",
    ["op"],
)


class _StreamsByInstance:
    """``strata_gateway_streams_by_instance{instance}``: the streams each instance serves right
    now, as this gateway routed them (a stream counts at its decode and at its prefill
    instance until it ends). Read from the live pipelines at scrape time, so it is exact where
    the engines' own gauges lag a load interval: what an operator checks before taking an
    instance down, and what the fault tests pick their victim by."""

    def __init__(self) -> None:
        self.pipelines: weakref.WeakSet = weakref.WeakSet()

    def collect(self):
        fam = GaugeMetricFamily(
            "strata_gateway_streams_by_instance",
            "Streams this gateway has routed to each instance that have not ended",
            labels=["instance"],
        )
        counts: dict[str, int] = {}
        for p in list(self.pipelines):
            for inst, n in p.streams_by_instance().items():
                counts[inst] = counts.get(inst, 0) + n
        for inst in sorted(counts):
            fam.add_metric([inst], counts[inst])
        yield fam


STREAMS_BY_INSTANCE = _StreamsByInstance()
REGISTRY.register(STREAMS_BY_INSTANCE)
