"""vLLM's extra request fields through the whole cluster (prefill=1 decode=1: the first token is
sampled on prefill, the rest on decode; n-gram speculation on, which masked requests must not
use). Each expectation is computed first without the field (or from the tokenizer), so a field
that did nothing fails. docs/api.md lists the fields."""

from __future__ import annotations

import httpx
import pytest

from shared.model.tokenizer import Tokenizer
from tests.e2e.conftest import start_cluster

pytestmark = pytest.mark.e2e

MSGS = [{"role": "user", "content": "Is the blue shirt in stock?"}]


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
def h(cluster):
    with httpx.Client(base_url=cluster.gateway_url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def model(h) -> str:
    return h.get("/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def tok(default_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


def _chat(h, model, **kw) -> dict:
    body = {"model": model, "messages": MSGS, "max_tokens": 8, "temperature": 0, **kw}
    r = h.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _cmpl(h, model, **kw) -> dict:
    body = {"model": model, "max_tokens": 8, "temperature": 0, **kw}
    r = h.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_return_token_ids_are_the_tokenizers(h, model, tok):
    out = _chat(h, model, return_token_ids=True, ignore_eos=True)
    want = tok.encode(tok.apply_chat_template(MSGS, add_generation_prompt=True))
    assert out["prompt_token_ids"] == want
    ids = out["choices"][0]["token_ids"]
    assert len(ids) == 8 == out["usage"]["completion_tokens"]
    assert tok.decode(ids) == out["choices"][0]["message"]["content"]
    assert h.post("/tokenize", json={"messages": MSGS}).json()["tokens"] == want


def test_token_id_prompt_equals_its_text(h, model, tok):
    ids = tok.encode("the blue shirt")
    by_text = _cmpl(h, model, prompt="the blue shirt", ignore_eos=True)
    by_ids = _cmpl(h, model, prompt=ids, ignore_eos=True, echo=True)
    assert by_ids["choices"][0]["text"] == "the blue shirt" + by_text["choices"][0]["text"]
    two = _cmpl(h, model, prompt=[ids, ids[1:]], ignore_eos=True, return_token_ids=True)
    assert [c["prompt_token_ids"] for c in two["choices"]] == [ids, ids[1:]]
    assert two["choices"][0]["text"] == by_text["choices"][0]["text"]


def test_allowed_token_ids_make_every_token_that_one(h, model, tok):
    [x] = tok.encode(" blue")[-1:]
    for stream in (False, True):
        body = {
            "model": model,
            "messages": MSGS,
            "max_tokens": 6,
            "temperature": 0.8,
            "seed": 3,
            "allowed_token_ids": [x],
            "return_token_ids": True,
            "stream": stream,
        }
        r = h.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        if stream:
            import json

            lines = [ln[6:] for ln in r.text.split("\n") if ln.startswith("data: ")][:-1]
            ids = sum((json.loads(ln)["choices"][0].get("token_ids", []) for ln in lines), [])
        else:
            ids = r.json()["choices"][0]["token_ids"]
        assert ids == [x] * 6, (stream, ids)


def test_bad_words_move_greedy_off_its_token(h, model, tok):
    free = _chat(h, model, ignore_eos=True, return_token_ids=True)["choices"][0]["token_ids"]
    word = tok.decode([free[1]])
    assert word.strip(), f"second greedy token {free[1]} has no text: pick another prompt"
    banned = _chat(h, model, ignore_eos=True, return_token_ids=True, bad_words=[word])
    ids = banned["choices"][0]["token_ids"]
    assert ids[0] == free[0] and ids[1] != free[1]  # same start, then around the bad word
    assert free[1] not in ids


def test_include_stop_str_in_output_changes_the_text_exactly(h, model):
    text = _chat(h, model, max_tokens=24, ignore_eos=True)["choices"][0]["message"]["content"]
    stop = next(text[i : i + 2] for i in range(4, len(text) - 2) if text[i : i + 2].strip())
    at = text.find(stop)
    cut = _chat(h, model, max_tokens=24, ignore_eos=True, stop=[stop])["choices"][0]
    kept = _chat(
        h, model, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
    )["choices"][0]
    assert cut["message"]["content"] == text[:at] and cut["finish_reason"] == "stop"
    assert kept["message"]["content"] == text[: at + 2] and kept["finish_reason"] == "stop"


def test_continue_final_message_and_truncation(h, model, tok):
    msgs = [*MSGS, {"role": "assistant", "content": "The answer is"}]
    out = _chat(
        h,
        model,
        messages=msgs,
        add_generation_prompt=False,
        continue_final_message=True,
        chat_template_kwargs={"enable_thinking": False},
        return_token_ids=True,
    )
    closed = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert closed.endswith("The answer is<|im_end|>\n")
    assert out["prompt_token_ids"] == tok.encode(closed[: -len("<|im_end|>\n")])
    full = tok.encode(tok.apply_chat_template(MSGS, add_generation_prompt=True))
    cut = _chat(h, model, truncate_prompt_tokens=5, return_token_ids=True)
    assert cut["prompt_token_ids"] == full[-5:] and cut["usage"]["prompt_tokens"] == 5
    r = h.post(
        "/v1/chat/completions",
        json={"model": model, "messages": msgs, "continue_final_message": True},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_version_and_detokenize_over_the_tokenizer_service(h, tok):
    assert h.get("/version").json()["version"]
    ids = tok.encode("<|im_start|>blue shirt")
    assert h.post("/detokenize", json={"tokens": ids}).json() == {
        "prompt": "<|im_start|>blue shirt"
    }


def _sse_events(text: str) -> list[tuple[str, dict]]:
    import json

    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(ln.split(": ", 1) for ln in block.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_anthropic_messages_with_a_stop_sequence(h, model, tok):
    """The Messages API through the cluster: a stop sequence taken from the free greedy text
    ends the output there (stop_reason stop_sequence, the sequence not in the text), streamed
    and not; input_tokens is the chat template's prompt with the system prompt."""
    base = {
        "model": model,
        "max_tokens": 24,
        "temperature": 0,
        "system": "be brief",
        "messages": MSGS,
    }
    free = h.post("/v1/messages", json=base).json()
    text = free["content"][0]["text"]
    assert free["stop_reason"] in ("end_turn", "max_tokens") and free["usage"]["output_tokens"]
    msgs = [{"role": "system", "content": "be brief"}, *MSGS]
    prompt = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True))
    assert free["usage"]["input_tokens"] == len(prompt)
    count = h.post(
        "/v1/messages/count_tokens", json={"model": model, "system": "be brief", "messages": MSGS}
    )
    assert count.json() == {"input_tokens": len(prompt)}
    stop = next(text[i : i + 2] for i in range(4, len(text) - 2) if text[i : i + 2].strip())
    cut = h.post("/v1/messages", json={**base, "stop_sequences": [stop]}).json()
    assert cut["content"] == [{"type": "text", "text": text[: text.find(stop)]}]
    assert cut["stop_reason"] == "stop_sequence" and cut["stop_sequence"] == stop
    r = h.post("/v1/messages", json={**base, "stop_sequences": [stop], "stream": True})
    events = _sse_events(r.text)
    kinds = [k for k, _ in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) <= {"content_block_delta"}
    streamed = "".join(d["delta"]["text"] for k, d in events if k == "content_block_delta")
    assert streamed == cut["content"][0]["text"]
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}
