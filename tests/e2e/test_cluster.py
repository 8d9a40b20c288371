"""The whole cluster end to end: the official openai client against the REST gateway, greedy
output equal to an in-process run (with the prompt's KV pushed prefill -> decode, per the
transfer byte counters), an image request, clean errors, and no process left behind."""

from __future__ import annotations

import base64
import io
import os
import signal

import httpx
import pytest
import torch
from PIL import Image

from tests.cluster_kv.conftest import kv_bytes_per_token, moved_since, transfer_counters
from tests.e2e.conftest import start_cluster

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.e2e

PROMPT = [{"role": "user", "content": "Tell me about the tiers of a KV cache."}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def cluster(default_model_dir):
    # layer-wise push set explicitly: its default (auto) depends on the machine's cores
    c = start_cluster(
        default_model_dir,
        prefill=1,
        decode=1,
        kvstore=1,
        vision=1,
        env={"STRATA_LAYERWISE_TRANSFER": "true"},
    )
    pids = [p.pid for p in c.sup.procs.values()]
    yield c
    c.stop()
    for pid in pids:  # nothing the cluster started may survive it
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.gateway_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference_text(default_model_dir) -> str:
    """Greedy continuation computed in-process by the same engine code, no services involved."""
    from shared.engine.engine import LLMEngine
    from shared.engine.params import EngineConfig
    from shared.model.loader import load_model
    from shared.model.tokenizer import Tokenizer
    from shared.protocol.sampling import SamplingParams

    tok = Tokenizer.from_dir(default_model_dir)
    ids = tok.encode(tok.apply_chat_template(PROMPT, add_generation_prompt=True))
    engine = LLMEngine(load_model(default_model_dir), EngineConfig(kv_cache_bytes=16 << 20))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    with torch.inference_mode():
        out = engine.generate([ids], params)[0]
    return tok.decode(out)


def _model_id(client) -> str:
    return client.models.list().data[0].id


def test_chat_completion_matches_in_process_greedy(cluster, client, reference_text):
    t0 = transfer_counters(cluster)
    r = client.chat.completions.create(
        model=_model_id(client), messages=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0
    )
    assert r.choices[0].message.content == reference_text
    assert r.usage.completion_tokens <= MAX_TOKENS
    assert r.usage.prompt_tokens > 0
    # the same text would come from a decode that recomputed: the counters show the push worked
    n = r.usage.prompt_tokens * kv_bytes_per_token(cluster.model_dir)
    assert moved_since(t0, transfer_counters(cluster)) == {
        "sent:layerwise": n,
        "received:layerwise": n,
    }


def test_streamed_chat_completion_matches_in_process_greedy(client, reference_text):
    stream = client.chat.completions.create(
        model=_model_id(client),
        messages=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        stream=True,
    )
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(parts) > 1
    assert "".join(parts) == reference_text


def test_image_request_equals_transformers_llava_greedy(client, default_model_dir):
    """The answer to an image request, through prefill, vision and decode, equals transformers'
    LlavaForConditionalGeneration greedy on the same checkpoint, image and prompt (the
    checkpoint's own image processor and chat template on the transformers side)."""
    transformers = pytest.importorskip("transformers")
    from tests.acceptance.checkpoints import Checkpoint, greedy

    img = Image.new("RGB", (80, 60), (200, 30, 60))
    img.paste((20, 200, 90), (10, 10, 50, 40))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    question = "What is in this picture?"
    r = client.chat.completions.create(
        model=_model_id(client),
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True},
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": question},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
    )
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(default_model_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    proc = transformers.AutoImageProcessor.from_pretrained(default_model_dir)
    msgs = [{"role": "user", "content": [{"type": "text", "text": question}, {"type": "image"}]}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ids: list[int] = []
    image_id = hf.config.image_token_id
    for t in tok(text, add_special_tokens=False)["input_ids"]:
        ids += [t] * (hf.config.image_seq_length if t == image_id else 1)
    pixels = torch.as_tensor(proc([img], return_tensors="pt")["pixel_values"])
    ref, _ = greedy(Checkpoint("default", default_model_dir, hf, tok), ids, MAX_TOKENS, pixels)
    assert r.usage.prompt_tokens == len(ids)  # the image placeholders were expanded alike
    assert r.choices[0].message.content == tok.decode(ref, skip_special_tokens=True)


def test_malformed_json_is_a_clear_400(cluster):
    r = httpx.post(
        cluster.gateway_url + "/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code in (400, 422)
    assert "json" in r.json()["error"]["message"].lower()


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="no-such-model", messages=PROMPT, max_tokens=2)
    assert "no-such-model" in str(exc.value)


def test_prompt_over_context_is_400(client):
    huge = "word " * 20000
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=_model_id(client), messages=[{"role": "user", "content": huge}], max_tokens=2
        )
    assert "context" in str(exc.value).lower()


def test_empty_messages_is_400(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=_model_id(client), messages=[], max_tokens=2)
    assert "messages" in str(exc.value).lower()


def test_no_decode_instance_is_a_clean_503(cluster, client):
    """Runs last in this module: kills the only decode instance."""
    model = _model_id(client)
    cluster.kill("decode-0", signal.SIGKILL)
    r = httpx.post(
        cluster.gateway_url + "/v1/chat/completions",
        timeout=30.0,
        json={"model": model, "messages": PROMPT, "max_tokens": 2},
    )
    assert r.status_code == 503
    assert r.json()["error"]["message"]
