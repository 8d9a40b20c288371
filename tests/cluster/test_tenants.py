"""Tenants through a real cluster: two API keys are two tenants, from the gateway's request
count to the engines' admission and queue-wait metrics (the tenant travels in the `WorkItem`)."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.cluster.conftest import scrape, start_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

KEYS = {"env-0": "sk-tenant-aaa", "env-1": "sk-tenant-bbb"}


def per_tenant(c, names: list[str], metric: str) -> dict[str, float]:
    """``metric`` summed by its tenant label over the services ``names``."""
    out: dict[str, float] = {}
    for name in names:
        for labels, v in scrape(c, name, metric).items():
            tenant = labels.split('tenant="')[1].split('"')[0]
            out[tenant] = out.get(tenant, 0.0) + v
    return out


def test_two_api_keys_are_two_tenants_in_the_metrics(default_model_dir):
    c = start_cluster(
        default_model_dir,
        prefill=1,
        decode=1,
        kvstore=0,
        vision=0,
        minio=False,
        torch_threads=1,
        env={"STRATA_API_KEYS": ",".join(KEYS.values()), "STRATA_TENANT_WEIGHTS": "env-0:3"},
    )
    try:
        url = c.gateway_url
        with httpx.Client(base_url=url, timeout=120) as cl:
            auth = {"Authorization": f"Bearer {KEYS['env-0']}"}
            model = cl.get("/v1/models", headers=auth).json()["data"][0]["id"]
            for name, key in KEYS.items():
                for i in range(2):
                    r = cl.post(
                        "/v1/completions",
                        json={"model": model, "prompt": f"{name} asks {i}", "max_tokens": 2},
                        headers={"Authorization": f"Bearer {key}"},
                    )
                    assert r.status_code == 200, r.text
        assert per_tenant(c, ["gateway-0"], "strata_tenant_requests_total") == {
            "env-0": 2.0,
            "env-1": 2.0,
        }
        # engines export their admissions at each load report: wait for both tenants' four
        engines = ["prefill-0", "decode-0"]
        deadline = time.monotonic() + 60
        while True:
            admitted = per_tenant(c, engines, "strata_tenant_admitted_total")
            if admitted.get("env-0", 0) >= 2 and admitted.get("env-1", 0) >= 2:
                break
            assert time.monotonic() < deadline, f"engine admissions by tenant: {admitted}"
            time.sleep(0.5)
        waits = per_tenant(c, engines, "strata_tenant_queue_wait_seconds_count")
        assert waits.get("env-0", 0) >= 2 and waits.get("env-1", 0) >= 2, waits
        for name in ["gateway-0", *engines]:  # tenants by key name, never the key
            port = c.specs[name].env["STRATA_METRICS_PORT"]
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            assert not any(key in text for key in KEYS.values()), name
    finally:
        c.stop()
