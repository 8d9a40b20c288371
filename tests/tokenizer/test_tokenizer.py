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
        from shared.protocol.tok import DetokenizeReply, DetokenizeRequest

        ids = core.tokenizer.encode("blue shirt")
        dreq = DetokenizeRequest(request_id="d", token_ids=ids)
        drep = await bus.request(nc, subjects.TOK_DECODE, dreq, DetokenizeReply, timeout=10)
        assert drep.text == "blue shirt"
    finally:
        await sub.unsubscribe()


THINKING_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}"
)


@pytest.fixture(scope="module")
def thinking_core(model_dir, tmp_path_factory):
    """The default model with a Qwen3-like template that reads ``enable_thinking``."""
    import json
    import shutil

    out = tmp_path_factory.mktemp("thinking") / "m"
    shutil.copytree(model_dir, out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(
        json.dumps({**cfg, "chat_template": THINKING_TEMPLATE})
    )
    return TokenizerCore(out)


def test_chat_template_kwargs_reach_the_template(thinking_core):
    msgs = [{"role": "user", "content": "hi"}]
    plain = thinking_core.encode(TokenizeRequest(request_id="r", messages=msgs))
    off = thinking_core.encode(
        TokenizeRequest(
            request_id="r", messages=msgs, chat_template_kwargs={"enable_thinking": False}
        )
    )
    assert plain.text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert off.text == plain.text + "<think></think>"
    assert off.token_ids == thinking_core.tokenizer.encode(off.text)
    with pytest.raises(StrataError, match="add_generation_prompt"):
        thinking_core.encode(
            TokenizeRequest(
                request_id="r", messages=msgs, chat_template_kwargs={"add_generation_prompt": 1}
            )
        )


def test_continue_final_message_leaves_the_last_message_open(core):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
    done = core.encode(TokenizeRequest(request_id="r", messages=msgs, add_generation_prompt=False))
    cont = core.encode(
        TokenizeRequest(
            request_id="r", messages=msgs, add_generation_prompt=False, continue_final_message=True
        )
    )
    assert done.text.endswith("The answer is<|im_end|>\n")
    assert cont.text == done.text[: -len("<|im_end|>\n")]
    assert cont.token_ids == core.tokenizer.encode(cont.text)


def test_token_id_prompts_truncation_and_bad_words(core):
    ids = core.tokenizer.encode("the blue shirt is in stock")
    rep = core.encode(TokenizeRequest(request_id="r", prompt_token_ids=ids))
    assert rep.token_ids == ids and rep.text == "the blue shirt is in stock"
    assert rep.vocab_size == core.tokenizer.vocab_size > 0
    with pytest.raises(StrataError, match="not in the vocabulary"):
        core.encode(TokenizeRequest(request_id="r", prompt_token_ids=[rep.vocab_size]))
    cut = core.encode(
        TokenizeRequest(request_id="r", prompt_token_ids=ids, truncate_prompt_tokens=2)
    )
    assert cut.token_ids == ids[-2:] and cut.text == core.tokenizer.decode(ids[-2:])
    text = core.encode(
        TokenizeRequest(request_id="r", prompt="the blue shirt", truncate_prompt_tokens=1)
    )
    assert text.token_ids == core.tokenizer.encode("the blue shirt")[-1:]
    whole = core.encode(TokenizeRequest(request_id="r", prompt="ab", truncate_prompt_tokens=-1))
    assert whole.token_ids == core.tokenizer.encode("ab")
    for bad in (0, -2, core.max_model_len + 1):
        with pytest.raises(StrataError, match="truncate_prompt_tokens"):
            core.encode(TokenizeRequest(request_id="r", prompt="ab", truncate_prompt_tokens=bad))
    words = core.encode(TokenizeRequest(request_id="r", prompt="x", bad_words=["shirt"]))
    plain, spaced = core.tokenizer.encode("shirt"), core.tokenizer.encode(" shirt")
    want = [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])
    assert words.bad_words_ids == want


def test_decode(core):
    from shared.protocol.tok import DetokenizeRequest

    ids = core.tokenizer.encode("<|im_start|>blue shirt")
    rep = core.decode(DetokenizeRequest(request_id="r", token_ids=ids))
    assert rep.text == "<|im_start|>blue shirt"
    skip = core.decode(DetokenizeRequest(request_id="r", token_ids=ids, skip_special_tokens=True))
    assert skip.text == "blue shirt"
    with pytest.raises(StrataError, match="not in the vocabulary"):
        core.decode(DetokenizeRequest(request_id="r", token_ids=[10**6]))
