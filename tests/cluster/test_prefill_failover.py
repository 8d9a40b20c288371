"""kill -9 of the only prefill instance while it computes prompts: every request still completes
(re-prefilled on the decode instance: conditional disaggregation with the prefill excluded), and
the gateway's failovers name prefill-0, never decode-0.

The benchmark model with 2048-token chunks makes one prefill forward take seconds, so the kill
lands while prompts are queued or computing there (checked: the scheduler routed requests to
decode alone after the kill)."""

from __future__ import annotations

import asyncio
import os
import random

import httpx
import pytest

from loadtests.loadgen.workload import words
from services.cluster_config import ensure_model
from tests.cluster.conftest import API_KEY, AUTH, scrape, start_cluster
from tests.cluster.test_busy_liveness import stream_one

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

REQUESTS = 8
PROMPT_WORDS = 400


def test_kill_prefill_mid_prompt_requests_finish_on_decode_and_failover_names_prefill():
    model_dir = ensure_model("", benchmark=True)
    c = start_cluster(
        model_dir,
        prefill=1,
        decode=1,
        kvstore=0,
        vision=0,
        minio=False,
        torch_threads=1,
        env={
            "STRATA_LOAD_INTERVAL": "0.1",
            "STRATA_DOWN_AFTER": "3",
            "STRATA_STATE_INTERVAL": "0.1",
            "STRATA_API_KEYS": API_KEY,
        },
    )
    try:
        model = httpx.get(c.gateway_url + "/v1/models", headers=AUTH).json()["data"][0]["id"]
        rng = random.Random(11)
        prompts = [" ".join(words(rng, PROMPT_WORDS)) for _ in range(REQUESTS)]

        def decisions(outcome: str) -> float:
            got = scrape(c, "scheduler-0", "strata_scheduler_decisions_total")
            return sum(v for k, v in got.items() if f'outcome="{outcome}"' in k)

        async def run() -> list[dict]:
            async with httpx.AsyncClient(
                timeout=240.0, limits=httpx.Limits(max_connections=REQUESTS), headers=AUTH
            ) as cl:
                tasks = [
                    asyncio.create_task(stream_one(cl, c.gateway_url, model, p)) for p in prompts
                ]
                # kill once every request was routed to prefill-0 (its first forward runs)
                while decisions("disaggregated") < REQUESTS:
                    assert not any(t.done() for t in tasks), [t.result() for t in tasks if t.done()]
                    await asyncio.sleep(0.02)
                await asyncio.to_thread(c.kill, "prefill-0")
                assert sum(not t.done() for t in tasks) == REQUESTS  # all in flight at the kill
                return await asyncio.gather(*tasks)

        results = asyncio.run(run())
        assert not c.alive("prefill-0")
        bad = [r for r in results if r["errors"] or r["status"] != 200 or r["tokens"] != 8]
        assert not bad, bad[:3]
        assert decisions("self_prefill") >= 1  # re-routed: decode prefilled the prompt itself
        with open(os.path.join(c.log_dir, "gateway-0.log")) as f:
            log = f.read()
        assert "failover from prefill-0: down" in log, log[-2000:]
        assert "failover from decode-0" not in log
        failovers = scrape(c, "gateway-0", "strata:stream_failovers_total")
        assert failovers.get('{why="down"}', 0) >= 1, failovers
    finally:
        c.stop()
