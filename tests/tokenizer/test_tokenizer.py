"""Tokenizer core against the real default model, and the service over a real nats-server."""

from __future__ import annotations

import pytest

from services.tokenizer.core import TokenizerCore
from shared.protocol.errors import StrataError
from shared.protocol.tok import TokenizeReply, TokenizeRequest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from shared.model.default_model import build_default_model

    return build_default_model(tmp_path_factory.mktemp("tokmodel"))


@pytest.fixture(scope="module")
def core(model_dir):
    return TokenizerCore(model_dir)


def _chat_with_images(n: int) -> list[dict]:
    parts = [{"type": "text", "text": "look"}]
    parts += [{"type": "image_url", "image_url": {"url": "data:..."}} for _ in range(n)]
    return [{"role": "system", "content": "be brief"}, {"role": "user", "content": parts}]


def test_images_expand_to_num_image_tokens(core):
    rep = core.encode(TokenizeRequest(request_id="r", messages=_chat_with_images(2)))
    k, img = core.config.num_image_tokens, core.config.image_token_id
    assert k == 16
    assert len(rep.image_spans) == 2
    assert sum(1 for t in rep.token_ids if t == img) == 2 * k
    for span in rep.image_spans:
        assert span.length == k
        assert rep.token_ids[span.offset : span.offset + k] == [img] * k
    assert rep.image_spans[1].offset == rep.image_spans[0].offset + k  # adjacent parts


def test_chat_matches_template_and_metadata(core, model_dir):
    from shared.model.loader import load_model
    from shared.model.tokenizer import Tokenizer

    msgs = [{"role": "user", "content": "hello there"}]
    rep = core.encode(TokenizeRequest(request_id="r", messages=msgs))
    tok = Tokenizer.from_dir(model_dir)
    want = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True))
    assert rep.token_ids == want and rep.image_spans == []
    # string content and a single text part render identically
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}]
    assert core.encode(TokenizeRequest(request_id="r", messages=parts)).token_ids == want
    assert rep.model_fingerprint == load_model(model_dir).fingerprint
    assert rep.kv_dtype == "float32" and rep.block_size == 16
    assert rep.max_model_len == core.config.max_position_embeddings > 0
    assert rep.started_at <= rep.finished_at


def test_a_dtype_override_keys_blocks_like_the_engine_that_runs_it(model_dir):
    """`strata up --dtype bfloat16` on an fp32 checkpoint: the tokenizer's fingerprint (in every
    block hash) and KV dtype are those of the bf16 engine, so prefix blocks still match."""
    import torch

    from shared.model.loader import load_model

    rep = TokenizerCore(model_dir, "bfloat16").encode(TokenizeRequest(request_id="r", prompt="hi"))
    engine = load_model(model_dir, dtype=torch.bfloat16)
    assert rep.model_fingerprint == engine.fingerprint != load_model(model_dir).fingerprint
    assert rep.kv_dtype == "bfloat16"


def test_prompt_and_errors(core):
    rep = core.encode(TokenizeRequest(request_id="r", prompt="hello"))
    assert rep.token_ids == core.tokenizer.encode("hello") and rep.text == "hello"
    with pytest.raises(StrataError, match="exactly one"):
        core.encode(TokenizeRequest(request_id="r"))
    with pytest.raises(StrataError, match="must not be empty"):
        core.encode(TokenizeRequest(request_id="r", messages=[]))
    # a literal "<image>" in text without an image part is refused, not silently expanded
    with pytest.raises(StrataError, match="1 image placeholders but 0 images"):
        core.encode(
            TokenizeRequest(request_id="r", messages=[{"role": "user", "content": "<image> hi"}])
        )


async def test_service_over_nats(nc, core):
    from services.tokenizer.app import serve_tokenizer
    from shared import bus
    from shared.protocol import subjects

    sub = await serve_tokenizer(nc, core)
    try:
        req = TokenizeRequest(request_id="r1", messages=_chat_with_images(1))
        rep = await bus.request(nc, subjects.TOK_ENCODE, req, TokenizeReply, timeout=10)
        assert len(rep.image_spans) == 1 and rep.image_spans[0].length == 16
        with pytest.raises(StrataError) as ei:
            await bus.request(
                nc, subjects.TOK_ENCODE, TokenizeRequest(request_id="x"), TokenizeReply, timeout=10
            )
        assert ei.value.code == "bad_request"
    finally:
        await sub.unsubscribe()
