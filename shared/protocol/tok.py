"""`strata.tok.encode`: text or chat messages -> token ids with image placeholders expanded."""

from __future__ import annotations

from typing import Any

from shared.protocol.base import Msg
from shared.protocol.sampling import StructuredSpec


class TokenizeRequest(Msg):
    request_id: str
    # Exactly one of `messages` (chat; rendered with the model's chat template) or `prompt`.
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    # OpenAI tools, passed to the chat template as ``tools`` (as transformers does)
    tools: list[dict[str, Any]] | None = None
    # Extra chat template variables (vLLM's ``chat_template_kwargs``, e.g. ``enable_thinking``)
    chat_template_kwargs: dict[str, Any] | None = None
    # Render without closing the last (assistant) message, so the model continues it
    continue_final_message: bool = False
    # A prompt given as token ids: checked against the vocabulary and echoed back with the
    # metadata (``text`` is their decoding); exclusive with ``messages`` and ``prompt``
    prompt_token_ids: list[int] | None = None
    # Keep only the last k prompt tokens (vLLM's ``truncate_prompt_tokens``); None: all
    truncate_prompt_tokens: int | None = None
    # vLLM's ``bad_words``: each is tokenized (with and without a leading space) for the reply
    bad_words: list[str] = []
    # The request's output constraint, compiled here before anything else (the gateway imports
    # no torch, so no grammar compiler): a bad one is a ``bad_request`` whose message starts
    # with ``constraint_param + ": "`` (the request field it came from)
    constraint: StructuredSpec | None = None
    constraint_param: str = ""


class ImageSpan(Msg):
    """Where one image's embeddings replace placeholder tokens in the prompt."""

    offset: int
    length: int


class TokenizeReply(Msg):
    token_ids: list[int]
    image_spans: list[ImageSpan] = []
    # The rendered prompt text (chat template output); useful for debugging and echo.
    text: str = ""
    # What the gateway needs to compute KV block hashes (`shared.protocol.hashing.model_salt`):
    model_fingerprint: str = ""  # `shared.model.fingerprint` of the checkpoint
    kv_dtype: str = ""  # "float32" | "bfloat16" | "float16"
    block_size: int = 16
    max_model_len: int = 0  # context length (prompt + output tokens)
    eos_token_ids: list[int] = []
    vocab_size: int = 0  # the tokenizer's, added tokens included (0: unknown)
    bad_words_ids: list[list[int]] = []  # the request's ``bad_words`` as token sequences
    # Wall-clock (time.time()) bounds of the tokenize work, so callers can check EPD overlap.
    started_at: float = 0.0
    finished_at: float = 0.0


class DetokenizeRequest(Msg):
    """`strata.tok.decode`: token ids back to text (the gateway's ``/detokenize``)."""

    request_id: str
    token_ids: list[int]
    skip_special_tokens: bool = False


class DetokenizeReply(Msg):
    text: str
