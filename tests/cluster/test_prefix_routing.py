"""prefix_aware vs round_robin on a real cluster of 4 prefill instances with a multi-tenant
workload (tenants share long system prompts; engine-tier hits only: no kvstore). prefix_aware
reaches >= 0.9 of the single-instance hit rate (the same requests on one in-process engine that
caches everything), and round_robin about 1/4 of it. Only behaviour is asserted (hit rates,
every request served): what the hits are worth in TTFT is speed, and speed is measured by the
benchmark, `python -m loadtests.simulator.realcluster` (docs/benchmarks/scheduler.md), of which
this is a smaller run of the same code."""

from __future__ import annotations

import pytest

from loadtests.simulator.realcluster import TenantWorkload, reference_hit_rate, run_policy

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

WORKLOAD = TenantWorkload(
    requests=40, tenants=16, system_words=768, user_words=24, max_tokens=2, rate=8.0, seed=0
)
# the warm-up's requests are of distinct tenants (none can hit another's prefix), so sending them
# one per prefill instance at a time leaves the fleet as primed as one at a time, in a third of
# the time
WARMUP_CONCURRENCY = 4


@pytest.fixture(scope="module")
def ref(default_model_dir) -> float:
    """The single-instance hit rate of the workload (one in-process engine caching everything)."""
    return reference_hit_rate(default_model_dir, WORKLOAD.jobs(), WORKLOAD.warmup_jobs())


def test_prefix_aware_beats_round_robin_on_prefix_hits(default_model_dir, ref):
    jobs, warm = WORKLOAD.jobs(), WORKLOAD.warmup_jobs()
    assert ref > 0.9  # after the warm-up, every system prompt is cached on a single instance
    rr = run_policy(
        default_model_dir, "round_robin", jobs, warm, warmup_concurrency=WARMUP_CONCURRENCY
    )
    pa = run_policy(
        default_model_dir, "prefix_aware", jobs, warm, warmup_concurrency=WARMUP_CONCURRENCY
    )
    assert (rr.ok, pa.ok) == (len(jobs), len(jobs)), (rr.error_samples, pa.error_samples)
    assert pa.hit_rate >= 0.9 * ref, (pa.hit_rate, ref)
    # round robin: a tenant's prefix is on a random one of 4 caches that each hold ~1/4 of them
    assert rr.hit_rate <= 0.5 * ref, (rr.hit_rate, ref)


def test_prefix_routing_holds_when_the_cluster_runs_another_dtype(default_model_dir, ref):
    """`strata up --dtype bfloat16` on the fp32 default model: the gateway's block hashes (from
    the tokenizer's fingerprint) must be keyed like the bf16 engines' KV events, or the scheduler
    sees no prefix anywhere and routes by load alone (hit rate then like round robin's). With
    ``--expect-ttl-s 0`` the scheduler counts a routed prompt's blocks as cached only once the
    engine's KV event says so: its own expectations, keyed by the gateway's hashes whatever the
    engines use, would hide a mismatch (checked: with the tokenizer left at fp32 this fails)."""
    jobs, warm = WORKLOAD.jobs(), WORKLOAD.warmup_jobs()
    # half the bytes: bf16 blocks are half the size, so each cache holds as many as in fp32
    pa = run_policy(
        default_model_dir,
        "prefix_aware",
        jobs,
        warm,
        prefill_kv_bytes=8 << 20,
        dtype="bfloat16",
        scheduler_args=["--expect-ttl-s", "0"],
        warmup_concurrency=WARMUP_CONCURRENCY,
    )
    assert pa.ok == len(jobs), pa.error_samples
    assert pa.hit_rate >= 0.9 * ref, (pa.hit_rate, ref)
