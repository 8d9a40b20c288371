"""Structured outputs survive a decode failover: kill -9 of a decode instance while 8 sampled
(temperature 0.8, seeded) json_schema streams run on 2 decode instances, after a prefill -> decode
hand-off. Every stream still ends with "stop" and its whole text validates against the schema:
the instance that takes a stream over rebuilds the grammar state by replaying the tokens already
sent (`SamplingParams.resumed`). A random-weight model cannot produce valid JSON by chance, so
validity proves the constraint followed the request across the hand-off and the failover."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.cluster.conftest import scrape, start_cluster

jsonschema = pytest.importorskip("jsonschema")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

STREAMS = 8
RECORD = {
    "type": "object",
    "required": ["sku", "in_stock", "quantity", "size"],
    "additionalProperties": False,
    "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
        "in_stock": {"type": "boolean"},
        "quantity": {"type": "integer", "minimum": 0, "maximum": 99},
        "size": {"enum": ["S", "M", "L"]},
    },
}
SCHEMA = {"type": "array", "items": RECORD, "minItems": 4, "maxItems": 4}


async def stream_one(
    client: httpx.AsyncClient, url: str, model: str, i: int, progress: list[int]
) -> tuple[str, str]:
    """(text, finish_reason) of one streamed json_schema chat completion."""
    body = {
        "model": model,
        "max_tokens": 800,
        "temperature": 0.8,
        "seed": 100 + i,
        "stream": True,
        "messages": [{"role": "user", "content": f"List four products, batch {i}."}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "products", "schema": SCHEMA},
        },
    }
    text, finish = "", ""
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            for ch in obj["choices"]:
                text += ch["delta"].get("content") or ""
                finish = ch.get("finish_reason") or finish
            progress[i] += 1
    return text, finish


def test_json_schema_streams_stay_valid_across_a_decode_failover(default_model_dir):
    c = start_cluster(
        default_model_dir,
        prefill=1,
        decode=2,
        kvstore=0,
        vision=0,
        minio=False,
        torch_threads=1,
        env={"STRATA_STALL_TIMEOUT": "10"},
    )
    try:
        model = httpx.get(c.gateway_url + "/v1/models").json()["data"][0]["id"]

        async def run() -> list[tuple[str, str]]:
            progress = [0] * STREAMS
            async with httpx.AsyncClient(timeout=180.0) as cl:
                tasks = [
                    asyncio.create_task(stream_one(cl, c.gateway_url, model, i, progress))
                    for i in range(STREAMS)
                ]
                while min(progress) < 3 and not any(t.done() for t in tasks):
                    await asyncio.sleep(0.02)
                await asyncio.to_thread(c.kill, "decode-0")
                assert sum(not t.done() for t in tasks) >= STREAMS // 2
                return await asyncio.gather(*tasks)

        results = asyncio.run(run())
        for i, (text, finish) in enumerate(results):
            assert finish == "stop", (i, finish, text)
            jsonschema.validate(json.loads(text), SCHEMA)  # the whole stream, across the cut
        failovers = sum(scrape(c, "gateway-0", "strata:stream_failovers_total").values())
        assert failovers >= 1  # decode-0 held constrained streams that moved to decode-1
    finally:
        c.stop()
