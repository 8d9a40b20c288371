"""OpenAI request bodies the gateway accepts (plus Strata/vLLM extras), as pydantic models.

No field is silently ignored: an unknown field is a 400 naming it (the OpenAI SDK sends only the
fields its caller passed), and known fields are validated, a bad one named in the 400.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

_I32 = 2**31 - 1  # ints that reach the bus must fit msgpack and the engine's index types
TokenId = Annotated[int, Field(ge=0, le=_I32)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ImageURL(_Body):
    url: str = Field(..., max_length=64 << 20)
    detail: str | None = None


class ContentPart(_Body):
    type: Literal["text", "image_url", "input_text"]
    text: str | None = None
    image_url: ImageURL | str | None = None


class FunctionCall(_Body):
    name: str = Field(..., min_length=1, max_length=256)
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string


class ToolCall(_Body):
    id: str = Field("", max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool result: the call it answers
    refusal: None = None  # echoed back by SDK users; only empty is meaningful


class FunctionDef(_Body):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Body):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's newer ``structured_outputs`` object (one of its fields)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: with include_usage, usage on every chunk


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
    logit_bias: dict[str, float] | None = Field(None, max_length=1024)
    best_of: int | None = Field(None, ge=1)
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False  # prompt_token_ids / token_ids on the response
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=_I32)  # keep the last k; -1 all
    spaces_between_special_tokens: bool = True
    bad_words: list[Annotated[str, Field(min_length=1, max_length=256)]] | None = Field(
        None, max_length=256
    )
    allowed_token_ids: list[TokenId] | None = Field(None, max_length=1 << 17)
    add_special_tokens: bool | None = None  # default: the tokenizer's own post-processing off
    # each prompt token's logprob and rank, plus the top-n (the engine skips the prefix cache)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    # Structured outputs (docs/STRUCTURED.md): OpenAI's response_format or one vLLM extra
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    # Strata extras: scheduling class (also settable by X-Strata-Priority / X-Strata-Slo-Class)
    priority: int | None = Field(None, ge=-1000, le=1000)
    slo_class: Literal["interactive", "batch"] | None = None
    # TTFT target in ms for the scheduler (also X-Strata-TTFT-SLO-Ms); None = the class default
    ttft_slo_ms: float | None = Field(None, gt=0, le=3_600_000)
    # Strata extra: use the response cache (also X-Strata-Cache: use / off); docs/api.md
    cache: StrictBool | None = None
    # vLLM: cached KV (prefix cache, pool) is shared only between requests of the same salt
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False  # vLLM: a last assistant message is prepended to the output
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # OpenAI fields with no effect on a server that keeps nothing and has one tier (vLLM
    # accepts them too): taken so the SDK's callers need not strip them; docs/api.md
    store: bool | None = None
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | (
        None
    ) = Field(None, max_length=16)
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    # handed to the chat template as the kwarg of that name (as vLLM does; templates that do
    # not read it ignore it); an explicit chat_template_kwargs entry wins
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None


class CompletionRequest(_Sampling):
    # 0 with echo: the prompt scored, nothing generated (OpenAI's legacy API and vLLM)
    max_tokens: int | None = Field(None, ge=0)
    # text, token ids, several texts or several token-id lists (one prompt each)
    prompt: str | list[TokenId] | list[list[TokenId]] | list[str]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class TokenizeBody(_Body):
    """vLLM's ``/tokenize``: a ``prompt`` or chat ``messages`` (rendered by the template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    tools: list[Tool] | None = None
    return_token_strs: bool = False


class DetokenizeBody(_Body):
    """vLLM's ``/detokenize``: token ids back to text."""

    model: str | None = None
    tokens: list[TokenId] = Field(..., max_length=1 << 20)


def body_schema(kind: str) -> type[_Sampling]:
    return ChatCompletionRequest if kind == "chat" else CompletionRequest


def dump_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as plain dicts for the tokenizer (image parts reduced to their type; a tool
    call's JSON-string arguments parsed into an object, as chat templates expect)."""
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
        d: dict[str, Any] = {"role": m.role, "content": content if content is not None else ""}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": _arguments(c.function.arguments),
                    },
                }
                for c in m.tool_calls
            ]
        out.append(d)
    return out


def bus_int(text: str) -> int:
    """A JSON integer the bus can carry: msgpack holds -2**63 .. 2**64-1 (20 digits at most,
    so a longer one is refused before it is converted); else ValueError."""
    if len(text) <= 21:
        v = int(text)
        if -(1 << 63) <= v < (1 << 64):
            return v
    raise ValueError(f"integer out of range: {text if len(text) <= 40 else text[:20] + '...'}")


def _arguments(args: str | dict[str, Any]) -> Any:
    """A tool call's arguments as an object when they are JSON the bus can carry; else the
    string as sent (an integer beyond 64 bits inside it stays text, never reaches msgpack)."""
    if isinstance(args, dict):
        return args
    try:
        return json.loads(args, parse_int=bus_int)
    except ValueError:
        return args


def dump_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The request's tools as the chat template's ``tools`` variable (OpenAI shape)."""
    if not req.tools:
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools]
