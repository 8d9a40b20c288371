"""Cluster restart keeps the KV pool: blocks written behind to MinIO serve the first request of
a fresh cluster (same NATS/MinIO data dir, every Strata service restarted). Every request's
prompt KV reaches decode by the layer-wise push, asserted on the transfer byte counters (a
recompute would give the same text)."""

from __future__ import annotations

import functools
import os

import openai
import pytest

from tests.cluster_kv.conftest import (
    SHARED_PREFIX,
    kv_bytes_per_token,
    metric,
    moved_since,
    start_cluster,
    transfer_counters,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

# loads the checkpoint on each call: once per test module is enough
kv_bytes = functools.cache(kv_bytes_per_token)

MAX_TOKENS = 6


def complete(cluster, prompt: str):
    client = openai.OpenAI(base_url=cluster.gateway_url + "/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    return client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0
    )


def pushed(cluster, prompt: str):
    """`complete`, asserting its whole prompt's KV moved to decode by the layer-wise push and
    nothing fell back."""
    t0 = transfer_counters(cluster)
    r = complete(cluster, prompt)
    n = r.usage.prompt_tokens * kv_bytes(cluster.model_dir)
    assert moved_since(t0, transfer_counters(cluster)) == {
        "sent:layerwise": n,
        "received:layerwise": n,
    }
    return r


def test_restarted_cluster_is_served_from_minio(model_dir, tmp_path):
    data = str(tmp_path / "cluster")
    first = start_cluster(model_dir, data_dir=data)
    try:
        before = pushed(first, SHARED_PREFIX + "Which tier survives a restart?")
        again = pushed(first, SHARED_PREFIX + "Which tier is fastest?")
        assert again.usage.prompt_tokens_details.cached_tokens >= 64  # engine prefix reuse
        # every pool block is written behind to MinIO (no eviction needed)
        wait_until(
            lambda: (
                metric(first, "kvstore-0", "strata_kvstore_persists_total") >= 4
                and metric(first, "kvstore-0", "strata_kvstore_blocks", tier="write_behind") == 0
            ),
            30,
            "write-behind to MinIO",
        )
        assert metric(first, "kvstore-0", "strata_kvstore_spills_total") == 0
    finally:
        first.stop()

    second = start_cluster(model_dir, data_dir=data)  # fresh processes, same MinIO data
    try:
        assert metric(second, "kvstore-0", "strata_kvstore_hits_total", tier="ssd") == 0
        after = pushed(second, SHARED_PREFIX + "Which tier survives a restart?")
        assert after.choices[0].text == before.choices[0].text
        assert after.usage.prompt_tokens == before.usage.prompt_tokens
        cached = after.usage.prompt_tokens_details.cached_tokens
        assert cached >= 64 and cached % 16 == 0
        ssd_blocks = metric(second, "prefill-0", "strata_prefix_pool_hit_blocks_total", tier="ssd")
        assert ssd_blocks == cached // 16
        assert metric(second, "kvstore-0", "strata_kvstore_hits_total", tier="ssd") >= ssd_blocks
        assert metric(second, "kvstore-0", "strata_kvstore_restores_total") >= ssd_blocks
    finally:
        second.stop()


def test_restarted_colocated_cluster_loads_prefixes_from_minio(model_dir, tmp_path):
    """The shape a small box gets, with its default pool policy: no prefill instance, decode
    computes its prompts and keeps a prompt served once in engine memory only (``reused``).
    The full stop hands those blocks to the kvstore (decode stops first), which writes them to
    MinIO as it stops; after the restart on the same data dir the same prompt's prefix is
    loaded from MinIO into decode instead of being recomputed. Loading is forced on (the tiny
    model recomputes faster than it reads MinIO on some boxes: the cost model's choice is
    tested in tests/worker/test_pool_colocated.py)."""
    data = str(tmp_path / "cluster")
    prompt = SHARED_PREFIX + "Which tier survives a restart?"
    shape = dict(data_dir=data, prefill=0, env={"STRATA_KV_POOL_LOAD": "always"})
    first = start_cluster(model_dir, **shape)
    try:
        before = complete(first, prompt)
        blocks = (before.usage.prompt_tokens - 1) // 16
        assert metric(first, "kvstore-0", "strata_kvstore_puts_total", outcome="stored") == 0
    finally:
        first.stop()
    with open(os.path.join(data, "logs", "decode-0.log")) as f:
        sent = blocks * 16 * kv_bytes(model_dir)
        assert f"stop: {sent} KV bytes handed to the pool" in f.read()

    second = start_cluster(model_dir, **shape)
    try:
        t0 = transfer_counters(second)
        after = complete(second, prompt)
        assert after.choices[0].text == before.choices[0].text
        cached = after.usage.prompt_tokens_details.cached_tokens
        assert cached == blocks * 16
        assert (
            metric(second, "decode-0", "strata_prefix_pool_hit_blocks_total", tier="ssd") == blocks
        )
        n = cached * kv_bytes(model_dir)
        assert moved_since(t0, transfer_counters(second)) == {"received:pool": n}
        loads = metric(second, "decode-0", "strata_kv_pool_load_decisions_total", decision="load")
        assert loads == 1
    finally:
        second.stop()
