"""Prometheus metrics shared by every service, and the /metrics HTTP endpoint.

Engine-level names follow vLLM's (``vllm:`` -> ``strata:``) where they mean the same thing.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from shared.service import StartupError

HANDLER_REQUESTS = Counter(
    "strata_handler_requests_total", "Bus requests handled", ["subject", "status"]
)
HANDLER_LATENCY = Histogram(
    "strata_handler_latency_seconds",
    "Bus handler latency",
    ["subject"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
)
BAD_MESSAGES = Counter(
    "strata_bad_messages",
    "Bus requests dropped because they do not decode (per subscription)",
    ["subject"],
)
SERVICE_INFO = Gauge("strata_service_up", "1 while the service runs", ["role", "instance"])

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def latency_histogram(name: str, doc: str, labels: tuple[str, ...] = ()) -> Histogram:
    return Histogram(name, doc, list(labels), buckets=_LATENCY_BUCKETS)


def serve_metrics(port: int, host: str = "127.0.0.1") -> None:
    """Expose /metrics on ``host``:``port`` (0 disables; pass the service's own bind address,
    see `ServiceConfig.metrics_bind`); a busy port is a `StartupError`."""
    if port:
        try:
            start_http_server(port, addr=host)
        except OSError as exc:
            raise StartupError(
                f"metrics port {port} cannot be bound ({exc.strerror or exc}); "
                "set STRATA_METRICS_PORT (--metrics-port) to a free port or 0"
            ) from exc
