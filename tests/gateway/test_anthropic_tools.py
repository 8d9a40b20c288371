"""Anthropic's Messages API through the official ``anthropic`` SDK against a real gateway (real
nats-server, fake peers: decode emits ``t<i> `` or a scripted text): text messages and streams
as the SDK accumulates them, tool use (``tools``, ``tool_choice``, ``tool_use`` blocks out,
``tool_result`` blocks back in) over the chat path's tool-call parser, and 400s naming the
problem in Anthropic's error shape."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway.harness import gateway

anthropic_sdk = pytest.importorskip("anthropic")

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
TOOL = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
USER = [{"role": "user", "content": "weather in Oslo?"}]


def _client(url: str):
    return anthropic_sdk.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)


async def test_text_message_and_stream_through_the_sdk(nats_url):
    async with gateway(nats_url) as (url, _, _s):
        client = _client(url)
        m = await client.messages.create(model="tiny", max_tokens=3, messages=USER)
        assert m.content[0].type == "text" and m.content[0].text == "t0 t1 t2 "
        assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3
        async with client.messages.stream(model="tiny", max_tokens=2, messages=USER) as s:
            kinds = [ev.type async for ev in s]
            final = await s.get_final_message()
        assert final.content[0].text == "t0 t1 " and final.stop_reason == "max_tokens"
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"


async def test_tool_use_blocks_out_and_tool_results_in(nats_url):
    async with gateway(nats_url) as (url, peers, _):
        client = _client(url)
        peers.script = ["Checking.", CALL]
        m = await client.messages.create(
            model="tiny",
            max_tokens=16,
            messages=USER,
            tools=[TOOL],
            tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        )
        assert [b.type for b in m.content] == ["text", "tool_use"]
        use = m.content[1]
        assert use.name == "get_weather" and use.input == {"city": "Oslo"} and use.id
        assert m.content[0].text == "Checking." and m.stop_reason == "tool_use"
        chat_tools = peers.tok_reqs[-1].tools
        assert chat_tools[0]["function"]["parameters"] == TOOL["input_schema"]
        assert peers.items[-1].sampling.structured is None  # auto: no forced call

        async with client.messages.stream(
            model="tiny", max_tokens=16, messages=USER, tools=[TOOL]
        ) as s:
            async for _ in s:
                pass
            final = await s.get_final_message()
        assert [b.type for b in final.content] == ["text", "tool_use"]
        assert final.content[1].input == {"city": "Oslo"} and final.stop_reason == "tool_use"
        assert final.content[0].text == "Checking."

        peers.script = ["It is sunny."]
        m = await client.messages.create(
            model="tiny",
            max_tokens=16,
            tools=[TOOL],
            messages=[
                *USER,
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Checking."},
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "get_weather",
                            "input": {"city": "Oslo"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 20C"},
                        {"type": "text", "text": "and tomorrow?"},
                    ],
                },
            ],
        )
        msgs = peers.tok_reqs[-1].messages
        assert [x["role"] for x in msgs] == ["user", "assistant", "tool", "user"]
        assert msgs[1]["content"] == "Checking."
        assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
        assert msgs[2] == {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 20C"}
        assert m.content[0].text == "It is sunny." and m.stop_reason == "end_turn"


async def test_tool_choice_any_and_tool_force_a_call(nats_url):
    async with gateway(nats_url) as (url, peers, _):
        client = _client(url)
        peers.script = [CALL]
        for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
            m = await client.messages.create(
                model="tiny", max_tokens=16, messages=USER, tools=[TOOL], tool_choice=choice
            )
            assert m.content[-1].type == "tool_use"
            sp = peers.items[-1].sampling
            assert sp.structured is not None and sp.structured.kind == "tool_calls"


@pytest.mark.parametrize(
    "extra,says",
    [
        ({"tool_choice": {"type": "any"}}, "tool_choice needs tools"),
        ({"tools": [TOOL], "tool_choice": {"type": "tool"}}, "needs a name"),
        ({"tools": [{"name": "x"}]}, "input_schema"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}],
                    }
                ]
            },
            "tool_use blocks belong to assistant messages",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
            "tool_result block needs tool_use_id",
        ),
    ],
)
async def test_bad_tool_bodies_are_400s(nats_url, extra, says):
    body = {"model": "tiny", "max_tokens": 4, "messages": USER, **extra}
    async with gateway(nats_url) as (url, _, _s):
        async with httpx.AsyncClient(base_url=url) as c:
            r = await c.post("/v1/messages", json=body)
        assert r.status_code == 400, r.text
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert says in err["error"]["message"], err
        with pytest.raises(anthropic_sdk.BadRequestError):
            await _client(url).messages.create(**body)
