"""Official openai client, NATS API, auth, image limits, degradation and EPD overlap."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import httpx
import openai
import pytest
from PIL import Image

from services.gateway.auth import Auth, KeyPolicy
from services.gateway.core import ApiError
from shared import bus
from shared.protocol import subjects
from shared.protocol.api import ApiCancel, GenerateEvent, GenerateRequest
from shared.protocol.codec import decode, encode
from shared.protocol.sched import DegradeRules, SchedulerState
from tests.gateway.harness import gateway

MSG = [{"role": "user", "content": "hi"}]


def data_url(size=(8, 8), fmt="PNG") -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, (10, 20, 30)).save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def image_msg(url: str) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "see"},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }
    ]


async def test_openai_client_parses_responses(nats_url):
    async with gateway(nats_url) as (url, _, _s):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        r = await client.chat.completions.create(
            model="tiny", messages=MSG, max_tokens=2, logprobs=True, top_logprobs=1
        )
        assert r.choices[0].message.content == "t0 t1 "
        assert r.usage.prompt_tokens_details.cached_tokens == 4
        assert [t.logprob for t in r.choices[0].logprobs.content] == [-0.5, -0.5]
        assert r.choices[0].logprobs.content[0].top_logprobs[0].logprob == -0.5
        stream = await client.chat.completions.create(
            model="tiny",
            messages=MSG,
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
        parts, use = [], None
        async for ch in stream:
            if ch.choices:
                parts.append(ch.choices[0].delta.content or "")
            use = ch.usage or use
        assert "".join(parts) == "t0 t1 t2 " and use.completion_tokens == 3
        c = await client.completions.create(
            model="tiny", prompt="ab", max_tokens=2, logprobs=1, echo=True
        )
        # echo + logprobs: the prompt's tokens first (the first has none), as vLLM gives them
        assert c.choices[0].text == "abt0 t1 " and c.choices[0].logprobs.token_logprobs == [
            None,
            -0.1,
            -0.5,
            -0.5,
        ]
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="nope", messages=MSG)


async def _subscribe_events(nc, subject: str):
    """(events, done, subscription): every `GenerateEvent` published on ``subject``, in order;
    ``done`` is set by the one that ends the request."""
    got: list[GenerateEvent] = []
    done = asyncio.Event()

    async def on_ev(msg):
        got.append(decode(msg.data, GenerateEvent))
        if got[-1].done:
            done.set()

    return got, done, await nc.subscribe(subject, cb=on_ev)


async def _publish_generate(nc, **request) -> None:
    """Publish a `GenerateRequest` on the NATS API, no reply awaited."""
    await nc.publish(subjects.API_GENERATE, encode(GenerateRequest(**request)))


def _finish_reasons(events: list[GenerateEvent]) -> list:
    return [e.data["choices"][0]["finish_reason"] for e in events if e.data and e.data["choices"]]


async def test_nats_api_request_stream_cancel_errors(nats_url, nc):
    async with gateway(nats_url) as (_, peers, _s):
        body = {"model": "tiny", "messages": MSG, "max_tokens": 2}
        rep = await nc.request(subjects.API_GENERATE, encode(GenerateRequest(body=body)), timeout=5)
        ev = decode(rep.data, GenerateEvent)
        assert ev.done and ev.data["choices"][0]["message"]["content"] == "t0 t1 "
        # streamed to a subject the caller names
        got, done, sub = await _subscribe_events(nc, "my.stream")
        await _publish_generate(
            nc, body={**body, "stream": True}, stream_subject="my.stream", request_id="rid-s"
        )
        await asyncio.wait_for(done.wait(), 5)
        text = "".join(
            e.data["choices"][0]["delta"].get("content", "")
            for e in got
            if e.data and e.data["choices"]
        )
        assert text == "t0 t1 " and all(e.request_id == "rid-s" for e in got)
        # cancel: the gateway relays it; a slow stream is cut short
        peers.decodes["dec-0"]["gap"] = 0.1
        got.clear()
        done.clear()
        await _publish_generate(
            nc,
            body={**body, "stream": True, "max_tokens": 40},
            stream_subject="my.stream",
            request_id="rid-c",
        )
        while not [
            e
            for e in got
            if e.data and e.data["choices"] and e.data["choices"][0]["delta"].get("content")
        ]:
            await asyncio.sleep(0.02)
        await nc.publish(subjects.req_cancel("rid-c"), b"")
        await asyncio.wait_for(done.wait(), 2)  # ends at once, not after max_tokens * gap
        await sub.unsubscribe()
        finals = _finish_reasons(got)
        assert finals[-1] == "abort" and len(finals) < 20
        # errors come back as an error event with the REST status
        rep = await nc.request(
            subjects.API_GENERATE,
            encode(GenerateRequest(body={**body, "model": "nope"})),
            timeout=5,
        )
        ev = decode(rep.data, GenerateEvent)
        assert ev.done and ev.status == 404 and ev.error.code == "not_found"
        rep = await nc.request(subjects.API_GENERATE, b"\xc1junk", timeout=5)
        assert decode(rep.data, GenerateEvent).status == 400
        # a caller-chosen id becomes part of subjects: dots and wildcards are refused
        for bad in ("a.b", "*", ">", "x" * 129):
            rep = await nc.request(
                subjects.API_GENERATE, encode(GenerateRequest(body=body, request_id=bad)), timeout=5
            )
            ev = decode(rep.data, GenerateEvent)
            assert ev.status == 400 and "request id" in ev.error.message, bad


async def test_nats_api_cancel_needs_the_key_and_stream_subject_stays_off_strata(nats_url, nc):
    """`strata.api.v1.cancel` ends only a request opened with the same api key (API users may
    not publish `strata.req.*.cancel` under NATS auth); a stream_subject on Strata's own
    subjects or with a wildcard is refused before anything runs."""
    async with gateway(nats_url) as (_, peers, _s):
        peers.decodes["dec-0"]["gap"] = 0.1
        body = {"model": "tiny", "messages": MSG, "max_tokens": 40, "stream": True}
        got, done, sub = await _subscribe_events(nc, "_INBOX.api.mine")
        await _publish_generate(
            nc, body=body, stream_subject="_INBOX.api.mine", request_id="rid-k", api_key="k1"
        )
        while sum(1 for e in got if e.data and e.data["choices"]) < 3:
            await asyncio.sleep(0.02)
        await nc.publish(subjects.API_CANCEL, encode(ApiCancel(request_id="rid-k", api_key="k2")))
        await nc.publish(subjects.API_CANCEL, encode(ApiCancel(request_id="other", api_key="k1")))
        await nc.flush()
        n = len(got)
        while len(got) < n + 3 and not done.is_set():  # wrong key, wrong id: nothing changes
            await asyncio.sleep(0.02)
        assert not done.is_set()
        await nc.publish(subjects.API_CANCEL, encode(ApiCancel(request_id="rid-k", api_key="k1")))
        await asyncio.wait_for(done.wait(), 2)  # ends at once, not after max_tokens * gap
        await sub.unsubscribe()
        finals = _finish_reasons(got)
        assert finals[-1] == "abort" and len(finals) < 30
        for bad in (
            "strata.req.x.cancel",
            "strata.req.x.out",
            "$JS.API.STREAM.DELETE.S",
            "_INBOX.api.*",
            "a..b",
        ):
            rep = await nc.request(
                subjects.API_GENERATE,
                encode(GenerateRequest(body=body, stream_subject=bad)),
                timeout=5,
            )
            ev = decode(rep.data, GenerateEvent)
            assert ev.status == 400 and "stream_subject" in ev.error.message, bad


async def test_auth_statuses(nats_url, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(
        json.dumps(
            {"keys": {"sk-a": {"models": ["tiny"], "rpm": 2}, "sk-b": {"models": ["other"]}}}
        )
    )
    async with gateway(nats_url, api_key_file=str(keys)) as (url, _, _s):
        async with httpx.AsyncClient(base_url=url) as c:
            body = {"model": "tiny", "messages": MSG, "max_tokens": 1}

            async def post(key):
                h = {"Authorization": f"Bearer {key}"} if key else {}
                return await c.post("/v1/chat/completions", json=body, headers=h)

            r = await post(None)
            assert r.status_code == 401 and "missing API key" in r.json()["error"]["message"]
            r = await post("sk-wrong")
            assert r.status_code == 401 and "invalid API key" in r.json()["error"]["message"]
            r = await post("sk-b")
            assert r.status_code == 403 and "may not use model" in r.json()["error"]["message"]
            assert (await post("sk-a")).status_code == 200
            assert (await post("sk-a")).status_code == 200
            r = await post("sk-a")
            assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1


def test_rate_limit_tokens_refill():
    now = [0.0]
    auth = Auth({"k": KeyPolicy("k", tpm=600)}, clock=lambda: now[0])
    pol = auth.authenticate("Bearer k", "m")
    auth.charge(pol, 600)
    with pytest.raises(ApiError) as ei:
        auth.charge(pol, 100)
    assert ei.value.code == "rate_limited" and ei.value.retry_after == pytest.approx(10.0)
    now[0] = 10.0
    auth.charge(pol, 100)
    with pytest.raises(ApiError, match="over this key's limit"):
        auth.charge(pol, 601)
    assert Auth({}).authenticate(None, "m") is None  # auth off by default


async def test_images_limits_and_epd_overlap(nats_url, tmp_path):
    (tmp_path / "ok.png").write_bytes(base64.b64decode(data_url().split(",")[1]))
    async with gateway(
        nats_url,
        peers_kw={"delay": 0.3, "max_model_len": 256},
        max_images=1,
        max_image_pixels=10_000,
        image_dir=str(tmp_path),
        image_formats="PNG",
    ) as (url, peers, _s):
        async with httpx.AsyncClient(base_url=url) as c:

            async def post(messages):
                return await c.post(
                    "/v1/chat/completions",
                    json={"model": "tiny", "messages": messages, "max_tokens": 1},
                )

            r = await post(image_msg(data_url()))
            assert r.status_code == 200, r.text
            item = peers.items[-1]
            assert len(item.images) == 1 and item.images[0].length == 4
            assert item.images[0].source_addr == "127.0.0.1:1"
            tok, vis = peers.windows["tok"], peers.windows["vis"]
            assert tok[0] < vis[1] and vis[0] < tok[1]  # tokenize and encode overlapped
            assert (await post(image_msg(str(tmp_path / "ok.png")))).status_code == 200
            cases = [
                (image_msg(data_url()) + image_msg(data_url()), 400, "at most 1 images"),
                (image_msg(data_url((200, 200))), 400, "the limit is 10000"),
                (image_msg(data_url(fmt="JPEG")), 400, "format JPEG is not accepted"),
                (image_msg("data:image/png;base64,@@@"), 400, "not valid base64"),
                (image_msg("data:image/png;base64,aGVsbG8="), 400, "not a decodable image"),
                (image_msg("http://169.254.169.254/x.png"), 403, "remote image URLs is disabled"),
                (image_msg("/etc/passwd"), 403, "outside the allowed image folder"),
            ]
            for messages, status, needle in cases:
                r = await post(messages)
                assert r.status_code == status and needle in r.json()["error"]["message"], r.text


async def test_degradation_levels(nats_url, nc):
    async with gateway(nats_url, peers_kw={"max_model_len": 256}) as (url, peers, service):
        async with httpx.AsyncClient(base_url=url) as c:
            # the scheduler's rules, deliberately unlike any default: the gateway must apply these
            rules = DegradeRules(batch_max_tokens_cap=40, top_priority=0, retry_after_s=7.0)

            async def set_level(level):
                await bus.publish(
                    nc, subjects.SCHED_STATE, SchedulerState(degrade_level=level, rules=rules)
                )
                for _ in range(100):
                    if service.pipeline.degrade_level == level:
                        return
                    await asyncio.sleep(0.01)

            body = {"model": "tiny", "messages": MSG, "max_tokens": 100, "slo_class": "batch"}
            await set_level(1)
            assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
            assert (
                peers.items[-1].sampling.max_tokens == 40 and peers.routes[-1].slo_class == "batch"
            )
            await set_level(2)
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 429 and r.headers["Retry-After"] == "7"
            inter = {**body, "slo_class": "interactive", "max_tokens": 2}
            assert (await c.post("/v1/chat/completions", json=inter)).status_code == 200
            await set_level(3)
            r = await c.post("/v1/chat/completions", json=inter, headers={"X-Strata-Priority": "5"})
            assert r.status_code == 429 and "top-priority" in r.json()["error"]["message"]
            r = await c.post("/v1/chat/completions", json=inter, headers={"X-Strata-Priority": "0"})
            assert r.status_code == 200 and peers.routes[-1].priority == 0
            await set_level(0)


async def test_a_request_id_is_one_open_run_across_rest_and_the_nats_api(nats_url, nc):
    """Request ids name bus subjects, so one id is one open run on a gateway, whichever way it
    came: REST's ``x-request-id`` equal to a live NATS API request's id is a 400 naming it (and
    the other way round); once the run ends the id is free again."""
    async with gateway(nats_url) as (url, peers, _s):
        peers.decodes["dec-0"]["gap"] = 0.1
        body = {"model": "tiny", "messages": MSG, "max_tokens": 30, "stream": True}
        got, done, sub = await _subscribe_events(nc, "my.stream")
        await _publish_generate(nc, body=body, stream_subject="my.stream", request_id="rid-x")
        while not got:  # the NATS run is open and streaming
            await asyncio.sleep(0.02)
        async with httpx.AsyncClient(base_url=url, timeout=10) as c:
            short = {**body, "stream": False, "max_tokens": 2}
            r = await c.post("/v1/chat/completions", json=short, headers={"x-request-id": "rid-x"})
            assert r.status_code == 400 and "rid-x" in r.json()["error"]["message"], r.text
            assert "in use" in r.json()["error"]["message"]
            await nc.publish(subjects.req_cancel("rid-x"), b"")
            await asyncio.wait_for(done.wait(), 5)
            await asyncio.sleep(0.1)  # the NATS run closes after its last event
            r = await c.post("/v1/chat/completions", json=short, headers={"x-request-id": "rid-x"})
            assert r.status_code == 200, r.text  # free again
            # a REST stream holds its id against the NATS API too
            async with c.stream(
                "POST", "/v1/chat/completions", json=body, headers={"x-request-id": "rid-y"}
            ) as live:
                assert live.status_code == 200
                got.clear()
                done.clear()
                await _publish_generate(
                    nc, body=body, stream_subject="my.stream", request_id="rid-y"
                )
                await asyncio.wait_for(done.wait(), 5)
                assert got[-1].error and "in use" in got[-1].error.message
        await sub.unsubscribe()
        ids = [i.request_id for i in peers.items]
        assert ids.count("rid-x") == 2 and ids.count("rid-y") == 1  # refusals reached no engine
