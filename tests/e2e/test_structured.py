"""Structured outputs and tool calling through the whole cluster (prefill=1 decode=1: the first
token is sampled on prefill, the rest on decode; n-gram speculation on), with the official
openai client at temperature 0.8 and seeds. The default model has random weights: it cannot
produce valid JSON by chance, so every output validating proves the grammar followed the
request across the hand-off. docs/STRUCTURED.md's examples run from the page's text."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import jsonschema
import pytest

from services.infra.procs import repo_root
from tests.acceptance.doc_examples import blocks, commands
from tests.cluster_kv.conftest import moved_since, transfer_counters
from tests.e2e.conftest import start_cluster

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.e2e

SCHEMA = {
    "type": "object",
    "required": ["sku", "in_stock", "quantity", "size"],
    "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
        "in_stock": {"type": "boolean"},
        "quantity": {"type": "integer", "minimum": 0, "maximum": 99},
        "size": {"enum": ["S", "M", "L"]},
        "note": {"type": "string", "maxLength": 6},
    },
}
RF = {"type": "json_schema", "json_schema": {"name": "stock", "schema": SCHEMA, "strict": True}}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "order_status",
            "parameters": {
                "type": "object",
                "required": ["order_id"],
                "properties": {"order_id": {"type": "integer", "minimum": 1, "maximum": 999}},
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add_to_cart",
            "parameters": {
                "type": "object",
                "required": ["sku", "qty"],
                "properties": {
                    "sku": {"enum": ["TSH-001", "SHO-002"]},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                },
            },
        },
    },
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MSGS = [{"role": "user", "content": "Is the blue shirt in stock?"}]
SEEDS = range(3)
JSON_REQ = {"max_tokens": 80, "response_format": RF}  # a stock record, per SCHEMA
TOOLS_REQ = {"max_tokens": 120, "tools": TOOLS, "tool_choice": "required"}  # some tool call(s)


@pytest.fixture(scope="module")
def cluster(default_model_dir):
    c = start_cluster(
        default_model_dir,
        prefill=1,
        decode=1,
        vision=0,
        kvstore=0,
        env={"STRATA_NUM_SPECULATIVE_TOKENS": "3"},
    )
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.gateway_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def chat(client, model):
    """``chat(seed, **kwargs)``: a chat completion sampled at temperature 0.8 with ``seed``, on
    MSGS unless ``messages`` is given."""

    def create(seed: int, **kwargs):
        kwargs.setdefault("messages", MSGS)
        return client.chat.completions.create(model=model, temperature=0.8, seed=seed, **kwargs)

    return create


def _check_call(name: str, arguments: str) -> None:
    assert name in PARAMS, name
    jsonschema.validate(json.loads(arguments), PARAMS[name])


def _handed_off(before: dict[str, float], cluster) -> None:
    """Prefill computed the prompts and pushed their KV to decode (so token one was sampled on
    prefill and the rest on decode), with no fallback to recompute."""
    moved = moved_since(before, transfer_counters(cluster))
    sent = sum(v for k, v in moved.items() if k.startswith("sent:"))
    received = sum(v for k, v in moved.items() if k.startswith("received:"))
    assert sent > 0 and received == sent, moved
    assert not [k for k in moved if k.startswith("fallback:")], moved


def test_json_schema_outputs_validate(cluster, chat):
    t0 = transfer_counters(cluster)
    for seed in SEEDS:
        r = chat(seed, **JSON_REQ)
        c = r.choices[0]
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    _handed_off(t0, cluster)


def test_streamed_json_schema_outputs_validate(chat):
    for seed in SEEDS:
        stream = chat(seed, **JSON_REQ, stream=True)
        text, reasons = "", []
        for ch in stream:
            text += ch.choices[0].delta.content or ""
            reasons.append(ch.choices[0].finish_reason)
        assert reasons[-1] == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)


def test_greedy_constrained_with_speculation_on_and_free_text_alongside(client, model):
    """Greedy requests are the ones n-gram speculation drafts for; the constrained one gets
    none and still validates, the free one is unaffected."""
    r = client.chat.completions.create(
        model=model, messages=MSGS, temperature=0.0, max_tokens=80, response_format=RF
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    free = client.chat.completions.create(
        model=model, messages=MSGS, temperature=0.0, max_tokens=20
    )
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content)


def test_vllm_extras(client, model, chat):
    r = chat(5, extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert r.choices[0].message.content in ("yes", "no", "maybe")
    r = client.completions.create(
        model=model,
        prompt="SKU:",
        temperature=0.8,
        seed=6,
        max_tokens=20,
        extra_body={"guided_regex": "[A-Z]{3}-[0-9]{3}"},
    )
    assert re.fullmatch("[A-Z]{3}-[0-9]{3}", r.choices[0].text)
    cut = chat(1, max_tokens=4, response_format=RF)
    assert cut.choices[0].finish_reason == "length"


def test_required_tool_calls_parse_and_validate(chat):
    for seed in SEEDS:
        r = chat(seed, **TOOLS_REQ)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
        for call in c.message.tool_calls:
            assert call.id.startswith("call_") and call.type == "function"
            _check_call(call.function.name, call.function.arguments)


def test_streamed_tool_calls_arrive_as_deltas(cluster, chat):
    t0 = transfer_counters(cluster)
    for seed in SEEDS:
        stream = chat(seed, **TOOLS_REQ, stream=True)
        calls: dict[int, dict] = {}
        reasons = []
        for ch in stream:
            reasons.append(ch.choices[0].finish_reason)
            for d in ch.choices[0].delta.tool_calls or []:
                cur = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                cur["id"] += d.id or ""
                cur["name"] += (d.function.name or "") if d.function else ""
                cur["arguments"] += (d.function.arguments or "") if d.function else ""
        assert reasons[-1] == "tool_calls" and calls
        for call in calls.values():
            assert call["id"].startswith("call_")
            _check_call(call["name"], call["arguments"])
    _handed_off(t0, cluster)


def test_named_tool_choice_and_tool_results_in_the_conversation(chat):
    history = MSGS + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "order_status", "arguments": '{"order_id": 42}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "shipped"},
    ]
    named = {"type": "function", "function": {"name": "add_to_cart"}}
    r = chat(9, messages=history, max_tokens=80, tools=TOOLS, tool_choice=named)
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "add_to_cart"
    _check_call(call.function.name, call.function.arguments)


def test_bad_constraints_and_unknown_fields_are_400s_naming_them(client, model):
    bad = {
        "type": "json_schema",
        "json_schema": {
            "name": "x",
            "schema": {"type": "object", "properties": {"a": {"type": "nosuchtype"}}},
        },
    }
    with pytest.raises(openai.BadRequestError, match="response_format: invalid json_schema"):
        client.chat.completions.create(model=model, messages=MSGS, response_format=bad)
    with pytest.raises(openai.BadRequestError, match="unknown field 'frobnicate'"):
        client.chat.completions.create(model=model, messages=MSGS, extra_body={"frobnicate": 1})
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=model, prompt="x", best_of=2)
    with pytest.raises(openai.BadRequestError, match="'nope'"):
        client.chat.completions.create(
            model=model,
            messages=MSGS,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )


def test_tokenize_detokenize_round_trip(cluster, model):
    with httpx.Client(base_url=cluster.gateway_url, timeout=30) as h:
        t = h.post(
            "/tokenize", json={"model": model, "prompt": "blue shirt", "return_token_strs": True}
        ).json()
        assert t["count"] == len(t["tokens"]) > 0 and t["max_model_len"] > 0
        assert len(t["token_strs"]) == t["count"]
        assert h.post("/detokenize", json={"model": model, "tokens": t["tokens"]}).json() == {
            "prompt": "blue shirt"
        }
        chat = h.post("/tokenize", json={"model": model, "messages": MSGS}).json()
        assert chat["count"] > t["count"]
        r = h.post("/detokenize", json={"tokens": [10**6]})
        assert r.status_code == 400 and "not in the vocabulary" in r.text


# ----- docs/STRUCTURED.md, run from the page's text ----------------------------------------
DOC = f"{repo_root()}/docs/STRUCTURED.md"


def _blocks(lang: str) -> list[str]:
    return blocks(DOC, lang)


def _local(text: str, cluster, model: str) -> str:
    """The page targets `bash scripts/up.sh` (port 8000, model "default"): point it here."""
    text = text.replace("http://127.0.0.1:8000", cluster.gateway_url)
    return text.replace('"default"', json.dumps(model)).replace("'default'", json.dumps(model))


def test_doc_examples_run_as_written(cluster, model):
    curls = [c for b in _blocks("bash") for c in commands(b) if c.startswith("curl")]
    assert len(curls) == 5
    outs = []
    for cmd in curls:
        r = subprocess.run(
            ["bash", "-c", _local(cmd, cluster, model) + " --fail-with-body"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, (cmd, r.stdout[-2000:], r.stderr[-2000:])
        outs.append(json.loads(r.stdout))
    schema = json.loads(re.search(r'"schema": (\{.*?\}\}\})', curls[0], re.S).group(1))
    jsonschema.validate(json.loads(outs[0]["choices"][0]["message"]["content"]), schema)
    [call] = outs[1]["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "order_status"
    assert 1 <= json.loads(call["function"]["arguments"])["order_id"] <= 999
    assert outs[2]["choices"][0]["message"]["content"] in ("yes", "no")
    assert outs[3]["count"] == len(outs[3]["tokens"])
    assert "prompt" in outs[4]
    [example] = _blocks("python")
    r = subprocess.run(
        [sys.executable, "-c", _local(example, cluster, model)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    review, call = (json.loads(line) for line in r.stdout.strip().splitlines())
    assert review["product"] in ("shirt", "shoes", "hat") and 1 <= review["rating"] <= 5
    assert call["name"] == "add_to_cart" and call["arguments"]["sku"] in ("TSH-001", "SHO-002")
