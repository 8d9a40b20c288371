"""Writes ``strata-dashboard.json`` (Grafana) over the metrics Strata services export.

    .venv/bin/python compose/grafana/build_dashboard.py

Edit the panels here and regenerate; `tests/loadgen/test_dashboard.py` checks that the JSON is
up to date and that every metric it queries is defined in the services' code.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).with_name("strata-dashboard.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
J = '{job=~"$job"}'  # gateway metrics are also scraped from its HTTP port: pick one job
GW = 'job=~"$job"'


def q(metric: str, p: float, by: str = "", sel: str = GW) -> str:
    """histogram_quantile over a 1m rate, summed over instances (``by`` keeps a label)."""
    labels = f"le{',' + by if by else ''}"
    return f"histogram_quantile({p}, sum by ({labels}) (rate({metric}_bucket{{{sel}}}[1m])))"


def panel(
    title: str,
    targets: list[tuple[str, str]],
    unit: str = "short",
    desc: str = "",
    kind: str = "timeseries",
    stack: bool = False,
) -> dict:
    p = {
        "type": kind,
        "title": title,
        "description": desc,
        "datasource": DS,
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "custom": {"stacking": {"mode": "normal" if stack else "none"}},
            },
            "overrides": [],
        },
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom"},
            "tooltip": {"mode": "multi"},
        },
        "targets": [
            {"datasource": DS, "expr": e, "legendFormat": leg, "refId": chr(65 + i)}
            for i, (e, leg) in enumerate(targets)
        ],
    }
    return p


def pcts(metric: str, sel: str = GW) -> list[tuple[str, str]]:
    return [(q(metric, x, sel=sel), f"p{round(x * 100)}") for x in (0.5, 0.9, 0.99)]


ROWS: list[tuple[str, list[dict]]] = [
    (
        "Latency (gateway view)",
        [
            panel(
                "Time to first token",
                pcts("strata:time_to_first_token_seconds"),
                "s",
                "Arrival at the gateway to the first token relayed (TTFT)",
            ),
            panel(
                "Inter-token latency",
                pcts("strata:inter_token_latency_seconds"),
                "s",
                "Gap between streamed tokens (ITL / TBT)",
            ),
            panel("End-to-end latency", pcts("strata:e2e_request_latency_seconds"), "s"),
            panel(
                "Queue time",
                pcts("strata:request_queue_time_seconds"),
                "s",
                "Arrival to submit: tokenize, image encode, route",
            ),
            panel(
                "Tokenize / vision round trip",
                [
                    (q("strata:tokenize_seconds", 0.5), "tokenize p50"),
                    (q("strata:tokenize_seconds", 0.99), "tokenize p99"),
                    (q("strata:vision_encode_seconds", 0.5), "vision p50"),
                    (q("strata:vision_encode_seconds", 0.99), "vision p99"),
                ],
                "s",
            ),
            panel(
                "Scheduler decision time",
                [
                    (q("strata_scheduler_decision_seconds", 0.5, "policy", ""), "p50 {{policy}}"),
                    (q("strata_scheduler_decision_seconds", 0.99, "policy", ""), "p99 {{policy}}"),
                ],
                "s",
            ),
        ],
    ),
    (
        "Load and degradation",
        [
            panel(
                "Requests running / waiting",
                [
                    (f"sum(strata:num_requests_running{J})", "running"),
                    (f"sum(strata:num_requests_waiting{J})", "waiting"),
                ],
                desc="Gateway streams past / before their first token",
            ),
            panel(
                "Live instances",
                [
                    ("max by (role) (strata_scheduler_live_instances)", "{{role}}"),
                    ("max(strata_scheduler_down_instances)", "down"),
                ],
            ),
            panel(
                "Degradation level and cluster load",
                [
                    ("max(strata_scheduler_degrade_level)", "degrade level (0..3)"),
                    ("max(strata_scheduler_cluster_load)", "cluster load"),
                ],
                desc="1 trims batch work, 2 refuses batch (429), 3 keeps top priority only",
            ),
            panel(
                "Finished requests / s",
                [
                    (
                        f"sum by (finished_reason) (rate(strata:request_success_total{J}[1m]))",
                        "{{finished_reason}}",
                    ),
                ],
                "reqps",
                stack=True,
            ),
            panel(
                "HTTP responses / s by status",
                [
                    (f"sum by (status) (rate(strata:http_requests_total{J}[1m]))", "{{status}}"),
                ],
                "reqps",
                stack=True,
            ),
            panel(
                "Failovers, cancels, failures / s",
                [
                    (
                        f"sum by (why) (rate(strata:stream_failovers_total{J}[1m]))",
                        "failover {{why}}",
                    ),
                    (f"sum(rate(strata:request_cancelled_total{J}[1m]))", "cancelled"),
                    (
                        "sum by (role) (rate(strata_worker_requests_failed_total[1m]))",
                        "failed on {{role}}",
                    ),
                    (
                        "sum(rate(strata_kv_transfer_fallback_total[1m]))",
                        "KV transfer -> recompute",
                    ),
                ],
                "ops",
            ),
        ],
    ),
    (
        "Tokens and prefix cache",
        [
            panel(
                "Tokens / s",
                [
                    (f"sum(rate(strata:prompt_tokens_total{J}[1m]))", "prompt"),
                    (f"sum(rate(strata:generation_tokens_total{J}[1m]))", "generated"),
                    (f"sum(rate(strata:prompt_tokens_cached_total{J}[1m]))", "prompt (cached)"),
                ],
            ),
            panel(
                "Prefix cache hit rate",
                [
                    (
                        f"sum(rate(strata:prompt_tokens_cached_total{J}[5m])) / "
                        f"sum(rate(strata:prompt_tokens_total{J}[5m]))",
                        "cached / prompt tokens",
                    ),
                ],
                "percentunit",
            ),
            panel(
                "Prefix blocks loaded from the pool / s",
                [
                    ("sum by (tier) (rate(strata_prefix_pool_hit_blocks_total[1m]))", "{{tier}}"),
                    ("sum(rate(strata_prefix_pool_stored_blocks_total[1m]))", "offered to pool"),
                ],
                "ops",
            ),
            panel(
                "Global prefix index",
                [
                    ("max(strata_scheduler_prefix_index_blocks)", "block hashes"),
                ],
            ),
            panel(
                "Vision embedding cache / s",
                [
                    ("sum by (result) (rate(strata_vision_cache_total[1m]))", "{{result}}"),
                ],
                "ops",
            ),
        ],
    ),
    (
        "Engines (prefill / decode instances)",
        [
            panel(
                "Engine KV cache usage",
                [
                    ("max by (role, instance) (strata:kv_cache_usage_perc)", "{{instance}}"),
                ],
                "percentunit",
            ),
            panel(
                "Engine batch",
                [
                    ("sum by (role) (strata:engine_num_requests_running)", "running {{role}}"),
                    ("sum by (role) (strata:engine_num_requests_waiting)", "waiting {{role}}"),
                ],
            ),
            panel(
                "Engine prefix cache hit rate",
                [
                    (
                        "sum by (role) (rate(strata:prefix_cache_hits_total[5m])) / "
                        "sum by (role) (rate(strata:prefix_cache_queries_total[5m]))",
                        "{{role}}",
                    ),
                ],
                "percentunit",
            ),
            panel(
                "Preemptions / s",
                [
                    ("sum by (instance) (rate(strata:num_preemptions_total[1m]))", "{{instance}}"),
                ],
                "ops",
            ),
        ],
    ),
    (
        "KV pool (kvstore tiers)",
        [
            panel(
                "kvstore reads / s by tier",
                [
                    ("sum by (tier) (rate(strata_kvstore_hits_total[1m]))", "hit {{tier}}"),
                    ("sum(rate(strata_kvstore_misses_total[1m]))", "miss"),
                ],
                "ops",
                stack=True,
            ),
            panel(
                "kvstore usage by tier",
                [
                    ("sum by (tier) (strata_kvstore_bytes)", "{{tier}}"),
                ],
                "bytes",
            ),
            panel(
                "kvstore blocks by tier", [("sum by (tier) (strata_kvstore_blocks)", "{{tier}}")]
            ),
            panel(
                "Spill / restore bytes / s (SSD tier)",
                [
                    ("sum(rate(strata_kvstore_spill_bytes_total[1m]))", "spill"),
                    ("sum(rate(strata_kvstore_restore_bytes_total[1m]))", "restore"),
                ],
                "Bps",
            ),
            panel(
                "KV transfer bytes / s",
                [
                    ("sum by (direction) (rate(strata_kv_rpc_bytes_total[1m]))", "{{direction}}"),
                ],
                "Bps",
            ),
            panel(
                "Errors / s",
                [
                    ("sum by (op) (rate(strata_kvstore_errors_total[1m]))", "kvstore {{op}}"),
                    (
                        "sum by (op) (rate(strata_kvpool_client_errors_total[1m]))",
                        "pool client {{op}}",
                    ),
                    (
                        'sum by (subject) (rate(strata_handler_requests_total{status!="ok"}[1m]))',
                        "bus {{subject}}",
                    ),
                ],
                "ops",
            ),
        ],
    ),
]


def build() -> dict:
    panels, y, pid = [], 0, 1
    for title, row in ROWS:
        panels.append(
            {
                "type": "row",
                "title": title,
                "id": pid,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        pid, y = pid + 1, y + 1
        for i, p in enumerate(row):
            p = {
                **p,
                "id": pid,
                "gridPos": {"h": 8, "w": 8, "x": 8 * (i % 3), "y": y + 8 * (i // 3)},
            }
            panels.append(p)
            pid += 1
        y += 8 * -(-len(row) // 3)
    return {
        "uid": "strata-overview",
        "title": "Strata",
        "tags": ["strata", "llm"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "timezone": "",
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "query": "prometheus",
                    "label": "Data source",
                    "current": {},
                    "hide": 0,
                },
                {
                    "name": "job",
                    "type": "query",
                    "datasource": DS,
                    "label": "Gateway job",
                    "query": "label_values(strata:num_requests_running, job)",
                    "refresh": 2,
                    "includeAll": False,
                    "current": {"text": "strata", "value": "strata"},
                },
            ]
        },
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
