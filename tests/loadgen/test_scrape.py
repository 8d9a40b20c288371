"""The benchmarks' /metrics reader against a real exposition (prometheus_client's own HTTP
server on loopback): series summed over their labels, buckets kept apart by a key function,
line selectors with labels, and an unreachable page read as nothing."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

from loadtests.bench_fairness import engine_counts
from loadtests.loadgen.scrape import sample_total, scrape
from services.infra.procs import free_port


@pytest.fixture(scope="module")
def page() -> str:
    reg = CollectorRegistry()
    steps = Histogram("strata:engine_step_seconds", "", ["role"], buckets=(0.05, 0.1), registry=reg)
    split = Counter("strata_fair_split_steps", "", ["role"], registry=reg)
    wait = Histogram(
        "strata_tenant_queue_wait_seconds", "", ["role", "tenant"], buckets=(0.1,), registry=reg
    )
    for tenant, secs in (("env-1", 0.05), ("env-1", 0.3), ("env-0", 0.01)):
        wait.labels(role="decode", tenant=tenant).observe(secs)
    for role, secs in (("decode", 0.02), ("decode", 0.2), ("prefill", 0.07)):
        steps.labels(role=role).observe(secs)
    split.labels(role="decode").inc(3)
    split.labels(role="prefill").inc(1)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=reg)
    yield f"http://127.0.0.1:{port}/metrics"
    server.shutdown()
    thread.join(5)


def test_series_are_summed_over_labels_under_their_mapped_name(page):
    got = scrape(page, {"strata_fair_split_steps_total": "split"})
    assert got == {"split": 4.0}


def test_engine_counts_keep_buckets_apart_and_sum_pages(page):
    got = engine_counts([page, page])
    assert got["strata:engine_step_seconds_count"] == 6.0  # 3 steps on each of two pages
    assert got["le=0.05"] == 2.0 and got["le=0.1"] == 4.0 and got["le=+Inf"] == 6.0
    assert got["strata_fair_split_steps_total"] == 8.0
    # the queue waits by tenant: B's (env-1) 2 of which 1 within 100 ms, on each page
    assert got["wait:env-1:count"] == 4.0 and got["wait:env-1:le=0.1"] == 2.0
    assert got["wait:env-0:count"] == 2.0


def test_a_selector_with_labels_sums_only_its_lines(page):
    assert sample_total(page, 'strata_fair_split_steps_total{role="decode"}') == 3.0
    assert sample_total(page, "strata_fair_split_steps_total") == 4.0


def test_an_unreachable_page_is_read_as_nothing():
    assert scrape(f"http://127.0.0.1:{free_port()}/metrics", {"x": "x"}) == {}
