"""OpenAI's Responses API (``POST /v1/responses``) through the official ``openai`` SDK against
a real gateway (real nats-server, fake peers: decode emits ``t<i> `` or a scripted text): the
chat body each request becomes, the response and stream events as the SDK parses them, function
calls through the tool-call parser, ``text.format`` as the structured-output constraint, and the
400s naming what is wrong or not supported (stateless: no store, no previous_response_id)."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.gateway.harness import gateway

openai = pytest.importorskip("openai")

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def _client(url: str):
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


async def test_text_response_and_stream_as_the_sdk_parses_them(nats_url):
    async with gateway(nats_url) as (url, peers, _):
        client = _client(url)
        r = await client.responses.create(
            model="tiny", input="hi", instructions="be brief", max_output_tokens=3
        )
        assert r.object == "response" and r.id.startswith("resp_")
        assert r.output_text == "t0 t1 t2 "
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert r.usage.input_tokens == len("be briefhi") and r.usage.output_tokens == 3
        assert r.store is False
        tok = peers.tok_reqs[-1]
        assert [m["role"] for m in tok.messages] == ["system", "user"]
        assert peers.items[-1].sampling.max_tokens == 3

        stream = await client.responses.create(
            model="tiny",
            input=[{"role": "user", "content": "hi"}],
            max_output_tokens=2,
            stream=True,
        )
        events = [ev async for ev in stream]
        kinds = [e.type for e in events]
        assert kinds == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.incomplete",
        ]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert "".join(e.delta for e in events if e.type.endswith("text.delta")) == "t0 t1 "
        assert events[6].text == "t0 t1 "
        assert events[-1].response.output_text == "t0 t1 "
        assert events[-1].response.usage.output_tokens == 2

        peers.script = ["a", "b"]  # ends before max_output_tokens: completed
        async with client.responses.stream(model="tiny", input="hi") as s:
            got = [ev.type async for ev in s]
            final = await s.get_final_response()
        assert got[-1] == "response.completed" and final.output_text == "ab"


async def test_function_calls_and_their_outputs(nats_url):
    async with gateway(nats_url) as (url, peers, _):
        client = _client(url)
        peers.script = ["Let me check.", CALL]
        r = await client.responses.create(model="tiny", input="weather in Oslo?", tools=[TOOL])
        kinds = [o.type for o in r.output]
        assert kinds == ["message", "function_call"], r.output
        call = r.output[1]
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
        assert r.output_text == "Let me check." and r.status == "completed"
        chat_tools = peers.tok_reqs[-1].tools
        assert chat_tools[0]["function"]["name"] == "get_weather"

        stream = await client.responses.create(
            model="tiny", input="weather?", tools=[TOOL], stream=True
        )
        events = [ev async for ev in stream]
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert len(done) == 1 and json.loads(done[0].arguments) == {"city": "Oslo"}
        final = events[-1].response
        assert [o.type for o in final.output] == ["message", "function_call"]
        assert final.output[1].call_id and final.output[1].id.startswith("fc_")

        peers.script = ["sunny"]
        r = await client.responses.create(
            model="tiny",
            tools=[TOOL],
            input=[
                {"role": "user", "content": "weather?"},
                {
                    "type": "function_call",
                    "call_id": "call_1",
                    "name": "get_weather",
                    "arguments": '{"city": "Oslo"}',
                },
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 20C"},
            ],
        )
        msgs = peers.tok_reqs[-1].messages
        assert [m["role"] for m in msgs] == ["user", "assistant", "tool"]
        assert msgs[1]["tool_calls"][0]["function"]["name"] == "get_weather"
        assert msgs[2]["tool_call_id"] == "call_1" and msgs[2]["content"] == "sunny, 20C"
        assert r.output_text == "sunny"


async def test_text_format_json_schema_is_the_structured_constraint(nats_url):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    async with gateway(nats_url) as (url, peers, _):
        client = _client(url)
        peers.script = ['{"a": 1}']
        r = await client.responses.create(
            model="tiny",
            input="give a",
            text={"format": {"type": "json_schema", "name": "A", "schema": schema}},
        )
        sp = peers.items[-1].sampling
        assert sp.structured is not None and sp.structured.kind == "json_schema"
        assert json.loads(sp.structured.spec) == schema
        assert json.loads(r.output_text) == {"a": 1}
        assert r.text.format.type == "json_schema"


@pytest.mark.parametrize(
    "body,param,says",
    [
        ({"store": True}, "store", "keeps no responses"),
        ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
        ({"input": []}, "input", "at least 1"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "input.0.role", "'input.0.role'"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input", "call_id"),
        ({"input": [{"type": "message", "content": "x"}]}, "input", "needs a role"),
        ({"reasoning": {"effort": "max"}}, "reasoning.effort", "'reasoning.effort'"),
        (
            {"input": [{"role": "user", "content": [{"type": "reasoning_text", "text": "x"}]}]},
            "input",
            "reasoning item",
        ),
        ({"include": ["reasoning.encrypted_content"]}, "include", "unknown field"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "needs a schema"),
        ({"max_output_tokens": 0}, "max_output_tokens", "greater"),
    ],
)
async def test_bad_bodies_are_400s_naming_the_problem(nats_url, body, param, says):
    async with gateway(nats_url) as (url, _, _s):
        async with httpx.AsyncClient(base_url=url) as c:
            r = await c.post("/v1/responses", json={"model": "tiny", "input": "hi", **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["param"] or "").startswith(param), err
        assert says in err["message"], err
        client = _client(url)
        with pytest.raises(openai.BadRequestError):
            await client.responses.create(**{"model": "tiny", "input": "hi", **body})


def test_cache_salt_goes_to_the_chat_body():
    from services.gateway.responses_api import parse_request, to_chat

    assert to_chat(parse_request({"model": "m", "input": "hi", "cache_salt": "s"}))["cache_salt"]
    assert "cache_salt" not in to_chat(parse_request({"model": "m", "input": "hi"}))


def test_docs_responses_table_is_true_to_the_schema():
    """Every field docs/api.md's Responses table lists is in the schema, or is a 400 naming it
    when it says refused."""
    import pathlib

    from services.gateway.core import ApiError
    from services.gateway.responses_api import ResponsesRequest, parse_request

    doc = (pathlib.Path(__file__).parents[2] / "docs" / "api.md").read_text()
    table = doc.split("## OpenAI Responses API", 1)[1].split("\n## ", 1)[0]
    rows = [
        [c.strip() for c in r.split("|")[1:-1]] for r in table.splitlines() if r.startswith("| `")
    ]
    assert len(rows) >= 8
    for cells in rows:
        for name in re.findall(r"`([a-z_.]+)`", cells[0]):
            if cells[-1].startswith("refused"):
                with pytest.raises(ApiError) as ei:
                    parse_request({"model": "m", "input": "hi", name: True})
                assert ei.value.param == name, name
            else:
                assert name.split(".")[0] in ResponsesRequest.model_fields, name
