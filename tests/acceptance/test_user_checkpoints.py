"""The user's first hour: ``strata up --model DIR`` on checkpoints that today's transformers saves
(text, MoE and LLaVA, several shapes), with no other flag, served through the official ``openai``
client. Streamed and non-streamed chat and completions equal transformers' greedy tokens — text
and per-token log-probabilities — through the whole default cluster (gateway, tokenizer, vision
when the model has a tower, scheduler, prefill, decode, kvstore, MinIO)."""

from __future__ import annotations

import base64
import io
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from tests.acceptance.checkpoints import build_llava, build_text, greedy, test_image
from tests.acceptance.conftest import Up, strata_up

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

N = 12
CHAT = [{"role": "user", "content": "Tell me about the tiers of a KV cache."}]
PROMPT = "The gateway streams tokens"
LOGPROB_TOL = 2e-3


@pytest.fixture(scope="module")
def stopping():
    """Ctrl-C of each architecture's ``strata up``, waited for in the background while the next
    one starts (a stop is mostly waiting: drain, flush, exit); every exit code is checked
    before this module ends."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        stops: list[tuple[Up, Future[int]]] = []
        yield lambda up: stops.append((up, pool.submit(up.stop)))
        for up, rc in stops:
            assert rc.result() == 0, up.output()[-3000:]


# Each costs one cluster start (10-25 s on a 2-core box): Qwen3-MoE (routed and dense layers)
# and Mixtral are the MoE ones, Gemma-2 its own model class (soft-capping), Gemma-3 its own
# forward (a RoPE per layer type). Phi-3 differs from Llama only in how the loader splits its
# fused tensors, Granite only by scalars, Qwen2-MoE by a shared expert, OLMo-2 by where its norms
# sit: tests/model covers them.
@pytest.fixture(
    scope="module",
    params=["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma2", "gemma3", "llava"],
)
def served(request, tmp_path_factory, stopping):
    tmp = tmp_path_factory.mktemp(request.param)
    path = tmp / "checkpoint"
    ck = build_llava(path) if request.param == "llava" else build_text(request.param, path)
    up = strata_up(str(path), tmp)
    client = openai.OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0)
    yield ck, client, up
    stopping(up)


def _chat_ids(ck) -> list[int]:
    text = ck.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    return ck.tokenizer(text, add_special_tokens=False)["input_ids"]


def _text(ck, ids: list[int]) -> str:
    return ck.tokenizer.decode(ids, skip_special_tokens=True)


def _model(client) -> str:
    return client.models.list().data[0].id


def test_the_vision_role_runs_exactly_when_the_model_has_a_tower(served):
    ck, _, up = served
    started_vision = "vision-0" in up.output() and "STRATA_READY role=vision" in up.output()
    assert started_vision == (ck.name == "llava"), up.output()[-3000:]


def test_chat_equals_transformers_greedy_tokens_text_and_logprobs(served):
    ck, client, _ = served
    ids = _chat_ids(ck)
    ref, ref_lp = greedy(ck, ids, N)
    r = client.chat.completions.create(
        model=_model(client),
        messages=CHAT,
        max_tokens=N,
        temperature=0.0,
        logprobs=True,
        top_logprobs=1,
        extra_body={"ignore_eos": True},
    )
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == N
    assert r.choices[0].message.content == _text(ck, ref)
    got = [c.logprob for c in r.choices[0].logprobs.content]
    want = [float(lp[t]) for lp, t in zip(ref_lp, ref, strict=True)]
    assert len(got) == N
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < LOGPROB_TOL, (got, want)


def test_streamed_chat_equals_transformers_greedy(served):
    ck, client, _ = served
    ref, _ = greedy(ck, _chat_ids(ck), N)
    stream = client.chat.completions.create(
        model=_model(client),
        messages=CHAT,
        max_tokens=N,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(parts) == _text(ck, ref)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_equals_transformers_greedy(served, stream):
    ck, client, _ = served
    ids = ck.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    ref, _ = greedy(ck, ids, N)
    r = client.completions.create(
        model=_model(client),
        prompt=PROMPT,
        max_tokens=N,
        temperature=0.0,
        stream=stream,
        extra_body={"ignore_eos": True},
    )
    text = "".join(c.choices[0].text for c in r if c.choices) if stream else r.choices[0].text
    assert text == _text(ck, ref)


@pytest.mark.parametrize("stream", [False, True])
def test_image_chat_equals_transformers_llava_greedy(served, stream):
    ck, client, _ = served
    image = test_image()
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    content = [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "Describe this image."},
    ]
    kw = dict(
        model=_model(client),
        messages=[{"role": "user", "content": content}],
        max_tokens=N,
        temperature=0.0,
        stream=stream,
        extra_body={"ignore_eos": True},
    )
    if ck.processor is None:  # a text model: a clear 400 that names the problem
        with pytest.raises(openai.BadRequestError, match="image"):
            client.chat.completions.create(**kw)
        return
    hf_msgs = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}],
        }
    ]
    text = ck.processor.apply_chat_template(hf_msgs, add_generation_prompt=True, tokenize=False)
    inputs = ck.processor(text=text, images=[image], return_tensors="pt")
    ref, _ = greedy(ck, inputs["input_ids"][0].tolist(), N, inputs["pixel_values"])
    r = client.chat.completions.create(**kw)
    out = (
        "".join(c.choices[0].delta.content or "" for c in r if c.choices)
        if stream
        else r.choices[0].message.content
    )
    assert out == _text(ck, ref)
