"""The reasoning parser (`services.gateway.reasoning`, ``reasoning_parser``): a chat answer's
``<think>`` block goes to ``reasoning_content``, the rest to ``content`` (and to the tool-call
parser), streamed or not, with a tag split over chunks never shown; off by default. Real
nats-server, fake peers scripted to emit the answer's text pieces (`tests/gateway/peers.py`)."""

from __future__ import annotations

import itertools
import json

import httpx
import pytest

from services.gateway.config import GatewayConfig
from services.gateway.reasoning import ThinkSplitter, opens_in_reasoning, split
from tests.gateway.harness import gateway
from tests.gateway.test_rest import sse_events

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 32}
PIECES = ["<th", "ink>", "plan ", "it", "</th", "ink>", "\n\nThe ", "answer"]


def test_split_whole_outputs():
    assert split("<think>plan</think>\n\nok") == ("plan", "\n\nok")
    assert split("  \n<think>a</think>b") == ("a", "b")  # whitespace before the tag
    assert split("plain answer") == (None, "plain answer")
    assert split("<think>cut by max_tokens") == ("cut by max_tokens", "")
    assert split("plan</think>ok", in_reasoning=True) == ("plan", "ok")  # the template opened it
    assert split("no tags at all", in_reasoning=True) == ("no tags at all", "")
    assert split("a <think> in the middle") == (None, "a <think> in the middle")
    assert opens_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not opens_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("text", ["<think>plan it</think>\n\nThe answer", "x<think>y</think>z"])
def test_any_chunking_gives_the_whole_split_and_never_a_piece_of_a_tag(text):
    want = split(text)
    for cuts in itertools.combinations(range(1, len(text)), 3):
        pieces = [text[a:b] for a, b in zip((0, *cuts), (*cuts, len(text)), strict=True)]
        s = ThinkSplitter()
        got = [s.feed(p) for p in pieces] + [s.finish()]
        reasoning, content = "".join(r for r, _ in got), "".join(c for _, c in got)
        assert (reasoning if want[0] is not None else None, content) == want, pieces
        if want[0] is not None:
            assert not any("<" in r or ">" in r for r, _ in got), pieces


def test_unknown_parser_is_refused_at_start():
    with pytest.raises(ValueError, match="unknown reasoning parser 'qwen'"):
        GatewayConfig(reasoning_parser="qwen")


async def _deltas(c: httpx.AsyncClient, body: dict) -> tuple[str, str, list[dict]]:
    r = await c.post("/v1/chat/completions", json={**body, "stream": True})
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    return reasoning, content, deltas


async def test_chat_reasoning_content_streamed_and_not(nats_url):
    async with gateway(nats_url, reasoning_parser="qwen3") as (url, peers, _):
        peers.script = PIECES
        async with httpx.AsyncClient(base_url=url) as c:
            r = await c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200, r.text
            msg = r.json()["choices"][0]["message"]
            assert (msg["reasoning_content"], msg["content"]) == ("plan it", "\n\nThe answer")
            reasoning, content, deltas = await _deltas(c, CHAT)
            assert (reasoning, content) == ("plan it", "\n\nThe answer")
            assert not any("<" in (d.get("content") or "") for d in deltas)
            # the template opened the block: the output starts inside it
            peers.chat_prompt_text = "<|im_start|>assistant\n<think>\n"
            peers.script = ["weigh ", "it</think>", "yes"]
            msg = (await c.post("/v1/chat/completions", json=CHAT)).json()["choices"][0]["message"]
            assert (msg["reasoning_content"], msg["content"]) == ("weigh it", "yes")
            assert (await _deltas(c, CHAT))[:2] == ("weigh it", "yes")
            # no thinking block: reasoning_content null, the content whole
            peers.chat_prompt_text, peers.script = "", ["just ", "this"]
            msg = (await c.post("/v1/chat/completions", json=CHAT)).json()["choices"][0]["message"]
            assert msg["reasoning_content"] is None and msg["content"] == "just this"


async def test_off_by_default_and_on_completions(nats_url):
    async with gateway(nats_url) as (url, peers, _):
        peers.script = PIECES
        async with httpx.AsyncClient(base_url=url) as c:
            msg = (await c.post("/v1/chat/completions", json=CHAT)).json()["choices"][0]["message"]
            assert msg["content"] == "".join(PIECES) and "reasoning_content" not in msg
    async with gateway(nats_url, reasoning_parser="deepseek_r1") as (url, peers, _):
        peers.script = PIECES
        async with httpx.AsyncClient(base_url=url) as c:
            body = {"model": "tiny", "prompt": "q", "max_tokens": 32}
            text = (await c.post("/v1/completions", json=body)).json()["choices"][0]["text"]
            assert text == "".join(PIECES)  # completions are raw text: nothing split


async def test_tool_calls_are_parsed_from_the_answer_after_the_reasoning(nats_url):
    call = '<tool_call>\n{"name": "get_w", "arguments": {"city": "Oslo"}}\n</tool_call>'
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_w",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    body = {**CHAT, "tools": tools}
    async with gateway(nats_url, reasoning_parser="qwen3") as (url, peers, _):
        peers.script = ["<think>", "need the weather", "</think>\n\n", call[:20], call[20:]]
        async with httpx.AsyncClient(base_url=url) as c:
            choice = (await c.post("/v1/chat/completions", json=body)).json()["choices"][0]
            msg = choice["message"]
            assert msg["reasoning_content"] == "need the weather"
            assert choice["finish_reason"] == "tool_calls"
            assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
            reasoning, content, deltas = await _deltas(c, body)
            assert reasoning == "need the weather" and "<tool_call>" not in content
            calls = [t for d in deltas for t in d.get("tool_calls") or ()]
            assert calls[0]["function"]["name"] == "get_w"


async def test_anthropic_thinking_blocks_through_the_sdk(nats_url):
    """`thinking` enabled: the template gets ``enable_thinking`` and the reasoning comes back as
    a thinking block before the text, streamed (thinking_delta, then the text block at index 1)
    or not, as the official SDK assembles them; a tool call after the reasoning is a tool_use
    block; earlier turns' thinking blocks are taken back and left out of the prompt; without
    `thinking` the answer is the text alone."""
    sdk = pytest.importorskip("anthropic")
    user = [{"role": "user", "content": "hi"}]
    think = {"type": "enabled", "budget_tokens": 1024}
    async with gateway(nats_url, reasoning_parser="qwen3", peers_kw={"max_model_len": 4096}) as (
        url,
        peers,
        _,
    ):
        client = sdk.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)
        peers.script = PIECES
        m = await client.messages.create(
            model="tiny", max_tokens=2048, thinking=think, messages=user
        )
        assert [b.type for b in m.content] == ["thinking", "text"]
        assert (m.content[0].thinking, m.content[1].text) == ("plan it", "\n\nThe answer")
        assert peers.tok_reqs[-1].chat_template_kwargs == {"enable_thinking": True}
        async with client.messages.stream(
            model="tiny", max_tokens=2048, thinking=think, messages=user
        ) as s:
            events = [ev async for ev in s]
            final = await s.get_final_message()
        assert [b.type for b in final.content] == ["thinking", "text"]
        assert (final.content[0].thinking, final.content[1].text) == ("plan it", "\n\nThe answer")
        starts = [e.index for e in events if e.type == "content_block_start"]
        assert starts == [0, 1]
        # a tool call after the reasoning
        peers.script = ["<think>", "look it up", "</think>", CALL]
        tool = {"name": "get_w", "input_schema": {"type": "object"}}
        m = await client.messages.create(
            model="tiny", max_tokens=2048, thinking=think, tools=[tool], messages=user
        )
        assert [b.type for b in m.content] == ["thinking", "tool_use"] or [
            b.type for b in m.content
        ] == ["thinking", "text", "tool_use"]
        assert m.content[-1].input == {"city": "Oslo"} and m.stop_reason == "tool_use"
        # the thinking block sent back in the next turn is accepted, not prompted
        peers.script = ["ok"]
        history = [
            *user,
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "secret", "signature": ""},
                    {"type": "text", "text": "prev"},
                ],
            },
            {"role": "user", "content": "more"},
        ]
        m = await client.messages.create(
            model="tiny", max_tokens=2048, thinking={"type": "disabled"}, messages=history
        )
        assert m.content[0].text == "ok" and peers.tok_reqs[-1].chat_template_kwargs == {
            "enable_thinking": False
        }
        assert "secret" not in json.dumps(peers.tok_reqs[-1].messages)
        # no thinking asked: the answer alone
        peers.script = PIECES
        m = await client.messages.create(model="tiny", max_tokens=64, messages=user)
        assert [b.type for b in m.content] == ["text"] and m.content[0].text == "\n\nThe answer"


CALL = '<tool_call>\n{"name": "get_w", "arguments": {"city": "Oslo"}}\n</tool_call>'


async def test_responses_reasoning_items_through_the_sdk(nats_url):
    """The Responses API returns the reasoning as a reasoning item (``reasoning_text`` content,
    no summary) before the message, streamed as ``response.reasoning_text.delta`` events, as
    the official SDK assembles them; ``reasoning.effort`` reaches the chat template; reasoning
    items sent back as input are taken and not prompted."""
    sdk = pytest.importorskip("openai")
    async with gateway(nats_url, reasoning_parser="qwen3") as (url, peers, _):
        client = sdk.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        peers.script = PIECES
        r = await client.responses.create(
            model="tiny", input="hi", max_output_tokens=32, reasoning={"effort": "high"}
        )
        assert [o.type for o in r.output] == ["reasoning", "message"]
        assert r.output[0].content[0].text == "plan it" and r.output[0].summary == []
        assert r.output_text == "\n\nThe answer"
        assert peers.tok_reqs[-1].chat_template_kwargs == {"reasoning_effort": "high"}
        async with client.responses.stream(model="tiny", input="hi", max_output_tokens=32) as s:
            kinds = [ev.type async for ev in s]
            final = await s.get_final_response()
        assert [o.type for o in final.output] == ["reasoning", "message"]
        assert final.output[0].content[0].text == "plan it"
        assert final.output_text == "\n\nThe answer"
        assert "response.reasoning_text.delta" in kinds
        assert kinds.index("response.reasoning_text.done") < kinds.index(
            "response.output_text.delta"
        )
        peers.script = ["ok"]
        back = [
            {"role": "user", "content": "hi"},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "secret"}],
            },
            {"role": "assistant", "content": "prev"},
            {"role": "user", "content": "more"},
        ]
        r = await client.responses.create(model="tiny", input=back, max_output_tokens=8)
        assert r.output_text == "ok" and "secret" not in json.dumps(peers.tok_reqs[-1].messages)


async def test_a_constrained_answer_may_think_first(nats_url):
    """With the parser on, a chat request's grammar goes to the engine with a thinking block
    before the answer (`StructuredSpec.think`, checked in tests/engine/test_structured.py):
    optional, or open when the template opened it; off, none; completions never."""
    body = {**CHAT, "response_format": {"type": "json_object"}}
    async with gateway(nats_url, reasoning_parser="qwen3") as (url, peers, _):
        async with httpx.AsyncClient(base_url=url) as c:
            assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
            assert peers.items[-1].sampling.structured.think == "optional"
            peers.chat_prompt_text = "<|im_start|>assistant\n<think>\n"
            assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
            assert peers.items[-1].sampling.structured.think == "open"
            cmpl = {"model": "tiny", "prompt": "q", "max_tokens": 4, "guided_regex": "[a-z]+"}
            assert (await c.post("/v1/completions", json=cmpl)).status_code == 200
            assert peers.items[-1].sampling.structured.think == ""
    async with gateway(nats_url) as (url, peers, _):
        async with httpx.AsyncClient(base_url=url) as c:
            assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
            assert peers.items[-1].sampling.structured.think == ""
