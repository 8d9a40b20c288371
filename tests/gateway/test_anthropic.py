"""Anthropic's Messages API over the chat path: the pure translation (exact events for given
chunks) and the routes against fake peers with plain httpx, checked against the documented
event shapes (tests/gateway/test_anthropic_tools.py drives them with the official SDK)."""

from __future__ import annotations

import json

import httpx
import pytest

from services.gateway import anthropic
from services.gateway.core import ApiError
from tests.gateway.harness import gateway

BODY = {"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
COUNT = {k: v for k, v in BODY.items() if k != "max_tokens"}  # count_tokens takes no max_tokens
EVENT_ORDER = [
    "message_start",
    "content_block_start",
    *["content_block_delta"] * 3,
    "content_block_stop",
    "message_delta",
    "message_stop",
]


def sse(text: str) -> list[tuple[str, dict]]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(ln.split(": ", 1) for ln in block.split("\n"))
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        out.append((lines["event"], data))
    return out


def test_to_chat_maps_system_stops_and_a_prefilled_answer():
    req = anthropic.parse_messages(
        {
            **BODY,
            "system": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": "Sure:"},
            ],
            "stop_sequences": ["END"],
            "temperature": 0.5,
            "top_k": 4,
            "metadata": {"user_id": "u1"},
        }
    )
    assert anthropic.to_chat(req) == {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": "Sure:"},
        ],
        "max_tokens": 3,
        "stream": False,
        "add_generation_prompt": False,
        "continue_final_message": True,
        "stop": ["END"],
        "include_stop_str_in_output": True,
        "temperature": 0.5,
        "top_k": 4,
        "user": "u1",
    }


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"temperature": 1.5}, "temperature"),
        ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "enabled", "budget_tokens": 10}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "sometimes"}}, "thinking.type"),
        ({"stop_sequences": [""]}, "stop_sequences"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ],
)
def test_bad_bodies_name_the_field(extra, param):
    body = {k: v for k, v in {**BODY, **extra}.items() if v is not None}
    with pytest.raises(ApiError) as ei:
        anthropic.parse_messages(body)
    assert ei.value.http_status == 400 and ei.value.param == param


def _chunk(text: str = "", finish: str | None = None, usage: dict | None = None) -> dict:
    choices = [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]
    return {"choices": [] if usage else choices, **({"usage": usage} if usage else {})}


def test_event_stream_holds_back_and_drops_the_stop_sequence():
    req = anthropic.parse_messages({**BODY, "stop_sequences": ["STOP", "X"]})
    es = anthropic.EventStream(req, "r1", 7)
    start = es.start()
    assert start[0][1]["message"]["usage"] == {"input_tokens": 7, "output_tokens": 0}
    assert start[1][1]["content_block"] == {"type": "text", "text": ""}
    got = []
    for ch in (_chunk("Hello wor"), _chunk("ld ST"), _chunk("OP", "stop")):
        got += es.feed(ch)
    es.feed(_chunk(usage={"completion_tokens": 5}))
    got += es.end()
    text = "".join(d["delta"]["text"] for k, d in got if k == "content_block_delta")
    assert text == "Hello world "
    assert got[-2] == (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": "stop_sequence", "stop_sequence": "STOP"},
            "usage": {"output_tokens": 5},
        },
    )
    assert got[-1] == ("message_stop", {"type": "message_stop"})
    assert anthropic.split_stop("abc", "stop", ["X"]) == ("abc", "end_turn", None)
    assert anthropic.split_stop("abc", "length", ["c"]) == ("abc", "max_tokens", None)


async def test_messages_non_streaming_streaming_and_count_tokens(nats_url):
    async with gateway(nats_url) as (url, peers, _):
        async with httpx.AsyncClient(base_url=url) as c:
            r = await c.post("/v1/messages", json={**BODY, "system": "be brief"})
            assert r.status_code == 200, r.text
            m = r.json()
            assert m["type"] == "message" and m["role"] == "assistant" and m["model"] == "tiny"
            assert m["id"].startswith("msg_")
            assert m["content"] == [{"type": "text", "text": "t0 t1 t2 "}]
            assert m["stop_reason"] == "max_tokens" and m["stop_sequence"] is None
            prompt = [ord(ch) for ch in "be brief"] + [104, 105]
            assert peers.items[-1].prompt_token_ids == prompt
            assert m["usage"] == {"input_tokens": len(prompt), "output_tokens": 3}
            r = await c.post("/v1/messages", json={**BODY, "stream": True})
            assert r.headers["content-type"].startswith("text/event-stream")
            events = sse(r.text)
            assert [k for k, _ in events] == EVENT_ORDER
            assert events[0][1]["message"]["usage"]["input_tokens"] == 2
            deltas = [d["delta"] for k, d in events if k == "content_block_delta"]
            assert deltas == [{"type": "text_delta", "text": f"t{i} "} for i in range(3)]
            assert events[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
            assert events[-2][1]["usage"] == {"output_tokens": 3}
            r = await c.post("/v1/messages/count_tokens", json={**COUNT, "system": "ab"})
            assert r.json() == {"input_tokens": 4}
            r = await c.post("/v1/messages", json={**BODY, "model": "nope"})
            assert r.status_code == 404
            assert r.json() == {
                "type": "error",
                "error": {
                    "type": "not_found_error",
                    "message": "model 'nope' does not exist; this gateway serves 'tiny'",
                },
            }


async def test_x_api_key_is_accepted(nats_url, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": {"sk-a": {"models": ["tiny"]}}}))
    async with gateway(nats_url, api_key_file=str(keys)) as (url, _, _s):
        async with httpx.AsyncClient(base_url=url) as c:
            r = await c.post("/v1/messages", json=BODY)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            r = await c.post("/v1/messages", json=BODY, headers={"x-api-key": "sk-a"})
            assert r.status_code == 200, r.text
            r = await c.post("/v1/messages/count_tokens", json=COUNT, headers={"x-api-key": "sk-a"})
            assert r.json() == {"input_tokens": 2}


async def test_stream_disconnect_cancels_on_the_bus(nats_url):
    import asyncio

    async with gateway(nats_url) as (url, peers, _):
        peers.decodes["dec-0"]["gap"] = 0.2
        async with httpx.AsyncClient(base_url=url) as c:
            body = {**BODY, "max_tokens": 50, "stream": True}
            async with c.stream("POST", "/v1/messages", json=body) as r:
                async for line in r.aiter_lines():
                    if '"t0 "' in line:
                        break
        rid = peers.items[-1].request_id
        for _ in range(100):
            if rid in peers.cancels:
                break
            await asyncio.sleep(0.02)
        assert rid in peers.cancels
