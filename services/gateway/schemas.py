"""OpenAI request bodies the gateway accepts (plus Strata/vLLM extras), as pydantic models.

Unknown fields are ignored (as OpenAI does); known fields are validated and a bad one is named in
the 400 the client gets.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

_I32 = 2**31 - 1  # ints that reach the bus must fit msgpack and the engine's index types
TokenId = Annotated[int, Field(ge=0, le=_I32)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ImageURL(_Body):
    url: str = Field(..., max_length=64 << 20)
    detail: str | None = None


class ContentPart(_Body):
    type: Literal["text", "image_url", "input_text"]
    text: str | None = None
    image_url: ImageURL | str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """Fields shared by chat and completions requests."""

    model: str = Field(..., min_length=1, max_length=256)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=128)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    user: str | None = None
    # vLLM-style extras
    top_k: int | None = Field(None, ge=-1, le=_I32)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=_I32)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=1024)
    skip_special_tokens: bool = True
    # Strata extras: scheduling class (also settable by X-Strata-Priority / X-Strata-Slo-Class)
    priority: int | None = Field(None, ge=-1000, le=1000)
    slo_class: Literal["interactive", "batch"] | None = None
    # TTFT target in ms for the scheduler (also X-Strata-TTFT-SLO-Ms); None = the class default
    ttft_slo_ms: float | None = Field(None, gt=0, le=3_600_000)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


def body_schema(kind: str) -> type[_Sampling]:
    return ChatCompletionRequest if kind == "chat" else CompletionRequest


def dump_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as plain dicts for the tokenizer (image parts reduced to their type)."""
    out = []
    for m in req.messages:
        content: Any = m.content
        if isinstance(content, list):
            content = [
                {"type": "image"}
                if p.type == "image_url"
                else {"type": "text", "text": p.text or ""}
                for p in content
            ]
        out.append({"role": m.role, "content": content if content is not None else ""})
    return out
