"""Pure gateway pieces of structured outputs and tool calling: which constraint a request gets
(and the 400s naming a bad one), unknown fields refused by name, tool-call parsing whole and
streamed at every split, the chat template rendering tools and tool results."""

from __future__ import annotations

import json

import pytest

from services.gateway.config import GatewayConfig
from services.gateway.constraints import constraint_error
from services.gateway.core import ApiError, build_spec, sampling_for
from services.gateway.schemas import ChatCompletionRequest, dump_messages
from services.gateway.tools import HERMES, LLAMA3, ToolStream, parse_tool_calls, tool_format
from shared.protocol.errors import StrataError

CFG = GatewayConfig()
MSGS = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"x": {"type": "integer"}},
                "required": ["x"],
            },
        },
    },
]


def _spec(**body):
    return build_spec("chat", {"model": "m", "messages": MSGS, **body}, CFG, "m")


def _err(**body) -> ApiError:
    with pytest.raises(ApiError) as exc:
        _spec(**body)
    assert exc.value.http_status == 400
    return exc.value


def test_each_source_becomes_one_constraint():
    rf = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA, "strict": True}}
    cases = {
        "response_format": ({"response_format": rf}, "json_schema"),
        "json_object": ({"response_format": {"type": "json_object"}}, "json"),
        "guided_json": ({"guided_json": SCHEMA}, "json_schema"),
        "guided_json_text": ({"guided_json": json.dumps(SCHEMA)}, "json_schema"),
        "guided_regex": ({"guided_regex": "[a-z]+"}, "regex"),
        "guided_choice": ({"guided_choice": ["a", "b"]}, "choice"),
        "structured_outputs": ({"structured_outputs": {"choice": ["x"]}}, "choice"),
        "required": ({"tools": TOOLS, "tool_choice": "required"}, "tool_calls"),
    }
    for name, (body, kind) in cases.items():
        spec = _spec(**body)
        assert spec.constraint is not None and spec.constraint.kind == kind, name
        assert sampling_for(spec, 5, 100, CFG).structured == spec.constraint
    assert json.loads(_spec(guided_json=SCHEMA).constraint.spec) == SCHEMA
    for free in (
        {},
        {"response_format": {"type": "text"}},
        {"tools": TOOLS},
        {"tools": TOOLS, "tool_choice": "none"},
    ):
        assert _spec(**free).constraint is None


def test_bad_requests_name_the_field():
    assert "unknown field 'frobnicate'" in _err(frobnicate=1).message
    assert _err(frobnicate=1).param == "frobnicate"
    e = _err(guided_regex="a", guided_choice=["b"])
    assert "guided_regex and guided_choice" in e.message
    assert _err(best_of=2).param == "best_of"
    assert _err(logit_bias={"x": 1}).param == "logit_bias"
    assert _err(logit_bias={"5": 101}).param == "logit_bias"
    assert "tool_choice needs tools" in _err(tool_choice="required").message
    named = {"type": "function", "function": {"name": "nope"}}
    assert "'nope'" in _err(tools=TOOLS, tool_choice=named).message
    assert _err(guided_json="{not json").param == "guided_json"
    assert "json_schema.schema" in _err(response_format={"type": "json_schema"}).message
    assert _err(structured_outputs={"regex": "a", "choice": ["b"]}).param == "structured_outputs"
    # the OpenAI SDK's own fields still pass; logit_bias reaches the sampler
    ok = _spec(logit_bias={"7": -100}, n=2, user="u", seed=1, parallel_tool_calls=False)
    assert sampling_for(ok, 5, 100, CFG).logit_bias == {7: -100.0}


def test_invalid_schema_is_a_400_naming_the_problem():
    """The tokenizer compiles the constraint (the gateway has no torch); its bad_request
    becomes the gateway's 400 naming the field (`constraint_error`)."""
    from services.cluster_config import ensure_model
    from services.tokenizer.core import TokenizerCore

    core = TokenizerCore(ensure_model(""))
    spec = _spec(guided_json={"type": "object", "properties": {"a": {"type": "nosuchtype"}}})
    with pytest.raises(StrataError) as exc:
        core.check_constraint(spec.constraint, spec.constraint_param)
    err = constraint_error(exc.value, spec.constraint_param)
    assert getattr(err, "param", None) == "guided_json"
    assert err.http_status == 400 and err.message.startswith("guided_json: invalid")
    core.check_constraint(_spec(guided_json=SCHEMA).constraint, "guided_json")
    other = StrataError("bad_request", "prompt: token id 9 is not in the vocabulary")
    assert constraint_error(other, "guided_json") is other  # not about the constraint


def test_tool_format_from_template():
    assert tool_format("{% for t in tools %}<tool_call>{% endfor %}") == HERMES
    assert tool_format("<|python_tag|>{{ x }}<|eot_id|>") == LLAMA3
    assert tool_format(None) == HERMES


HERMES_OUT = (
    'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    '\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"x": 2}}\n</tool_call>'
)


def test_parse_whole_outputs():
    content, calls = parse_tool_calls(HERMES_OUT, HERMES)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("add", {"x": 2}),
    ]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    content, calls = parse_tool_calls(
        '<|python_tag|>{"name": "add", "parameters": {"x": 1}}', LLAMA3
    )
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    assert parse_tool_calls("plain text", HERMES) == ("plain text", [])
    assert parse_tool_calls("<tool_call>{broken</tool_call>", HERMES)[1] == []


@pytest.mark.parametrize(
    "fmt,text",
    [
        (HERMES, HERMES_OUT),
        (HERMES, "no <tool_ call here <"),
        (HERMES, 'cut <tool_call>\n{"name": "add"'),
        (LLAMA3, '{"name": "add", "parameters": {"x": 3}}'),
        (LLAMA3, "just words"),
    ],
)
def test_stream_parse_equals_whole_parse_at_every_split(fmt, text):
    want_content, want_calls = parse_tool_calls(text, fmt)
    for step in (1, 2, 5, len(text)):
        ts = ToolStream(fmt)
        events = []
        for i in range(0, len(text), step):
            events += ts.feed(text[i : i + step])
        events += ts.finish()
        content = "".join(e for k, e in events if k == "content")
        calls = [e["function"] for k, e in events if k == "tool"]
        assert calls == [c["function"] for c in want_calls]
        assert content == (want_content or "")


def test_messages_with_tool_calls_and_results_reach_the_template(tmp_path):
    from shared.model.tokenizer import Tokenizer

    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "tools": TOOLS,
            "messages": [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ],
        }
    )
    msgs = dump_messages(req)
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    # arguments holding an integer beyond 64 bits stay the string sent: msgpack (the bus to the
    # tokenizer) cannot carry the int (schemathesis found the 500 it caused)
    big = '{"n": 18446744073709551616}'
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": big}}
    huge = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "assistant", "tool_calls": [call]}]}
    )
    assert dump_messages(huge)[0]["tool_calls"][0]["function"]["arguments"] == big
    call["function"]["arguments"] = '{"n": 18446744073709551615}'  # 2**64 - 1: parsed
    fits = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "assistant", "tool_calls": [call]}]}
    )
    assert dump_messages(fits)[0]["tool_calls"][0]["function"]["arguments"] == {"n": 2**64 - 1}
    assert msgs[2]["tool_call_id"] == "call_1"
    # a Qwen-style template sees tools, the call and the tool result, as transformers renders it
    template = (
        "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}"
        "</tools>{% endif %}{% for m in messages %}{% if m.tool_calls %}{% for c in "
        "m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
        "{% elif m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>"
        "{% else %}{{ m.content }}{% endif %}{% endfor %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    from services.cluster_config import ensure_model

    src = ensure_model("")
    (tmp_path / "tokenizer.json").write_text(open(f"{src}/tokenizer.json").read())
    tok = Tokenizer.from_dir(tmp_path)
    text = tok.apply_chat_template(
        msgs,
        add_generation_prompt=False,
        tools=[t.model_dump(exclude_none=True) for t in req.tools],
    )
    assert text == (
        '<tools>get_weather;add;</tools>weather?<tool_call>{"name": "get_weather", '
        '"arguments": {"city": "Oslo"}}</tool_call><tool_response>sunny'
        "</tool_response>"
    )
