"""`strata.tok.encode`: text or chat messages -> token ids with image placeholders expanded."""

from __future__ import annotations

from typing import Any

from shared.protocol.base import Msg


class TokenizeRequest(Msg):
    request_id: str
    # Exactly one of `messages` (chat; rendered with the model's chat template) or `prompt`.
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    # OpenAI tools, passed to the chat template as ``tools`` (as transformers does)
    tools: list[dict[str, Any]] | None = None


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
    model_fingerprint: str = ""  # `shared.model.loader` fingerprint of the checkpoint
    kv_dtype: str = ""  # "float32" | "bfloat16" | "float16"
    block_size: int = 16
    max_model_len: int = 0  # context length (prompt + output tokens)
    eos_token_ids: list[int] = []
    # Wall-clock (time.time()) bounds of the tokenize work, so callers can check EPD overlap.
    started_at: float = 0.0
    finished_at: float = 0.0
