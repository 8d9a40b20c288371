"""Crash-proof input and real statuses: bodies that used to be 500s are 400s and leave the
keep-alive connection usable; a stream that fails before its first token gets the real status;
with API keys on, only the health probes are open."""

from __future__ import annotations

import json

import httpx
import msgpack
import pytest

from shared import bus
from shared.protocol import subjects
from shared.protocol.api import GenerateEvent
from shared.protocol.codec import decode, encode
from shared.protocol.errors import ErrorInfo, StrataError
from shared.protocol.sched import InstancesRequest, RouteRequest
from shared.protocol.stream import TokenChunk
from shared.protocol.work import DecodeWork, SubmitAck
from tests.gateway.harness import gateway

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
DEEP = b'{"model": "tiny", "x": ' + b"[" * 1500 + b"]" * 1500 + b"}"
SURROGATE = b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}'
HUGE_INT = (
    b'{"model": "tiny", "messages": [{"role": "tool", "content": "x", "n": 1' + b"0" * 30 + b"}]}"
)
LONG_INT = b'{"model": "tiny", "max_tokens": 1' + b"0" * 5000 + b"}"


def client_port(r: httpx.Response) -> int:
    """The client-side port of the connection that carried ``r``."""
    return r.extensions["network_stream"].get_extra_info("client_addr")[1]


async def test_bad_bodies_are_400s_on_a_connection_that_stays_open(nats_url):
    async with gateway(nats_url) as (url, peers, service):
        async with httpx.AsyncClient(base_url=url) as c:
            first = await c.post("/v1/chat/completions", json=CHAT)
            assert first.status_code == 200, first.text
            port = client_port(first)
            for body, needle, param in (
                (DEEP, "nested too deeply", None),
                (SURROGATE, "lone UTF-16 surrogate", "messages.0.content"),
                (HUGE_INT, "integer out of range", None),  # msgpack holds 64 bits
                (LONG_INT, "integer out of range", None),  # past Python's digit limit too
            ):
                for path in ("/v1/chat/completions", "/v1/completions"):
                    r = await c.post(
                        path, content=body, headers={"content-type": "application/json"}
                    )
                    assert r.status_code == 400, r.text
                    err = r.json()["error"]
                    assert needle in err["message"] and err["param"] == param
                    ok = await c.post("/v1/chat/completions", json=CHAT)
                    assert ok.status_code == 200 and client_port(ok) == port
            assert len(peers.items) == 1 + 8  # the bad bodies reached no peer

            # any unexpected error: a 500 body, and the connection still serves the next one
            real_open = service.open

            async def boom(*a, **kw):
                raise RuntimeError("synthetic failure")

            service.open = boom
            r = await c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 500 and "synthetic failure" in r.json()["error"]["message"]
            service.open = real_open
            ok = await c.post("/v1/chat/completions", json=CHAT)
            assert ok.status_code == 200 and client_port(ok) == port


async def test_nats_api_bad_bodies_are_400_events(nats_url, nc):
    async def ask(data: bytes) -> GenerateEvent:
        return decode(
            (await nc.request(subjects.API_GENERATE, data, timeout=5)).data, GenerateEvent
        )

    head = msgpack.packb("kind") + msgpack.packb("chat") + msgpack.packb("body")
    deep = b"\x82" + head + b"\x81" + msgpack.packb("x") + b"\x91" * 1500 + b"\x90"
    lone = b"\x82" + head + msgpack.packb({"model": "\ud800"}, unicode_errors="surrogatepass")
    async with gateway(nats_url):
        for data, needle in ((deep, "nested too deeply"), (lone, "utf-8")):
            ev = await ask(data)
            assert ev.done and ev.status == 400 and needle in ev.error.message, ev
        ev = await ask(encode_req(CHAT))
        assert ev.done and ev.status == 200 and ev.data["choices"][0]["message"]["content"]


def encode_req(body: dict) -> bytes:
    from shared.protocol.api import GenerateRequest

    return encode(GenerateRequest(kind="chat", body=body))


async def test_stream_errors_before_the_first_token_get_the_real_status(nats_url):
    async with gateway(nats_url) as (url, peers, _s):
        nc = peers.nc
        refuse: list[StrataError] = []

        async def route(req: RouteRequest):
            if refuse:
                raise refuse[0]
            return await peers.route(req)

        await peers.stop_role("scheduler")
        peers.subs.append(await bus.serve(nc, subjects.SCHED_ROUTE, RouteRequest, route))
        peers.subs.append(
            await bus.serve(nc, subjects.SCHED_INSTANCES, InstancesRequest, peers.insts)
        )
        async with httpx.AsyncClient(base_url=url) as c:
            cases = [
                (StrataError("overloaded", "cluster overloaded", retry_after=2.0), 429),
                (StrataError("unavailable", "no decode instance is available"), 503),
                (StrataError("bad_request", "prompt too long for the pool"), 400),
            ]
            for err, status in cases:
                refuse[:] = [err]
                for path, body in (
                    ("/v1/chat/completions", {**CHAT, "stream": True}),
                    (
                        "/v1/completions",
                        {"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": True},
                    ),
                ):
                    r = await c.post(path, json=body)
                    assert r.status_code == status, r.text
                    assert r.headers["content-type"].startswith("application/json")
                    assert r.json()["error"]["message"] == err.message
                    if status == 429:
                        assert r.headers["retry-after"] == "2"
            refuse.clear()

            # a decode instance that fails after its first token: the stream is already 200
            async def late_failure(item: DecodeWork) -> SubmitAck:
                out = subjects.req_out(item.request_id)
                await bus.publish(
                    nc,
                    out,
                    TokenChunk(
                        request_id=item.request_id,
                        index=0,
                        token_ids=[5],
                        text="t0 ",
                        instance_id="dec-late",
                    ),
                )
                await bus.publish(
                    nc,
                    out,
                    TokenChunk(
                        request_id=item.request_id,
                        index=1,
                        instance_id="dec-late",
                        error=ErrorInfo(code="internal", message="engine fell over"),
                    ),
                )
                return SubmitAck(instance_id="dec-late")

            peers.subs.append(
                await bus.serve(nc, subjects.decode_submit("dec-late"), DecodeWork, late_failure)
            )
            peers.alive[:] = ["dec-late"]
            r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event")
            lines = [ln[6:] for ln in r.text.split("\n") if ln.startswith("data: ")]
            assert lines[-1] == "[DONE]"
            assert json.loads(lines[-2])["error"]["message"] == "engine fell over"
            assert any('"t0 "' in ln for ln in lines[:-2])


@pytest.mark.parametrize("path", ["/v1/models", "/metrics", "/docs", "/openapi.json", "/nope"])
async def test_with_keys_on_only_probes_are_open(nats_url, path):
    async with gateway(nats_url, api_keys="sk-1") as (url, _p, _s):
        async with httpx.AsyncClient(base_url=url) as c:
            for probe in ("/health", "/health/live", "/health/ready"):
                assert (await c.get(probe)).status_code == 200
            r = await c.get(path)
            assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
            assert (await c.get(path, headers={"Authorization": "Bearer sk-2"})).status_code == 401
            r = await c.get(path, headers={"Authorization": "Bearer sk-1"})
            assert r.status_code == (404 if path == "/nope" else 200)


async def test_openapi_documents_error_statuses(nats_url):
    async with gateway(nats_url) as (url, _p, _s):
        async with httpx.AsyncClient(base_url=url) as c:
            schema = (await c.get("/openapi.json")).json()
    for path in ("/v1/chat/completions", "/v1/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert {"400", "401", "404", "429", "503"} <= set(responses), path
        ref = responses["429"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == "#/components/schemas/ErrorResponse"
        assert "Retry-After" in responses["503"]["headers"]
    assert "401" in schema["paths"]["/v1/models"]["get"]["responses"]
    assert "401" not in schema["paths"]["/health/live"]["get"]["responses"]
    assert "error" in schema["components"]["schemas"]["ErrorResponse"]["properties"]
