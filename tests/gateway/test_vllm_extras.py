"""vLLM's extra request fields and endpoints at the gateway (real nats-server, fake peers: the
tokenizer maps a character to ``ord(c) % 500``, decode emits token ``100 + i``, text ``t<i> ``):
what reaches the tokenizer and the engine, the response shapes, and the 400s."""

from __future__ import annotations

import json

import httpx
import pytest

from services.gateway.config import GatewayConfig
from services.gateway.core import build_spec
from shared.protocol import subjects
from shared.protocol.api import GenerateEvent, GenerateRequest
from shared.protocol.codec import decode, encode
from tests.gateway.harness import gateway
from tests.gateway.test_rest import sse_events

MSGS = [{"role": "user", "content": "hi"}]
CHAT = {"model": "tiny", "messages": MSGS, "max_tokens": 2}
CMPL = {"model": "tiny", "prompt": "ab", "max_tokens": 2}


async def test_fields_reach_tokenizer_and_engine(nats_url):
    async with gateway(nats_url) as (url, peers, _):
        async with httpx.AsyncClient(base_url=url) as c:
            body = {
                **CHAT,
                "messages": [*MSGS, {"role": "assistant", "content": "ok"}],
                "add_generation_prompt": False,
                "continue_final_message": True,
                "chat_template_kwargs": {"enable_thinking": False},
                "truncate_prompt_tokens": 3,
                "bad_words": ["xy"],
                "allowed_token_ids": [5, 7],
                "include_stop_str_in_output": True,
                "stop": ["END"],
                "min_tokens": 1,
                "repetition_penalty": 1.2,
                "logit_bias": {"9": -5},
                "skip_special_tokens": False,
                "spaces_between_special_tokens": False,
                "add_special_tokens": True,
            }
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            tok = peers.tok_reqs[-1]
            assert tok.continue_final_message and not tok.add_generation_prompt
            assert tok.chat_template_kwargs == {"enable_thinking": False}
            assert tok.truncate_prompt_tokens == 3 and tok.bad_words == ["xy"]
            assert tok.add_special_tokens
            item = peers.items[-1]
            assert item.prompt_token_ids == [ord("o"), ord("k"), 104, 105, ord("o"), ord("k")][-3:]
            sp = item.sampling
            assert sp.bad_words_ids == [[ord("x"), ord("y")]]
            assert sp.allowed_token_ids == [5, 7] and sp.include_stop_str_in_output
            assert sp.min_tokens == 1 and sp.repetition_penalty == 1.2
            assert sp.logit_bias == {9: -5.0} and not sp.skip_special_tokens
            assert not sp.spaces_between_special_tokens


async def test_return_token_ids_chat_and_completions(nats_url):
    async with gateway(nats_url) as (url, _, _s):
        async with httpx.AsyncClient(base_url=url) as c:
            r = await c.post("/v1/chat/completions", json={**CHAT, "return_token_ids": True})
            body = r.json()
            assert body["prompt_token_ids"] == [104, 105]
            assert body["choices"][0]["token_ids"] == [100, 101]
            r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
            assert "token_ids" not in r.text  # off by default
            r = await c.post(
                "/v1/chat/completions", json={**CHAT, "return_token_ids": True, "stream": True}
            )
            evs = sse_events(r.text)
            assert evs[0]["prompt_token_ids"] == [104, 105]
            assert sum((e["choices"][0].get("token_ids", []) for e in evs), []) == [100, 101]
            r = await c.post(
                "/v1/completions",
                json={**CMPL, "prompt": [[3, 4], [5, 6, 7]], "return_token_ids": True},
            )
            ch = r.json()["choices"]
            assert [x["prompt_token_ids"] for x in ch] == [[3, 4], [5, 6, 7]]
            assert [x["token_ids"] for x in ch] == [[100, 101], [100, 101]]
            r = await c.post(
                "/v1/completions",
                json={**CMPL, "return_token_ids": True, "stream": True, "echo": True},
            )
            evs = sse_events(r.text)
            first = evs[0]["choices"][0]
            assert first["text"] == "ab" and first["prompt_token_ids"] == [97, 98]
            assert "".join(e["choices"][0]["text"] for e in evs) == "abt0 t1 "


async def test_token_id_and_string_list_prompts_and_echo(nats_url):
    async with gateway(nats_url) as (url, peers, _):
        async with httpx.AsyncClient(base_url=url) as c:
            r = await c.post("/v1/completions", json={**CMPL, "prompt": [104, 105], "echo": True})
            assert r.status_code == 200, r.text
            assert peers.items[-1].prompt_token_ids == [104, 105]
            assert r.json()["choices"][0]["text"] == "hit0 t1 "  # echo: the ids' text
            r = await c.post("/v1/completions", json={**CMPL, "prompt": ["ab", "cd"], "n": 2})
            assert len(r.json()["choices"]) == 4
            assert sorted(tuple(i.prompt_token_ids) for i in peers.items[-4:]) == [
                (97, 98),
                (97, 98),
                (99, 100),
                (99, 100),
            ]
            r = await c.post(
                "/v1/completions", json={**CMPL, "prompt": "ab", "echo": True, "stream": True}
            )
            assert "".join(e["choices"][0]["text"] for e in sse_events(r.text)) == "abt0 t1 "


@pytest.mark.parametrize(
    "kind,extra,param,says",
    [
        ("chat", {"continue_final_message": True}, "continue_final_message", "both"),
        ("chat", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "-1"),
        ("chat", {"truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "greater"),
        ("chat", {"allowed_token_ids": []}, "allowed_token_ids", "empty"),
        ("chat", {"allowed_token_ids": [-1]}, "allowed_token_ids.0", "greater"),
        ("chat", {"bad_words": [""]}, "bad_words.0", "at least 1"),
        ("chat", {"prompt_logprobs": 21}, "prompt_logprobs", "less than or equal to 20"),
        ("completion", {"prompt_logprobs": -1}, "prompt_logprobs", "greater"),
        ("chat", {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "may not"),
        ("chat", {"suffix": "x"}, "suffix", "unknown field"),
        ("chat", {"use_beam_search": True}, "use_beam_search", "unknown field"),
        ("completion", {"prompt": [[]]}, "prompt", "must not be empty"),
        ("completion", {"prompt": [1, "a"]}, "prompt", "invalid field"),
    ],
)
def test_bad_fields_are_400s_naming_the_field(kind, extra, param, says):
    from services.gateway.core import ApiError

    base = CHAT if kind == "chat" else CMPL
    cfg = GatewayConfig.load([], role="gateway", model_name="tiny")
    with pytest.raises(ApiError) as ei:
        build_spec(kind, {**base, **extra}, cfg, "tiny")
    assert ei.value.http_status == 400
    assert (ei.value.param or "").startswith(param), ei.value.param
    assert says in ei.value.message


async def test_allowed_token_ids_outside_the_vocabulary(nats_url):
    async with gateway(nats_url) as (url, _, _s):
        async with httpx.AsyncClient(base_url=url) as c:
            r = await c.post("/v1/chat/completions", json={**CHAT, "allowed_token_ids": [500]})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "allowed_token_ids"
            assert "not in the vocabulary (size 500)" in err["message"]


async def test_version_tokenize_detokenize_and_their_auth(nats_url, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": {"sk-a": {"models": ["tiny"]}}}))
    async with gateway(nats_url, api_key_file=str(keys)) as (url, peers, _):
        async with httpx.AsyncClient(base_url=url) as c:
            for method, path, body in (
                ("GET", "/version", None),
                ("POST", "/tokenize", {"prompt": "ab"}),
                ("POST", "/detokenize", {"tokens": [97]}),
            ):
                r = await c.request(method, path, json=body)
                assert r.status_code == 401, path
            c.headers["Authorization"] = "Bearer sk-a"
            v = (await c.get("/version")).json()
            assert list(v) == ["version"] and v["version"]
            t = (await c.post("/tokenize", json={"model": "tiny", "prompt": "ab"})).json()
            assert t == {"count": 2, "max_model_len": 64, "tokens": [97, 98], "token_strs": None}
            r = await c.post(
                "/tokenize",
                json={
                    "messages": [*MSGS, {"role": "assistant", "content": "so"}],
                    "add_generation_prompt": False,
                    "continue_final_message": True,
                    "chat_template_kwargs": {"enable_thinking": True},
                },
            )
            assert r.status_code == 200 and r.json()["tokens"] == [104, 105, 115, 111]
            tok = peers.tok_reqs[-1]
            assert tok.continue_final_message and tok.chat_template_kwargs == {
                "enable_thinking": True
            }
            r = await c.post("/tokenize", json={"messages": MSGS, "continue_final_message": True})
            assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
            d = await c.post("/detokenize", json={"model": "tiny", "tokens": [104, 105]})
            assert d.json() == {"prompt": "hi"}  # from the tokenizer service over NATS
            d = await c.post("/detokenize", json={"tokens": [600]})
            assert d.status_code == 400 and d.json()["error"]["param"] == "tokens"
            await peers.stop_role("tokenizer")  # no tokenizer: 503, not the gateway's own
            d = await c.post("/detokenize", json={"tokens": [104]})
            assert d.status_code == 503


async def test_nats_api_carries_the_same_fields(nats_url, nc):
    async with gateway(nats_url) as (_, peers, _s):
        body = {**CMPL, "prompt": [104, 105], "return_token_ids": True, "bad_words": ["a"]}
        rep = await nc.request(
            subjects.API_GENERATE,
            encode(GenerateRequest(kind="completion", body=body)),
            timeout=10,
        )
        ev = decode(rep.data, GenerateEvent)
        assert ev.done and ev.error is None, ev
        ch = ev.data["choices"][0]
        assert ch["prompt_token_ids"] == [104, 105] and ch["token_ids"] == [100, 101]
        assert peers.items[-1].sampling.bad_words_ids == [[97]]
        bad = {**CHAT, "continue_final_message": True}
        rep = await nc.request(
            subjects.API_GENERATE, encode(GenerateRequest(kind="chat", body=bad)), timeout=10
        )
        ev = decode(rep.data, GenerateEvent)
        assert ev.status == 400 and ev.data["error"]["param"] == "continue_final_message"


def _doc_rows() -> list[tuple[list[str], str, str]]:
    """(field names, endpoint, Strata column) of every request-field row of docs/api.md."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    body = text.split("## Request fields", 1)[1].split("## Anthropic", 1)[0]
    rows = []
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        names = [n for n in re.findall(r"`([a-z_]+)`", cells[0])]
        rows.append((names, cells[1], cells[-1]))
    return rows


def test_docs_api_md_is_true_to_the_validator():
    """Every field docs/api.md calls refused is a 400 naming it on its endpoint(s); every other
    field it lists is in the schema."""
    from services.gateway.core import ApiError
    from services.gateway.schemas import ChatCompletionRequest, CompletionRequest

    cfg = GatewayConfig.load([], role="gateway", model_name="tiny")
    rows = _doc_rows()
    assert len(rows) >= 30
    for names, endpoint, strata in rows:
        kinds = {"chat": ["chat"], "completions": ["completion"]}.get(
            endpoint, ["chat", "completion"]
        )
        for kind in kinds:
            schema = ChatCompletionRequest if kind == "chat" else CompletionRequest
            base = CHAT if kind == "chat" else CMPL
            for name in names:
                if name in ("model", "messages", "prompt") or (
                    endpoint == "both / chat" and kind != "chat"
                ):
                    continue
                if strata.startswith("refused"):
                    with pytest.raises(ApiError) as ei:
                        build_spec(kind, {**base, name: 1}, cfg, "tiny")
                    assert ei.value.param == name, (kind, name)
                else:
                    assert name in schema.model_fields, (kind, name)


async def test_nats_api_streams_token_ids_and_echo(nats_url, nc):
    import asyncio

    async with gateway(nats_url):
        got: list[GenerateEvent] = []
        done = asyncio.Event()

        async def on_ev(msg):
            got.append(decode(msg.data, GenerateEvent))
            if got[-1].done:
                done.set()

        sub = await nc.subscribe("_INBOX.api.vllm-extras", cb=on_ev)
        body = {**CMPL, "stream": True, "echo": True, "return_token_ids": True}
        req = GenerateRequest(kind="completion", body=body, stream_subject="_INBOX.api.vllm-extras")
        await nc.publish(subjects.API_GENERATE, encode(req))
        await asyncio.wait_for(done.wait(), 10)
        await sub.unsubscribe()
        choices = [e.data["choices"][0] for e in got if e.data and e.data.get("choices")]
        assert choices[0]["text"] == "ab" and choices[0]["prompt_token_ids"] == [97, 98]
        assert "".join(c["text"] for c in choices) == "abt0 t1 "
        assert sum((c["token_ids"] for c in choices), []) == [100, 101]


async def test_chat_echo_prepends_a_last_assistant_message(nats_url):
    async with gateway(nats_url) as (url, _, _s):
        async with httpx.AsyncClient(base_url=url) as c:
            msgs = [*MSGS, {"role": "assistant", "content": "So: "}]
            body = {**CHAT, "messages": msgs, "echo": True, "add_generation_prompt": False}
            r = await c.post("/v1/chat/completions", json={**body, "continue_final_message": True})
            assert r.json()["choices"][0]["message"]["content"] == "So: t0 t1 "
            r = await c.post("/v1/chat/completions", json={**body, "stream": True})
            evs = sse_events(r.text)
            parts = [e["choices"][0]["delta"].get("content", "") for e in evs]
            assert parts[:2] == ["", "So: "] and "".join(parts) == "So: t0 t1 "
            r = await c.post("/v1/chat/completions", json={**CHAT, "echo": True})
            assert r.json()["choices"][0]["message"]["content"] == "t0 t1 "  # last is the user's


async def test_continuous_usage_stats_put_usage_on_every_chunk(nats_url):
    async with gateway(nats_url) as (url, _, _s):
        async with httpx.AsyncClient(base_url=url) as c:
            opts = {"include_usage": True, "continuous_usage_stats": True}
            body = {**CMPL, "max_tokens": 3, "stream": True, "stream_options": opts}
            evs = sse_events((await c.post("/v1/completions", json=body)).text)
            done = [e["usage"]["completion_tokens"] for e in evs if e["choices"]]
            assert done == [1, 2, 3] and evs[-1]["choices"] == []
            assert all(e["usage"]["prompt_tokens"] == 2 for e in evs)
            body["stream_options"] = {"include_usage": True}
            evs = sse_events((await c.post("/v1/completions", json=body)).text)
            assert [("usage" in e) for e in evs] == [False, False, False, True]


def test_prompt_logprobs_reach_the_engine_and_are_bounded_by_the_bus():
    from services.gateway.core import ApiError, sampling_for

    cfg = GatewayConfig.load([], role="gateway", model_name="tiny")
    spec = build_spec("completion", {**CMPL, "prompt_logprobs": 20}, cfg, "tiny")
    assert sampling_for(spec, 1000, 0, cfg).prompt_logprobs == 20
    assert (
        sampling_for(build_spec("completion", CMPL, cfg, "tiny"), 9, 0, cfg).prompt_logprobs is None
    )
    with pytest.raises(ApiError) as ei:  # 21 pairs of ~14 bytes per token > 6 MiB
        sampling_for(spec, 30000, 0, cfg)
    assert ei.value.param == "prompt_logprobs" and "at most 21112 prompt tokens" in ei.value.message


async def test_openai_sdk_fields_with_no_effect_and_reasoning_effort(nats_url):
    """`store`, `metadata` and `service_tier` (OpenAI's; vLLM takes them too) are accepted and
    change nothing; `reasoning_effort` reaches the chat template as its kwarg, under an explicit
    `chat_template_kwargs` entry of that name; a bad value is a 400 naming the field."""
    async with gateway(nats_url) as (url, peers, _):
        async with httpx.AsyncClient(base_url=url) as c:
            body = {
                **CHAT,
                "store": False,
                "metadata": {"team": "search"},
                "service_tier": "auto",
                "reasoning_effort": "low",
                "chat_template_kwargs": {"enable_thinking": False},
            }
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert peers.tok_reqs[-1].chat_template_kwargs == {
                "reasoning_effort": "low",
                "enable_thinking": False,
            }
            plain = peers.items[-1].sampling
            body["chat_template_kwargs"] = {"reasoning_effort": "high"}
            assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
            assert peers.tok_reqs[-1].chat_template_kwargs == {"reasoning_effort": "high"}
            assert peers.items[-1].sampling == plain  # the no-effect fields changed nothing
            for field, value in (
                ("reasoning_effort", "extreme"),
                ("service_tier", "gold"),
                ("metadata", {f"k{i}": "v" for i in range(17)}),
                ("metadata", {"k": "v" * 513}),
            ):
                r = await c.post("/v1/chat/completions", json={**CHAT, field: value})
                assert r.status_code == 400, (field, r.text)
                assert r.json()["error"]["param"].startswith(field), r.json()


async def test_retrieve_model_ping_and_bounded_route_labels(nats_url, tmp_path):
    """`GET /v1/models/{id}` (the SDK's `models.retrieve`) answers the served model and 404s
    another, behind the API key; `/ping` is the open probe vLLM has; requests to paths the app
    does not route share one "other" label, so no client can grow the route label set."""
    from services.gateway.metrics import HTTP

    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": {"sk-a": {"models": ["tiny"]}}}))
    async with gateway(nats_url, api_key_file=str(keys)) as (url, _peers, _):
        async with httpx.AsyncClient(base_url=url) as c:
            assert (await c.get("/v1/models/tiny")).status_code == 401
            assert (await c.get("/ping")).status_code in (200, 503)  # open, like /health
            assert (await c.post("/ping")).status_code == (await c.get("/health")).status_code
            c.headers["Authorization"] = "Bearer sk-a"
            m = (await c.get("/v1/models/tiny")).json()
            assert (m["id"], m["object"]) == ("tiny", "model")
            r = await c.get("/v1/models/other-model")
            assert r.status_code == 404 and "other-model" in r.json()["error"]["message"]
            for i in range(5):
                assert (await c.get(f"/v1/no-such-route-{i}")).status_code == 404
    routes = {s.labels["route"] for s in next(iter(HTTP.collect())).samples if "route" in s.labels}
    assert not any(r.startswith("/v1/no-such-route") for r in routes), routes
    assert {"other", "/v1/models/{model_id}", "/ping"} <= routes


@pytest.mark.parametrize("isolation", ["none", "tenant"])
async def test_cache_salt_and_tenant_isolation_root_the_block_hashes(nats_url, isolation):
    """vLLM's ``cache_salt`` reaches the engine (``SamplingParams.cache_salt``) and roots the
    block hashes the scheduler routes by, so a salted prompt matches only prompts with the same
    salt; ``STRATA_CACHE_ISOLATION=tenant`` adds the caller's tenant to every request's salt, so
    two API keys sending the same prompt share no block (the same key does)."""
    long = [{"role": "user", "content": "two full blocks of prompt and a bit"}]
    body = {**CHAT, "messages": long}
    keys = {"api_keys": ["sk-a", "sk-b"], "cache_isolation": isolation}
    async with gateway(nats_url, **keys) as (url, peers, _):
        async with httpx.AsyncClient(base_url=url) as c:

            async def route(key: str, **extra) -> tuple[list[str], str]:
                r = await c.post(
                    "/v1/chat/completions",
                    json={**body, **extra},
                    headers={"Authorization": f"Bearer {key}"},
                )
                assert r.status_code == 200, r.text
                return peers.routes[-1].block_hashes, peers.items[-1].sampling.cache_salt

            a, salt_a = await route("sk-a")
            assert len(a) >= 2 and (await route("sk-a"))[0] == a  # content-addressed
            b, salt_b = await route("sk-b")
            s1, salt_s1 = await route("sk-a", cache_salt="s1")
            assert (await route("sk-a", cache_salt="s1"))[0] == s1
            s2, _ = await route("sk-a", cache_salt="s2")
            assert len({a[0], s1[0], s2[0]}) == 3  # the root differs: every block differs
            assert not set(a) & set(s1) and not set(s1) & set(s2)
            if isolation == "none":
                assert b == a and salt_a == salt_b == "" and salt_s1 == "s1"
            else:
                assert not set(a) & set(b) and salt_a != salt_b
                assert "env-0" in salt_a and "env-1" in salt_b and salt_s1.endswith("s1")
            r = await c.post(
                "/v1/chat/completions",
                json={**body, "cache_salt": ""},
                headers={"Authorization": "Bearer sk-a"},
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_request_salt_roots_a_chain_of_its_own():
    from shared.protocol.hashing import hash_blocks, model_salt, request_salt

    root = model_salt("fp", "float32", 4)
    assert request_salt(root, "") is root  # no salt: the model's chain, as before
    ids = list(range(12))
    plain = hash_blocks(ids, 4, root)
    salted = hash_blocks(ids, 4, request_salt(root, "x"))
    assert len(salted) == 3 and not set(plain) & set(salted)
    assert salted == hash_blocks(ids, 4, request_salt(root, "x"))
    assert hash_blocks(ids, 4, request_salt(root, "y"))[0] != salted[0]


@pytest.mark.parametrize("stream", [False, True])
async def test_echo_with_logprobs_scores_the_prompt_and_max_tokens_0_only_scores(nats_url, stream):
    """Completions ``echo`` + ``logprobs`` (what lm-evaluation-harness and scoring scripts
    send): the choice's logprobs cover the prompt's tokens (the first without a logprob), then
    the outputs, from the engine's prompt logprobs; ``max_tokens: 0`` returns the prompt alone.
    The fake engine gives prompt token k (from the 2nd) logprob -k/10 beside alternative 7."""
    body = {**CMPL, "prompt": "abc", "echo": True, "logprobs": 1, "stream": stream}

    def merged(r: httpx.Response) -> tuple[str, dict, dict]:
        if not stream:
            choice = r.json()["choices"][0]
            return choice["text"], choice["logprobs"], r.json()["usage"]
        evs = sse_events(r.text)
        text, lps, use = "", {}, {}
        for ev in evs:
            for ch in ev["choices"]:
                text += ch["text"]
                for key, vals in (ch.get("logprobs") or {}).items():
                    lps.setdefault(key, []).extend(vals)
            use = ev.get("usage") or use
        return text, lps, use

    async with gateway(nats_url) as (url, peers, _):
        async with httpx.AsyncClient(base_url=url) as c:
            opts = {"stream_options": {"include_usage": True}} if stream else {}
            r = await c.post("/v1/completions", json={**body, **opts})
            assert r.status_code == 200, r.text
            assert peers.items[-1].sampling.prompt_logprobs == 1  # set from logprobs
            text, lps, use = merged(r)
            assert text == "abct0 t1 "
            assert lps["token_logprobs"] == [None, -0.1, -0.2, -0.5, -0.5]
            assert lps["top_logprobs"][0] is None and len(lps["top_logprobs"]) == 5
            # (no tokenizer here: a token's string is its id) the prompt token and alternative 7
            assert lps["top_logprobs"][2] == {"99": -0.2, "7": -0.05}
            assert lps["text_offset"][3] == 3  # the outputs start after the echoed "abc"
            assert "prompt_logprobs" not in r.text  # not asked for by that name
            assert use["completion_tokens"] == 2

            r = await c.post("/v1/completions", json={**body, "max_tokens": 0, **opts})
            assert r.status_code == 200, r.text
            assert peers.items[-1].sampling.max_tokens == 1
            text, lps, use = merged(r)
            assert text == "abc" and lps["token_logprobs"] == [None, -0.1, -0.2]
            assert lps["tokens"] == ["97", "98", "99"] and use["completion_tokens"] == 0
            if not stream:
                assert r.json()["choices"][0]["finish_reason"] == "length"

            bad = {**CMPL, "max_tokens": 0}
            r = await c.post("/v1/completions", json=bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
            r = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 0})
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
