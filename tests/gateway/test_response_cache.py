"""The response cache end to end: a real gateway over real NATS (fake engine peers), a real
kvstore (in-process, real gRPC) over a real MinIO bucket for the warm and cold tiers.

The fake decode emits the same tokens for every prompt, so a hit is told from a recompute by
the decode not being reached (``peers.items``), the counters, and a script only the first
gateway's decode emits (a later gateway's decode would answer "t0 t1 ...").
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
from prometheus_client import REGISTRY

from shared.protocol import subjects
from shared.protocol.api import GenerateEvent, GenerateRequest
from shared.protocol.codec import decode, encode
from tests.gateway.harness import gateway
from tests.kvstore.conftest import new_bucket, start_kvstore

MSG = [{"role": "user", "content": "what is cached?"}]
SCRIPT = ["cached ", "answer"]
HDR = "X-Strata-Cache"


def count(tier: str, outcome: str) -> float:
    v = REGISTRY.get_sample_value("strata_response_cache_total", {"tier": tier, "outcome": outcome})
    return v or 0.0


def body(**kw) -> dict:
    return {
        "model": "tiny",
        "messages": MSG,
        "max_tokens": 4,
        "temperature": 0,
        "cache": True,
        **kw,
    }


async def post(url: str, payload: dict, headers=None) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as c:
        return await c.post(url + "/v1/chat/completions", json=payload, headers=headers or {})


def comparable(r: dict) -> dict:
    out = {k: v for k, v in r.items() if k not in ("id", "created")}
    out["usage"] = {k: v for k, v in r["usage"].items() if k != "response_cache"}
    return out


async def test_hot_then_warm_then_cold(nats_url, minio_server):
    bucket = new_bucket()
    kv = await start_kvstore(nats_url, minio_server, bucket=bucket)
    cfg = dict(response_cache=True, kvstore_addrs=[kv.addr])
    try:
        async with gateway(nats_url, **cfg) as (url, peers, service):
            peers.script = SCRIPT
            first = await post(url, body())
            assert first.status_code == 200, first.text
            assert first.headers["x-strata-cache"] == "miss"
            assert first.json()["usage"]["response_cache"] == "miss"
            assert first.json()["choices"][0]["message"]["content"] == "cached answer"
            hot = count("hot", "hit")
            second = await post(url, body())
            assert second.headers["x-strata-cache"] == "hit-hot"
            assert second.json()["usage"]["response_cache"] == "hit-hot"
            assert comparable(second.json()) == comparable(first.json())
            assert second.json()["id"] != first.json()["id"]
            assert len(peers.items) == 1  # the hit never reached the decode
            assert count("hot", "hit") == hot + 1
            await service.response_cache.drain()  # the kvstore write
        await kv.store.flush()  # and its write-behind to MinIO
        assert kv.store.core.stats.persists >= 1

        # a restarted gateway: an empty hot tier, the kvstore's DRAM still has it
        async with gateway(nats_url, **cfg) as (url, peers, service):
            assert len(service.response_cache.hot) == 0
            warm = count("warm", "hit")
            r = await post(url, body())
            assert r.headers["x-strata-cache"] == "hit-warm"
            assert comparable(r.json()) == comparable(first.json())
            assert peers.items == [] and count("warm", "hit") == warm + 1
            again = await post(url, body())  # copied up into the hot tier
            assert again.headers["x-strata-cache"] == "hit-hot"

        # the kvstore restarted: DRAM is empty, the object is in the MinIO bucket
        await kv.shutdown()
        kv = await start_kvstore(nats_url, minio_server, bucket=bucket)
        assert kv.store.core.tier_counts()["dram_blocks"] == 0
        cfg["kvstore_addrs"] = [kv.addr]
        async with gateway(nats_url, **cfg) as (url, peers, service):
            cold, restores = count("cold", "hit"), kv.store.core.stats.restores
            r = await post(url, body())
            assert r.headers["x-strata-cache"] == "hit-cold", r.text
            assert comparable(r.json()) == comparable(first.json())
            assert peers.items == [] and count("cold", "hit") == cold + 1
            assert kv.store.core.stats.restores == restores + 1  # read back from MinIO
            r = await post(url, body())
            assert r.headers["x-strata-cache"] == "hit-hot"
    finally:
        if not kv.task.done():
            await kv.shutdown()


async def test_what_is_never_cached_or_misses(nats_url):
    async with gateway(nats_url, response_cache=True) as (url, peers, _):
        n = len(peers.items)
        bypass = count("none", "bypass")
        for _ in range(2):  # sampling without a seed: never cached
            r = await post(url, body(temperature=0.7))
            assert r.headers["x-strata-cache"] == "bypass"
            assert r.json()["usage"]["response_cache"] == "bypass"
        assert len(peers.items) == n + 2 and count("none", "bypass") == bypass + 2

        # a fixed seed is deterministic: cached
        assert (await post(url, body(temperature=1.0, seed=7))).headers["x-strata-cache"] == "miss"
        r = await post(url, body(temperature=1.0, seed=7))
        assert r.headers["x-strata-cache"] == "hit-hot"

        base = await post(url, body())
        assert base.headers["x-strata-cache"] == "miss"
        assert (await post(url, body())).headers["x-strata-cache"] == "hit-hot"
        for changed in (body(max_tokens=3), body(stop=["zz"]), body(seed=1), body(n=2)):
            r = await post(url, changed)
            assert r.headers["x-strata-cache"] == "miss", changed
        peers.fingerprint = "another-model"  # the tokenizer now serves other weights
        assert (await post(url, body())).headers["x-strata-cache"] == "miss"

        # no opt-in, or opting out: no cache, no header
        n = len(peers.items)
        r = await post(url, {k: v for k, v in body(seed=7).items() if k != "cache"})
        assert "x-strata-cache" not in r.headers and "response_cache" not in r.json()["usage"]
        no_field = {k: v for k, v in body(seed=7).items() if k != "cache"}
        r = await post(url, no_field, {"X-Strata-Cache": "off"})
        assert "x-strata-cache" not in r.headers
        assert len(peers.items) == n + 2
        # the header opts in as the body field does
        r = await post(url, {k: v for k, v in body().items() if k != "cache"}, {HDR: "use"})
        assert r.headers["x-strata-cache"] == "hit-hot"


async def test_errors_and_cancels_are_not_stored(nats_url):
    async with gateway(nats_url, decodes=(), response_cache=True, stall_timeout=0.5) as (
        url,
        peers,
        service,
    ):
        await peers.add_decode("stuck", stall_after=1)
        payload = body(max_tokens=3)
        for _ in range(2):  # the stream stalls and fails over to nothing: an error, not stored
            r = await post(url, payload)
            assert r.status_code >= 500
        assert len(service.response_cache.hot) == 0


async def test_streaming_hit_parses_like_the_real_stream(nats_url):
    async with gateway(nats_url, response_cache=True) as (url, peers, _):
        peers.script = SCRIPT
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)

        async def run() -> tuple[str, list[dict]]:
            raw = await client.chat.completions.with_raw_response.create(
                model="tiny",
                messages=MSG,
                max_tokens=4,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"cache": True},
            )
            chunks = []
            async for ch in raw.parse():
                d = ch.model_dump(exclude={"id", "created"})
                if d.get("usage"):
                    d["usage"].pop("response_cache")
                chunks.append(d)
            return raw.headers["x-strata-cache"], chunks

        state, live = await run()
        assert state == "miss" and len(live) >= 3
        state, hit = await run()
        assert state == "hit-hot"
        assert hit == live
        text = "".join(c["choices"][0]["delta"]["content"] or "" for c in hit if c["choices"])
        assert text == "cached answer"
        assert len(peers.items) == 1


async def test_bad_cache_field_and_header_name_it(nats_url):
    async with gateway(nats_url) as (url, _, _s):  # cache off in this deployment
        r = await post(url, body(cache="yes"))
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache"
        assert "'cache'" in r.json()["error"]["message"]
        r = await post(url, body(), {"X-Strata-Cache": "sometimes"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache"
        assert "X-Strata-Cache" in r.json()["error"]["message"]
        r = await post(url, body(cache=True))
        assert r.status_code == 200 and r.headers["x-strata-cache"] == "disabled"
        assert json.loads(r.text)["usage"]["response_cache"] == "disabled"


async def test_nats_api_marks_usage_and_a_cancelled_stream_is_not_stored(nats_url, nc):
    async with gateway(nats_url, response_cache=True) as (_, peers, service):
        for want in ("miss", "hit-hot"):
            req = encode(GenerateRequest(body=body()))
            ev = decode(
                (await nc.request(subjects.API_GENERATE, req, timeout=5)).data, GenerateEvent
            )
            assert ev.done and ev.data["usage"]["response_cache"] == want
        assert len(peers.items) == 1

        peers.decodes["dec-0"]["gap"] = 0.1  # a slow stream, cancelled on the bus mid-way
        got: list[GenerateEvent] = []
        done = asyncio.Event()

        async def on_ev(msg):
            got.append(decode(msg.data, GenerateEvent))
            if got[-1].done:
                done.set()

        sub = await nc.subscribe("my.cache.stream", cb=on_ev)
        stream = body(max_tokens=40, stream=True)
        for _ in range(2):  # the cancelled answer was not stored: the second one misses too
            got.clear()
            done.clear()
            await nc.publish(
                subjects.API_GENERATE,
                encode(
                    GenerateRequest(body=stream, stream_subject="my.cache.stream", request_id="rc")
                ),
            )
            while not any(e.data and e.data.get("choices") for e in got[1:]):
                await asyncio.sleep(0.02)
            await nc.publish(subjects.req_cancel("rc"), b"")
            await asyncio.wait_for(done.wait(), 5)
            finals = [
                e.data["choices"][0]["finish_reason"] for e in got if e.data and e.data["choices"]
            ]
            assert finals[-1] == "abort"
        assert len(peers.items) == 3 and len(service.response_cache.hot) == 1
        await sub.unsubscribe()


async def test_completions_hit_is_formatted_for_the_request_that_hits(nats_url):
    """What is stored is the generation: a hit with ``echo`` (formatting only, not in the key)
    prepends the prompt to the stored text, as a live answer would."""
    async with gateway(nats_url, response_cache=True) as (url, peers, _):
        peers.script = SCRIPT
        req = {"model": "tiny", "prompt": "ab", "max_tokens": 4, "temperature": 0, "cache": True}
        async with httpx.AsyncClient(timeout=30) as c:
            first = await c.post(url + "/v1/completions", json=req)
            echoed = await c.post(url + "/v1/completions", json={**req, "echo": True})
        assert first.headers["x-strata-cache"] == "miss"
        assert first.json()["choices"][0]["text"] == "cached answer"
        assert echoed.headers["x-strata-cache"] == "hit-hot"
        assert echoed.json()["choices"][0]["text"] == "abcached answer"
        assert len(peers.items) == 1


async def test_messages_and_responses_apis_mark_the_cache_in_the_header(nats_url):
    """`/v1/messages` and `/v1/responses` run over the chat path: a repeat is a hot hit there
    too, and both say so in ``X-Strata-Cache``, streamed or not."""
    async with gateway(nats_url, response_cache=True) as (url, peers, _):
        peers.script = SCRIPT
        anthropic_body = {"model": "tiny", "max_tokens": 4, "temperature": 0, "messages": MSG}
        responses_body = {"model": "tiny", "max_output_tokens": 4, "temperature": 0, "input": "hi"}
        hit = {HDR: "use"}
        async with httpx.AsyncClient(timeout=30) as c:
            for path, req in (("/v1/messages", anthropic_body), ("/v1/responses", responses_body)):
                states = []
                for stream in (False, True, False):
                    r = await c.post(url + path, json={**req, "stream": stream}, headers=hit)
                    assert r.status_code == 200, r.text
                    states.append(r.headers.get(HDR.lower()))
                assert states == ["miss", "hit-hot", "hit-hot"], (path, states)
        assert len(peers.items) == 2  # one generation per API, the repeats were hits
