"""Autoscaling on a real cluster (`strata up --autoscale-max-decode 2` on the default colocated
shape: decode prefills itself; real NATS with per-role users, KV mTLS, an API key, the tiny
default model):

1. eight streams at a time on the one decode instance (short ones, each slot sending its next
   until decode-1 is live, however long that takes) put its pressure at 2 (batch norm 4): the
   scheduler raises the decode need to 2, and the launcher starts decode-1, which goes live;
2. two long streams then go to decode-1 (least loaded); once decode-0's streams have ended, the
   need falls back to 1 and the scheduler retires the least loaded instance, decode-0: it
   drains, stops and exits with the retired code, and the launcher does not restart it (the
   drain itself, with streams still running, is AutoPD's: tests/cluster/test_autopd.py);
3. every stream of both waves ends with all its tokens (nothing lost to the scaling), and the
   cluster still serves.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from shared.protocol.sched import RETIRED_EXIT
from tests.cluster.conftest import API_KEY, AUTH, scrape, start_cluster
from tests.cluster.test_decode_failover import sse_chunks

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

FIRST_TOKENS = 100  # per first-wave stream: each of the 8 slots ends within seconds of decode-1
# the second wave outlasts the first wave's last streams and the retire decision after them (4
# ticks of 0.5 s), checked below; sized to that, not to decode-1's start time (the first wave's
# streams were 700 tokens long, so this had to be 2500)
SECOND_TOKENS = 1200

SCHEDULER_ARGS = [
    "--batch-norm", "4",
    "--autoscale-up-ticks", "2",
    "--autoscale-down-ticks", "4",
    "--autoscale-cooldown-ticks", "2",
    # streams per instance, not cluster load, are what this test moves: no degradation
    "--degrade-up", "50,60,70",
    "--degrade-down", "40,50,60",
]  # fmt: skip


def _decisions(c, action: str) -> float:
    got = scrape(c, "scheduler-0", "strata_scheduler_scale_decisions_total")
    return got.get(f'{{action="{action}",role="decode"}}', 0.0)


def _live_decode(c) -> float:
    return scrape(c, "scheduler-0", "strata_scheduler_live_instances").get('{role="decode"}', 0)


def _wait(what: str, cond, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


async def _stream(client, url, model, i: int, max_tokens: int) -> tuple[int, str]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Tell me story {i} about queues."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    n, reason = 0, ""
    async for ch in sse_chunks(client, url, body):
        for choice in ch.get("choices", []):
            reason = choice.get("finish_reason") or reason
        if ch.get("usage"):
            n = ch["usage"]["completion_tokens"]
    return n, reason


def test_scale_up_under_load_then_retire_after_it(default_model_dir):
    c = start_cluster(
        default_model_dir,
        prefill=0,
        decode=1,
        autoscale_max_decode=2,
        vision=0,
        kvstore=0,
        torch_threads=1,
        minio=False,
        env={"STRATA_API_KEYS": API_KEY},
        role_args={"scheduler": SCHEDULER_ARGS},
    )
    try:
        assert c.autoscaled and c.names("decode") == ["decode-0"]

        async def main():
            async with httpx.AsyncClient(headers=AUTH, timeout=240) as client:
                url = c.gateway_url
                model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
                scaled = asyncio.Event()

                async def slot(i: int) -> list[tuple[int, str]]:
                    out = [await _stream(client, url, model, i, FIRST_TOKENS)]
                    while not scaled.is_set():
                        out.append(await _stream(client, url, model, i, FIRST_TOKENS))
                    return out

                first = [asyncio.create_task(slot(i)) for i in range(8)]
                await asyncio.to_thread(_wait, "decode-1 live", lambda: _live_decode(c) == 2, 120)
                scaled.set()
                assert _decisions(c, "add") >= 1
                second = [
                    asyncio.create_task(_stream(client, url, model, 100 + i, SECOND_TOKENS))
                    for i in range(2)
                ]
                done = [r for rs in await asyncio.gather(*first) for r in rs]
                retire = lambda: _decisions(c, "retire") >= 1  # noqa: E731
                await asyncio.to_thread(_wait, "a retire decision", retire, 120)
                # premise: the scale-down was decided while the second wave still streamed
                assert not all(t.done() for t in second), "the second wave ended before it"
                await asyncio.to_thread(
                    _wait,
                    "decode-0 retired",
                    lambda: c.sup.procs["decode-0"].returncode is not None,
                    120,
                )
                return done, await asyncio.gather(*second), model

        first, second, model = asyncio.run(main())
        assert len(first) >= 8 and first == [(FIRST_TOKENS, "length")] * len(first)
        assert second == [(SECOND_TOKENS, "length")] * 2
        assert c.sup.procs["decode-0"].returncode == RETIRED_EXIT
        assert _decisions(c, "retire") == 1
        assert c.alive("decode-1") and not c.sup.wanted("decode-0")
        # still serving on the instance that is left
        r = httpx.post(
            c.gateway_url + "/v1/completions",
            headers=AUTH,
            json={"model": model, "prompt": "hi", "max_tokens": 4},
            timeout=60,
        )
        assert r.status_code == 200, r.text
    finally:
        c.stop()
