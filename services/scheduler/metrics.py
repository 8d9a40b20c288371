"""Prometheus metrics of the scheduler."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

DECISIONS = Counter("strata_scheduler_decisions_total", "Routing decisions", ["policy", "outcome"])
PREFILL_PATHS = Counter(
    "strata_scheduler_prefill_path_total",
    "Routed requests by where their prompt prefills and why (the policy's RouteDecision.path)",
    ["policy", "path"],
)
DECISION_LATENCY = Histogram(
    "strata_scheduler_decision_seconds",
    "Time to make one routing decision",
    ["policy"],
    buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1),
)
LIVE_INSTANCES = Gauge("strata_scheduler_live_instances", "Live instances", ["role"])
DOWN_INSTANCES = Gauge("strata_scheduler_down_instances", "Instances declared down")
DECLARED_DOWN = Counter(
    "strata_scheduler_declared_down", "Times an instance was declared down (missed load reports)"
)
PREFIX_INDEX_BLOCKS = Gauge(
    "strata_scheduler_prefix_index_blocks", "Distinct KV block hashes in the global prefix index"
)
DEGRADE_LEVEL = Gauge("strata_scheduler_degrade_level", "Degradation level (0..3)")
CLUSTER_LOAD = Gauge("strata_scheduler_cluster_load", "Cluster load driving degradation")
KV_EVENTS = Counter("strata_scheduler_kv_events_total", "KV events applied", ["status"])
BAD_MESSAGES = Counter(
    "strata_scheduler_bad_messages",
    "Messages dropped because they failed validation (KV events, load reports, requests), "
    "per subscription",
    ["subject"],
)
PREFIX_INDEX_DIGEST = Gauge(
    "strata_scheduler_prefix_index_digest",
    "Order-independent 48-bit digest of the prefix index contents (equal on replicas in sync)",
)
KV_EVENTS_REPLAYED = Gauge(
    "strata_scheduler_kv_events_replayed", "KV events applied by the start-up replay"
)
REPLAY_SECONDS = Gauge("strata_scheduler_replay_seconds", "Seconds the start-up replay took")
REGISTRY_WATCH_RETRIES = Counter(
    "strata_scheduler_registry_watch_retries_total",
    "Failed tries to make the registry watcher's consumer (no stream leader yet, a lost node, "
    "JetStream not answering); it keeps trying until it has one",
)
KV_EVENTS_REPLAY_GAPS = Counter(
    "strata_scheduler_kv_events_replay_gaps_total",
    "Start-up replays that had to begin at the stream's first sequence because the stream's "
    "limits had discarded events after the snapshot (or, without a snapshot, after seq 1)",
)
KV_EVENTS_MISSED = Gauge(
    "strata_scheduler_kv_events_missed",
    "Stream sequences the last start-up replay needed that were already discarded",
)
KV_EVENTS_PURGES = Counter(
    "strata_scheduler_kv_events_purges_total",
    "Purges of KV events a stored prefix-index snapshot covers (snapshot_purge)",
)
SNAPSHOT_BYTES = Gauge("strata_scheduler_snapshot_bytes", "Size of the last prefix-index snapshot")
SCALE_DECISIONS = Counter(
    "strata_scheduler_scale_decisions_total",
    "Autoscaling decisions this scheduler made: add (one more instance of the role) or retire "
    "(an instance drains, then exits) (services/scheduler/autoscale.py)",
    ["role", "action"],
)
DESIRED_INSTANCES = Gauge(
    "strata_scheduler_desired_instances",
    "Instances of the role the autoscaler sizes the fleet at now; `strata up` "
    "starts instances up to it with --autoscale-max-decode (an HPA / KEDA target elsewhere)",
    ["role"],
)
AUTOPD_DECISIONS = Counter(
    "strata_scheduler_autopd_decisions_total",
    "AutoPD role changes this scheduler ordered (services/scheduler/planner.py)",
    ["from_role", "to_role"],
)
