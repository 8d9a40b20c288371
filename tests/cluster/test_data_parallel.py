"""`strata up --dp 2` on the shape a small box gets (colocated): two decode replicas of the
model, each its own instance, balanced by the scheduler. Concurrent distinct prompts are served
by both replicas; a prompt whose long prefix one replica holds goes back to that replica (its
prompt tokens come from the prefix cache)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.cluster.conftest import API_KEY, AUTH, scrape, start_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SUBMITS = "strata_handler_requests_total"
PREFIX = " ".join(f"policy{i}" for i in range(200))


def handled(c, name: str) -> float:
    got = scrape(c, name, SUBMITS)
    return sum(v for k, v in got.items() if "decode" in k and "submit" in k)


def indexed(c) -> float:
    """Blocks in the scheduler's prefix index (all instances)."""
    return sum(scrape(c, "scheduler-0", "strata_scheduler_prefix_index_blocks").values())


async def complete(cl: httpx.AsyncClient, url: str, model: str, prompt: str) -> dict:
    r = await cl.post(
        url + "/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0},
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_dp2_replicas_share_the_load_and_keep_prefix_affinity(default_model_dir):
    c = start_cluster(
        default_model_dir,
        dp=2,
        kvstore=0,
        vision=0,
        minio=False,
        torch_threads=1,
        env={"STRATA_API_KEYS": API_KEY},
        # a stale load report of the replica that just prefilled the long prompt must not
        # outweigh its prefix: affinity kept unless its load is far above the other's
        # (--dp makes the scheduler's policy prefix_aware)
        role_args={"scheduler": ["--affinity-imbalance", "4"]},
    )
    try:
        assert c.names("decode") == ["decode-0", "decode-1"] and not c.names("prefill")
        url = c.gateway_url

        async def run() -> list[dict]:
            async with httpx.AsyncClient(timeout=120, headers=AUTH) as cl:
                model = (await cl.get(url + "/v1/models")).json()["data"][0]["id"]
                burst = [f"Question {i}: what is block {i * 7}?" for i in range(8)]
                await asyncio.gather(*(complete(cl, url, model, p) for p in burst))
                first = await complete(cl, url, model, PREFIX + " first")
                want = (first["usage"]["prompt_tokens"] - 1) // 16
                for _ in range(300):  # the first prompt's KV events reached the scheduler
                    if indexed(c) >= want:
                        break
                    await asyncio.sleep(0.1)
                second = await complete(cl, url, model, PREFIX + " second")
                return [first, second]

        first, second = asyncio.run(run())
        counts = [handled(c, n) for n in c.names("decode")]
        assert all(n >= 1 for n in counts), counts  # both replicas served the burst
        cached = second["usage"].get("prompt_tokens_details", {}).get("cached_tokens") or 0
        assert cached >= 16 * ((first["usage"]["prompt_tokens"] - 1) // 16) - 16, second
    finally:
        c.stop()
