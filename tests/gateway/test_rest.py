"""Gateway REST against a real nats-server with fake peers: errors, SSE, usage, n, cancel."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from shared.protocol.work import DecodeWork
from tests.gateway.harness import gateway

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def sse_events(text: str) -> list:
    lines = [ln[6:] for ln in text.split("\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


async def test_chat_non_streaming_and_usage(nats_url):
    async with gateway(nats_url) as (url, peers, _):
        async with httpx.AsyncClient(base_url=url) as c:
            r = await c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["object"] == "chat.completion" and body["model"] == "tiny"
            assert body["choices"][0]["message"] == {"role": "assistant", "content": "t0 t1 t2 "}
            assert body["choices"][0]["finish_reason"] == "length"
            assert body["usage"] == {
                "prompt_tokens": 2,
                "completion_tokens": 3,
                "total_tokens": 5,
                "prompt_tokens_details": {"cached_tokens": 4},
            }
            item = peers.items[0]
            assert item.sampling.max_tokens == 3 and item.prompt_token_ids == [104, 105]
            r = await c.get("/v1/models")
            assert r.json()["data"][0]["id"] == "tiny"
            assert (await c.get("/health")).status_code == 200
            metrics = (await c.get("/metrics")).text
            assert "strata:time_to_first_token_seconds_count" in metrics


async def test_streaming_sse_usage_and_n(nats_url):
    async with gateway(nats_url) as (url, peers, _):
        async with httpx.AsyncClient(base_url=url) as c:
            body = {
                **CHAT,
                "stream": True,
                "n": 2,
                "stream_options": {"include_usage": True},
                "temperature": 0.5,
                "seed": 7,
                "stop": "x",
                "top_k": 5,
            }
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200 and r.headers["content-type"].startswith(
                "text/event-stream"
            )
            events = sse_events(r.text)
            assert all(e["object"] == "chat.completion.chunk" for e in events)
            texts = {0: "", 1: ""}
            for e in events[:-1]:
                ch = e["choices"][0]
                texts[ch["index"]] += ch["delta"].get("content", "")
            assert texts == {0: "t0 t1 t2 ", 1: "t0 t1 t2 "}
            assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6
            assert len(peers.items) == 2 and len({i.request_id for i in peers.items}) == 2
            s = peers.items[0].sampling
            assert (s.temperature, s.seed, s.stop, s.top_k) == (0.5, 7, ["x"], 5)


@pytest.mark.parametrize(
    "payload,status,needle",
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1]", 400, "JSON object"),
        (json.dumps({**CHAT, "model": "nope"}).encode(), 404, "does not exist"),
        (json.dumps({**CHAT, "messages": []}).encode(), 400, "messages must not be empty"),
        (json.dumps({**CHAT, "temperature": 5}).encode(), 400, "temperature"),
        (json.dumps({"model": "tiny"}).encode(), 400, "messages"),
        (json.dumps({**CHAT, "n": 99}).encode(), 400, "n must be <= 8"),
        (json.dumps({**CHAT, "max_tokens": 10**6}).encode(), 400, "max_tokens must be <="),
        (
            json.dumps({**CHAT, "messages": [{"role": "user", "content": "y" * 80}]}).encode(),
            400,
            "context length is 64",
        ),
        (json.dumps({**CHAT, "max_tokens": 63}).encode(), 400, "exceeds the context length"),
    ],
)
async def test_errors(nats_url, payload, status, needle):
    async with gateway(nats_url) as (url, _, _s):
        async with httpx.AsyncClient(base_url=url) as c:
            r = await c.post(
                "/v1/chat/completions",
                content=payload,
                headers={"content-type": "application/json"},
            )
            assert r.status_code == status, r.text
            err = r.json()["error"]
            assert needle in err["message"] and set(err) == {"message", "type", "param", "code"}


async def test_caller_request_id(nats_url):
    async with gateway(nats_url) as (url, peers, _s):
        async with httpx.AsyncClient(base_url=url) as c:
            r = await c.post(
                "/v1/chat/completions", json=CHAT, headers={"x-request-id": "my-req_1"}
            )
            assert r.status_code == 200, r.text
            assert [i.request_id for i in peers.items] == ["my-req_1"]
            for bad in ("a.b", "x*", "y>", "sp ace"):  # would reach other requests' subjects
                r = await c.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": bad})
                assert r.status_code == 400 and "request id" in r.json()["error"]["message"]
            assert len(peers.items) == 1  # nothing was tokenized, routed or submitted


async def test_body_limit_and_no_decode_is_fast_503(nats_url):
    async with gateway(nats_url, decodes=(), max_body_bytes=2048) as (url, _, _s):
        async with httpx.AsyncClient(base_url=url) as c:
            r = await c.post("/v1/chat/completions", json={**CHAT, "pad": "x" * 4000})
            assert r.status_code == 400 and "larger than 2048" in r.json()["error"]["message"]
            t0 = asyncio.get_running_loop().time()
            r = await c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
            assert asyncio.get_running_loop().time() - t0 < 1.5
            assert (await c.get("/health")).status_code == 503


async def test_disconnect_publishes_cancel(nats_url):
    async with gateway(nats_url) as (url, peers, _):
        peers.decodes["dec-0"]["gap"] = 0.2
        async with httpx.AsyncClient(base_url=url) as c:
            body = {**CHAT, "stream": True, "max_tokens": 50}
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if '"t0 "' in line:
                        break
        rid = peers.items[0].request_id
        for _ in range(100):
            if rid in peers.cancels:
                break
            await asyncio.sleep(0.02)
        assert rid in peers.cancels


@pytest.mark.parametrize("batched", [False, True], ids=["per-request", "per-gateway"])
async def test_failover_dedupes_indices(nats_url, batched):
    """Chunks on the request's subject or batched on the gateway's (`TokenChunkBatch`, as
    decode sends them): a resumed instance's repeats are dropped by index either way."""
    async with gateway(nats_url, decodes=(), stall_timeout=0.3) as (url, peers, service):
        await peers.add_decode("dec-a", stall_after=2, batched=batched)
        await peers.add_decode("dec-b", resend=True, batched=batched)
        async with httpx.AsyncClient(base_url=url) as c:
            r = await c.post(
                "/v1/completions",
                json={"model": "tiny", "prompt": "ab", "max_tokens": 5, "stream": True},
            )
            events = sse_events(r.text)
        text = "".join(e["choices"][0]["text"] for e in events)
        assert text == "t0 t1 t2 t3 t4 "
        assert [i.output_token_ids for i in peers.items] == [[], [100, 101]]
        assert peers.routes[1].exclude == ["dec-a"]
        assert peers.items[0].request_id in peers.cancels  # the stalled instance is told to stop
        gw = service.pipeline.gateway_id
        assert gw and {i.gateway_id for i in peers.items} == {gw}
        assert peers.batches == (2 + 5 if batched else 0)  # dec-b resent 2 of its 5


async def test_route_and_submit_in_one_hop(nats_url):
    """The scheduler submits the work it routed (as the routed instance's message: a decode
    instance gets a `DecodeWork`); the gateway reads the instance's ack and chunks without a
    submit round trip of its own."""
    async with gateway(nats_url) as (url, peers, _):
        async with httpx.AsyncClient(base_url=url) as c:
            r = await c.post(
                "/v1/completions", json={"model": "tiny", "prompt": "ab", "max_tokens": 2}
            )
        assert r.json()["choices"][0]["text"] == "t0 t1 "
        assert len(peers.routes) == 1 and peers.routes[0].submit is not None
        item = peers.items[0]
        assert isinstance(item, DecodeWork) and item.first_token_id is None
        assert item.request_id == peers.routes[0].request_id


@pytest.mark.parametrize("how", ["no_subscriber", "refused"])
async def test_failover_when_the_routed_instance_does_not_take_the_submit(nats_url, how):
    """A forwarded submit nobody listens for (the server's no-responders status reaches the
    gateway on the ack subject) or that the instance refuses fails over at once, excluding it."""
    async with gateway(nats_url, decodes=(), bus_timeout=30.0) as (url, peers, _):
        if how == "no_subscriber":
            peers.alive.append("dec-a")  # routable, but nothing serves its submit subject
        else:
            await peers.add_decode("dec-a", refuse=True)
        await peers.add_decode("dec-b")
        async with httpx.AsyncClient(base_url=url, timeout=10) as c:
            r = await c.post(
                "/v1/completions", json={"model": "tiny", "prompt": "ab", "max_tokens": 3}
            )
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "t0 t1 t2 "
        assert [rt.exclude for rt in peers.routes] == [[], ["dec-a"]]


async def test_failover_on_down_state(nats_url):
    from shared.protocol import subjects
    from shared.protocol.sched import SchedulerState

    async with gateway(nats_url, decodes=()) as (url, peers, _):
        await peers.add_decode("dec-a", stall_after=1)
        await peers.add_decode("dec-b")
        async with httpx.AsyncClient(base_url=url) as c:
            task = asyncio.create_task(
                c.post("/v1/completions", json={"model": "tiny", "prompt": "ab", "max_tokens": 3})
            )
            while not peers.items:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            from shared import bus

            await bus.publish(peers.nc, subjects.SCHED_STATE, SchedulerState(down=["dec-a"]))
            r = await task
        assert r.json()["choices"][0]["text"] == "t0 t1 t2 "
        assert peers.items[1].output_token_ids == [100]
