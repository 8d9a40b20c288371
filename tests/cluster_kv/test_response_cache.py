"""The response cache through a real subprocess cluster as `strata up` starts it (the tiny model,
a kvstore over MinIO, the KV plane on mutual TLS): the launcher gives the gateway the kvstore's
address and its certificate, and a greedy answer comes back from the gateway's memory, then from
the kvstore's DRAM after a gateway restart, then from MinIO after a kvstore restart, equal to the
generated one each time. The tier is asserted on the header and the gateway's counters."""

from __future__ import annotations

import httpx
import pytest

from tests.cluster_kv.conftest import metric, start_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def ask(cluster, **kw) -> httpx.Response:
    body = {
        "model": _model(cluster),
        "messages": [{"role": "user", "content": "Name the tier that keeps data longest."}],
        "max_tokens": 6,
        "temperature": 0,
        "cache": True,
        **kw,
    }
    r = httpx.post(cluster.gateway_url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def _model(cluster) -> str:
    return httpx.get(cluster.gateway_url + "/v1/models", timeout=10).json()["data"][0]["id"]


def hits(cluster, tier: str) -> float:
    gw = cluster.names("gateway")[0]
    return metric(cluster, gw, "strata_response_cache_total", tier=tier, outcome="hit")


def test_response_cache_tiers_in_a_cluster(model_dir):
    env = {"STRATA_LAYERWISE_TRANSFER": "true", "STRATA_RESPONSE_CACHE": "true"}
    cluster = start_cluster(model_dir, prefill=0, env=env)
    try:
        gw, kv = cluster.names("gateway")[0], cluster.names("kvstore")[0]
        first = ask(cluster)
        assert first.headers["x-strata-cache"] == "miss"
        answer = first.json()["choices"]
        hot = ask(cluster)
        assert hot.headers["x-strata-cache"] == "hit-hot" and hot.json()["choices"] == answer
        assert hits(cluster, "hot") == 1
        sampled = ask(cluster, temperature=0.8)
        assert sampled.headers["x-strata-cache"] == "bypass"

        cluster.restart(gw)  # a graceful stop: its kvstore write is done
        warm = ask(cluster)
        assert warm.headers["x-strata-cache"] == "hit-warm" and warm.json()["choices"] == answer
        assert hits(cluster, "warm") == 1

        cluster.restart(kv)  # its DRAM is gone; write-behind put the object in MinIO
        cluster.restart(gw)
        cold = ask(cluster)
        assert cold.headers["x-strata-cache"] == "hit-cold" and cold.json()["choices"] == answer
        assert hits(cluster, "cold") == 1
        assert metric(cluster, kv, "strata_kvstore_restores_total") >= 1
    finally:
        cluster.stop()
