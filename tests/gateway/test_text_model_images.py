"""An image sent to a text-only model is a 400 naming the model, decided by the gateway from the
checkpoint's config.json before anything goes on the bus (no vision service is running for a
text model, so waiting on ``strata.vision.encode`` would answer 503 or time out)."""

from __future__ import annotations

import base64
import io
import json

import httpx
import pytest
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers

from tests.gateway.harness import gateway


def _png() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _checkpoint(path, arch: str):
    """config.json and tokenizer.json: what the gateway reads from a checkpoint."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": [arch]}))
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    return str(path)


def _chat(with_image: bool) -> dict:
    parts = [{"type": "text", "text": "what is this?"}]
    if with_image:
        parts.append({"type": "image_url", "image_url": {"url": _png()}})
    return {"model": "tiny", "messages": [{"role": "user", "content": parts}], "max_tokens": 2}


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "LlamaForCausalLM", "Qwen3ForCausalLM"])
async def test_image_to_a_text_model_is_a_400(nats_url, tmp_path, arch):
    model = _checkpoint(tmp_path / "text", arch)
    async with gateway(nats_url, model=model) as (url, peers, service):
        assert service.cfg.max_images == 0  # decided once, at start-up, from config.json
        async with httpx.AsyncClient(base_url=url) as c:
            r = await c.post("/v1/chat/completions", json=_chat(with_image=True))
            assert r.status_code == 400, r.text
            assert r.json()["error"] == {
                "message": "model 'tiny' does not accept images",
                "type": "invalid_request_error",
                "param": "messages",
                "code": "bad_request",
            }
            # nothing was tokenized, encoded, routed or submitted for it
            assert peers.windows == {} and peers.routes == [] and peers.items == []
            r = await c.post("/v1/chat/completions", json=_chat(with_image=False))
            assert r.status_code == 200, r.text  # text requests are served as before
            assert len(peers.items) == 1 and "vis" not in peers.windows


async def test_image_to_a_multimodal_model_goes_to_the_vision_service(nats_url, tmp_path):
    model = _checkpoint(tmp_path / "llava", "LlavaForConditionalGeneration")
    async with gateway(nats_url, model=model) as (url, peers, service):
        assert service.cfg.max_images == 4
        async with httpx.AsyncClient(base_url=url) as c:
            r = await c.post("/v1/chat/completions", json=_chat(with_image=True))
            assert r.status_code == 200, r.text
            assert "vis" in peers.windows and len(peers.items[0].images) == 1
