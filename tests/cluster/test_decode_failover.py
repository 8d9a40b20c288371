"""kill -9 of a decode instance while 20 greedy streams run on 2 decode instances: every stream
completes, identical to the in-process greedy reference (no lost or duplicated tokens)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch

from tests.cluster.conftest import scrape, start_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

STREAMS = 20
MAX_TOKENS = 160


def prompts() -> list[list[dict]]:
    topics = ["caches", "queues", "tiers", "blocks", "streams", "routers", "tokens", "layers",
              "kernels", "batches"]  # fmt: skip
    return [[{"role": "user", "content": f"Tell me story {i} about {topics[i % 10]}."}]
            for i in range(STREAMS)]  # fmt: skip


def reference(model_dir: str, msgs: list[list[dict]]) -> list[str]:
    """Greedy outputs computed in-process by the same engine code, no services involved."""
    from shared.engine.engine import LLMEngine
    from shared.engine.params import EngineConfig, SamplingParams
    from shared.model.loader import load_model
    from shared.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    ids = [tok.encode(tok.apply_chat_template(m, add_generation_prompt=True)) for m in msgs]
    engine = LLMEngine(load_model(model_dir), EngineConfig(kv_cache_bytes=64 << 20))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with torch.inference_mode():
        outs = engine.generate(ids, params)
    return [tok.decode(o) for o in outs]


async def stream_one(client: httpx.AsyncClient, url: str, model: str, msgs: list[dict],
                     progress: list[int], i: int) -> str:  # fmt: skip
    body = {"model": model, "messages": msgs, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    parts = []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            for ch in obj["choices"]:
                if ch["delta"].get("content"):
                    parts.append(ch["delta"]["content"])
                    progress[i] += 1
    return "".join(parts)


def test_kill_decode_during_20_streams_all_complete_identically(default_model_dir):
    msgs = prompts()
    expected = reference(default_model_dir, msgs)
    c = start_cluster(default_model_dir, prefill=1, decode=2, kvstore=0, vision=0, minio=False,
                      torch_threads=1, env={"STRATA_STALL_TIMEOUT": "10"})
    try:
        model = httpx.get(c.gateway_url + "/v1/models").json()["data"][0]["id"]

        async def run() -> list[str]:
            progress = [0] * STREAMS
            async with httpx.AsyncClient(timeout=180.0,
                                         limits=httpx.Limits(max_connections=STREAMS)) as cl:
                tasks = [asyncio.create_task(stream_one(cl, c.gateway_url, model, m, progress, i))
                         for i, m in enumerate(msgs)]  # fmt: skip
                # kill once every stream is under way (so decode-0 holds live streams)
                while min(progress) < 2 and not any(t.done() for t in tasks):
                    await asyncio.sleep(0.05)
                await asyncio.to_thread(c.kill, "decode-0")
                live_at_kill = sum(not t.done() for t in tasks)
                assert live_at_kill >= STREAMS // 2, live_at_kill
                return await asyncio.gather(*tasks)

        got = asyncio.run(run())
        assert not c.alive("decode-0")
        for i in range(STREAMS):
            assert got[i] == expected[i], f"stream {i} differs from the greedy reference"
        failovers = sum(scrape(c, "gateway-0", "strata:stream_failovers_total").values())
        assert failovers >= 1  # decode-0 really held streams that moved to decode-1
    finally:
        c.stop()
