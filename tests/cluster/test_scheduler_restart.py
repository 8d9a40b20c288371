"""Restarting a scheduler replica under load loses no routing state: its prefix index is rebuilt
by replaying the KV-event stream (same digest as the replica that kept running), no request
fails meanwhile, and routing keeps sending each tenant to the instance holding its prefix."""

from __future__ import annotations

import os
import random
import threading
import time

import httpx
import pytest

from loadtests.loadgen.workload import words
from tests.cluster.conftest import API_KEY, AUTH, scrape, start_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

DIGEST = "strata_scheduler_prefix_index_digest"
SYSTEM_WORDS = 320  # about 20 blocks of 16 tokens


def tenant_prompt(tenant: int, rng: random.Random) -> str:
    system = " ".join(words(random.Random(f"restart-tenant:{tenant}"), SYSTEM_WORDS))
    return system + " " + " ".join(words(rng, 12))


def cached_tokens(body: dict) -> int:
    return (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def complete(url: str, model: str, prompt: str) -> int:
    """Send one completion; returns its cached prompt tokens."""
    r = httpx.post(
        url + "/v1/completions",
        timeout=60.0,
        headers=AUTH,
        json={"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0},
    )
    assert r.status_code == 200, r.text
    return cached_tokens(r.json())


def digests(c) -> tuple[float, float]:
    return tuple(scrape(c, f"scheduler-{i}", DIGEST)[""] for i in (0, 1))  # type: ignore[return-value]


def wait_in_sync(c, timeout: float = 20.0) -> float:
    """Both replicas' index digests equal (and stable over a report interval); returns it."""
    deadline = time.monotonic() + timeout
    while True:
        a = digests(c)
        time.sleep(0.6)
        b = digests(c)
        if a[0] == a[1] == b[0] == b[1] and a[0] != 0:
            return a[0]
        assert time.monotonic() < deadline, f"replica digests never agreed: {a} {b}"


def test_scheduler_restart_rebuilds_index_by_replay_and_keeps_routing(default_model_dir):
    c = start_cluster(
        default_model_dir,
        scheduler=2,
        prefill=2,
        decode=1,
        kvstore=0,
        vision=0,
        minio=False,
        torch_threads=1,
        data_dir=os.environ.get("STRATA_TEST_KEEP_DIR", ""),
        env={"STRATA_API_KEYS": API_KEY},
        role_args={
            "scheduler": [
                "--policy",
                "prefix_aware",
                "--short-prompt-tokens",
                "0",
                "--log-level",
                "DEBUG",
            ]
        },
    )
    try:
        url = c.gateway_url
        model = httpx.get(url + "/v1/models", headers=AUTH).json()["data"][0]["id"]
        rng = random.Random(0)
        # Two tenants; new prefixes go to the least-filled cache, so they land on different
        # prefill instances. Then each tenant's next request hits its own instance.
        for t in (0, 1):
            complete(url, model, tenant_prompt(t, rng))
            time.sleep(1.2)  # KV events and load reports reach both replicas
        for t in (0, 1):
            assert complete(url, model, tenant_prompt(t, rng)) >= 256
        before = wait_in_sync(c)

        # Load in the background while scheduler-0 restarts (graceful: SIGTERM, drain).
        stop = threading.Event()
        results: list[tuple[int, int]] = []

        def load() -> None:
            lrng = random.Random(1)
            while not stop.is_set():
                t = lrng.randrange(2)
                r = httpx.post(
                    url + "/v1/completions",
                    timeout=60.0,
                    headers=AUTH,
                    json={
                        "model": model,
                        "prompt": tenant_prompt(t, lrng),
                        "max_tokens": 2,
                        "temperature": 0.0,
                    },
                )
                cached = cached_tokens(r.json()) if r.status_code == 200 else -1
                results.append((r.status_code, cached if r.status_code == 200 else r.text[:200]))

        threads = [threading.Thread(target=load) for _ in range(2)]
        for th in threads:
            th.start()
        time.sleep(2.0)
        c.restart("scheduler-0")  # ready only after the replay reached the stream's end
        replayed = scrape(c, "scheduler-0", "strata_scheduler_kv_events_replayed")[""]
        time.sleep(3.0)
        stop.set()
        for th in threads:
            th.join(60)

        assert replayed > 0
        assert len(results) >= 6
        assert all(status == 200 for status, _ in results), [r for r in results if r[0] != 200]
        # requests hit their tenant's prefix before, during and after the restart (a few may
        # be sent elsewhere on purpose: when the holder's queue costs more than recomputing)
        hits = sum(cached >= 256 for _, cached in results)
        assert hits >= 0.8 * len(results), results
        after = wait_in_sync(c)  # the rebuilt index equals the never-restarted replica's
        assert after != before  # the load added blocks (tenant suffixes) meanwhile
        for t in (0, 1):  # routing after the restart still goes where the prefix is
            assert complete(url, model, tenant_prompt(t, rng)) >= 256
    finally:
        c.stop()
