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

from tests.cluster.conftest import scrape
from tests.cluster.test_decode_failover import (
    failover_cluster,
    kill_decode_0_under_streams,
    sse_chunks,
)

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
# twelve records: streams that outlast the kill (four ended, all 8 of them, before it 1 run in 3
# once the engine got faster)
SCHEMA = {"type": "array", "items": RECORD, "minItems": 12, "maxItems": 12}


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
        "messages": [{"role": "user", "content": f"List twelve products, batch {i}."}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "products", "schema": SCHEMA},
        },
    }
    text, finish = "", ""
    async for obj in sse_chunks(client, url, body):
        for ch in obj["choices"]:
            text += ch["delta"].get("content") or ""
            finish = ch.get("finish_reason") or finish
        progress[i] += 1
    return text, finish


def test_json_schema_streams_stay_valid_across_a_decode_failover(default_model_dir):
    with failover_cluster(default_model_dir) as (c, model):
        progress = [0] * STREAMS
        results = asyncio.run(
            kill_decode_0_under_streams(
                c,
                STREAMS,
                lambda cl, i: stream_one(cl, c.gateway_url, model, i, progress),
                progress,
                min_progress=3,
                poll_s=0.02,
            )
        )
        for i, (text, finish) in enumerate(results):
            assert finish == "stop", (i, finish, text)
            jsonschema.validate(json.loads(text), SCHEMA)  # the whole stream, across the cut
        failovers = sum(scrape(c, "gateway-0", "strata:stream_failovers_total").values())
        assert failovers >= 1  # decode-0 held constrained streams that moved to decode-1
