"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) over the chat
path: pure translation, no I/O.

`to_chat` validates an Anthropic body and turns it into an OpenAI chat body (the system prompt
first; ``stop_sequences`` become ``stop`` with ``include_stop_str_in_output``, so the output
says which one ended it); `message` builds the response object from the chat response and
`EventStream` turns OpenAI chunks into the Messages streaming events (message_start,
content_block_start, content_block_delta, content_block_stop, message_delta, message_stop).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from services.gateway.core import ApiError, validation_error
from services.gateway.schemas import _Body
from shared.protocol.errors import StrataError


class ImageSource(_Body):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = Field(None, max_length=64 << 20)
    url: str | None = None


class ResultBlock(_Body):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None


class ContentBlock(_Body):
    type: Literal["text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking"]
    text: str | None = None
    # an earlier assistant turn's reasoning, sent back as Anthropic asks: not put in the prompt
    # (chat templates that think drop earlier turns' reasoning too)
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None
    source: ImageSource | None = None
    cache_control: dict[str, Any] | None = None  # a prompt-caching hint: Strata caches anyway
    id: str | None = Field(None, max_length=256)  # tool_use
    name: str | None = Field(None, max_length=256)
    input: dict[str, Any] | None = None
    tool_use_id: str | None = Field(None, max_length=256)  # tool_result
    content: str | list[ResultBlock] | None = None
    is_error: bool | None = None


class AnthropicTool(_Body):
    type: Literal["custom"] | None = None
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class AnthropicToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class ThinkingConfig(_Body):
    """Extended thinking: ``enabled`` with a ``budget_tokens`` (at least 1,024, under
    ``max_tokens``, as Anthropic checks; the model's own end of thinking or ``max_tokens`` ends
    it), or ``disabled``. Handed to the chat template as ``enable_thinking``."""

    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(None, ge=1024)


class AnthropicMetadata(_Body):
    user_id: str | None = None


class MessagesRequest(_Body):
    """The fields of Anthropic's ``POST /v1/messages`` that Strata serves (docs/api.md)."""

    model: str = Field(..., min_length=1, max_length=256)
    messages: list[AnthropicMessage] = Field(..., min_length=1)
    max_tokens: int = Field(..., ge=1)
    system: str | list[ContentBlock] | None = None
    stop_sequences: list[str] | None = Field(None, max_length=16)
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: AnthropicMetadata | None = None
    tools: list[AnthropicTool] | None = Field(None, max_length=128)
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None


class CountTokensRequest(_Body):
    model: str = Field(..., min_length=1, max_length=256)
    messages: list[AnthropicMessage] = Field(..., min_length=1)
    system: str | list[ContentBlock] | None = None
    tools: list[AnthropicTool] | None = Field(None, max_length=128)
    tool_choice: AnthropicToolChoice | None = None


def _parse(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _content(blocks: list[ContentBlock]) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    for b in blocks:
        if b.type == "text":
            parts.append({"type": "text", "text": b.text or ""})
        else:
            src = b.source
            if src is None or (src.type == "base64" and not (src.data and src.media_type)):
                raise ApiError(
                    "bad_request",
                    "an image block needs source {type: base64, media_type, data} or a url",
                    param="messages",
                )
            url = src.url if src.type == "url" else f"data:{src.media_type};base64,{src.data}"
            parts.append({"type": "image_url", "image_url": {"url": url}})
    return parts


def _system(system: str | list[ContentBlock] | None) -> list[dict[str, Any]]:
    if not system:
        return []
    text = system if isinstance(system, str) else "".join(b.text or "" for b in system)
    return [{"role": "system", "content": text}]


def _bad(k: int, why: str) -> ApiError:
    return ApiError("bad_request", f"messages[{k}]: {why}", param="messages")


def _turns(k: int, m: AnthropicMessage) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: an assistant's ``tool_use`` blocks become its
    ``tool_calls``; a user's ``tool_result`` blocks become ``tool`` messages (before the rest of
    that user turn)."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    uses = [b for b in m.content if b.type == "tool_use"]
    results = [b for b in m.content if b.type == "tool_result"]
    rest = [b for b in m.content if b.type in ("text", "image")]
    if uses and m.role != "assistant":
        raise _bad(k, "tool_use blocks belong to assistant messages")
    if results and m.role != "user":
        raise _bad(k, "tool_result blocks belong to user messages")
    out: list[dict[str, Any]] = []
    for b in results:
        if not b.tool_use_id:
            raise _bad(k, "a tool_result block needs tool_use_id")
        text = b.content if isinstance(b.content, str) else "".join(r.text for r in b.content or [])
        out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": text})
    msg: dict[str, Any] = {"role": m.role, "content": _content(rest)}
    if uses:
        for b in uses:
            if not (b.id and b.name and b.input is not None):
                raise _bad(k, "a tool_use block needs id, name and input")
        msg["content"] = "".join(p.get("text", "") for p in msg["content"]) or None
        msg["tool_calls"] = [
            {
                "id": b.id,
                "type": "function",
                "function": {"name": b.name, "arguments": json.dumps(b.input)},
            }
            for b in uses
        ]
    if rest or uses or not results:
        out.append(msg)
    return out


def chat_messages(req: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as OpenAI chat messages, the system prompt first."""
    msgs = _system(req.system)
    for k, m in enumerate(req.messages):
        msgs += _turns(k, m)
    return msgs


def chat_tools(req: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    """``tools`` / ``tool_choice`` / ``parallel_tool_calls`` of the chat body."""
    if not req.tools:
        if req.tool_choice is not None and req.tool_choice.type != "none":
            raise ApiError("bad_request", "tool_choice needs tools", param="tool_choice")
        return {}
    out: dict[str, Any] = {
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "parameters": t.input_schema,
                    **({"description": t.description} if t.description else {}),
                },
            }
            for t in req.tools
        ]
    }
    tc = req.tool_choice
    if tc is not None:
        if tc.type == "tool":
            if not tc.name:
                raise ApiError(
                    "bad_request", "tool_choice type 'tool' needs a name", param="tool_choice"
                )
            out["tool_choice"] = {"type": "function", "function": {"name": tc.name}}
        else:
            out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[tc.type]
        if tc.disable_parallel_tool_use:
            out["parallel_tool_calls"] = False
    return out


def parse_messages(body: dict[str, Any]) -> MessagesRequest:
    req = _parse(MessagesRequest, body)
    if any(s == "" for s in req.stop_sequences or ()):
        raise ApiError("bad_request", "stop_sequences must be non-empty", param="stop_sequences")
    t = req.thinking
    if t is not None and t.type == "enabled":
        if t.budget_tokens is None:
            raise ApiError(
                "bad_request",
                "thinking.budget_tokens is required when thinking is enabled",
                param="thinking.budget_tokens",
            )
        if t.budget_tokens >= req.max_tokens:
            raise ApiError(
                "bad_request",
                f"thinking.budget_tokens ({t.budget_tokens}) must be less than max_tokens "
                f"({req.max_tokens})",
                param="thinking.budget_tokens",
            )
    return req


def parse_count_tokens(body: dict[str, Any]) -> CountTokensRequest:
    return _parse(CountTokensRequest, body)


def to_chat(req: MessagesRequest) -> dict[str, Any]:
    """The OpenAI chat body that serves ``req``; a last assistant message is continued, as
    Anthropic does with a prefilled response."""
    msgs = chat_messages(req)
    body: dict[str, Any] = {
        "model": req.model,
        "messages": msgs,
        "max_tokens": req.max_tokens,
        "stream": req.stream,
    }
    if req.messages[-1].role == "assistant":
        body.update(add_generation_prompt=False, continue_final_message=True)
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if req.stop_sequences:
        body.update(stop=list(req.stop_sequences), include_stop_str_in_output=True)
    for name in ("temperature", "top_p", "top_k"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.metadata and req.metadata.user_id:
        body["user"] = req.metadata.user_id
    body.update(chat_tools(req))
    if req.thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type == "enabled"}
    return body


def thinking_block(reasoning: str) -> dict[str, Any]:
    """The chat answer's ``reasoning_content`` (the gateway's reasoning parser) as a thinking
    block; Strata signs nothing, so the signature is empty."""
    return {"type": "thinking", "thinking": reasoning, "signature": ""}


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    """A chat tool call as a ``tool_use`` content block (arguments parsed back to an object)."""
    f = call["function"]
    try:
        args = json.loads(f["arguments"] or "{}")
    except json.JSONDecodeError:
        args = {}
    return {"type": "tool_use", "id": call["id"], "name": f["name"], "input": args}


def split_stop(text: str, finish: str | None, stops: list[str]) -> tuple[str, str, str | None]:
    """(text without the stop sequence, stop_reason, stop_sequence) of a finished output."""
    if finish == "length":
        return text, "max_tokens", None
    for s in sorted(stops, key=len, reverse=True):
        if finish == "stop" and text.endswith(s):
            return text[: -len(s)], "stop_sequence", s
    return text, "end_turn", None


def message(resp: dict[str, Any], req: MessagesRequest) -> dict[str, Any]:
    """The Messages response for a finished chat response."""
    choice = resp["choices"][0]
    text, reason, seq = split_stop(
        choice["message"]["content"] or "", choice["finish_reason"], req.stop_sequences or []
    )
    use = resp.get("usage") or {}
    calls = choice["message"].get("tool_calls") or []
    reasoning = choice["message"].get("reasoning_content")
    thinks = req.thinking is not None and req.thinking.type == "enabled"
    content = [thinking_block(reasoning)] if reasoning and thinks else []
    content += [{"type": "text", "text": text}] if text or not calls else []
    content += [tool_use_block(c) for c in calls]
    if calls and reason != "max_tokens":
        reason, seq = "tool_use", None
    return {
        "id": "msg_" + resp["id"].removeprefix("chatcmpl-"),
        "type": "message",
        "role": "assistant",
        "model": req.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": seq,
        "usage": {
            "input_tokens": use.get("prompt_tokens", 0),
            "output_tokens": use.get("completion_tokens", 0),
        },
    }


class EventStream:
    """OpenAI chat chunks in, Messages stream events ``(event type, data)`` out. Text that may
    be the start of a stop sequence is held back until the output ends, so a stop sequence
    (kept in the chat output by ``include_stop_str_in_output``) never reaches the client."""

    def __init__(self, req: MessagesRequest, request_id: str, input_tokens: int):
        self.req = req
        self.id = "msg_" + request_id
        self.input_tokens = input_tokens
        self.stops = list(req.stop_sequences or [])
        self.hold = max((len(s) for s in self.stops), default=0)
        self.pending = ""
        self.output_tokens = 0
        self.finish: str | None = None
        # with thinking on, blocks open as the answer comes (a thinking block first, when the
        # model reasons); else the text block 0 opens at once, as before thinking existed
        self.lazy = req.thinking is not None and req.thinking.type == "enabled"
        self.text_open = not self.lazy  # the text block is open until a tool_use follows it
        self.text_index = 0
        self.thinking_open = False
        self.blocks = 0 if self.lazy else 1  # content blocks started so far
        self.calls = 0  # tool_use blocks

    def start(self) -> list[tuple[str, dict[str, Any]]]:
        msg = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.req.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
        }
        out = [("message_start", {"type": "message_start", "message": msg})]
        if not self.lazy:
            out.append(self._block_start(0, {"type": "text", "text": ""}))
        return out

    @staticmethod
    def _block_start(index: int, block: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        data = {"type": "content_block_start", "index": index, "content_block": block}
        return ("content_block_start", data)

    def _thinking(self, reasoning: str) -> list[tuple[str, dict[str, Any]]]:
        """Reasoning before the answer: a thinking block (opened on its first piece)."""
        if not reasoning:
            return []
        out = []
        if not self.thinking_open:
            if self.text_open or self.blocks:  # reasoning after the answer began: not a block
                return []
            out.append(self._block_start(0, {"type": "thinking", "thinking": "", "signature": ""}))
            self.thinking_open, self.blocks = True, 1
        delta = {"type": "thinking_delta", "thinking": reasoning}
        data = {"type": "content_block_delta", "index": 0, "delta": delta}
        return [*out, ("content_block_delta", data)]

    def _open_text(self) -> list[tuple[str, dict[str, Any]]]:
        """Thinking on: the text block opens when the answer starts (closing the thinking)."""
        if self.text_open or not self.lazy or self.text_index or self.calls:
            return []
        out = []
        if self.thinking_open:
            sig = {"type": "signature_delta", "signature": ""}
            out.append(
                ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": sig})
            )
            out.append(("content_block_stop", {"type": "content_block_stop", "index": 0}))
            self.thinking_open = False
        self.text_index, self.text_open = self.blocks, True
        self.blocks += 1
        return [*out, self._block_start(self.text_index, {"type": "text", "text": ""})]

    def _delta(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        if not text:
            return []
        opened = self._open_text()  # first: it sets the text block's index
        data = {
            "type": "content_block_delta",
            "index": self.text_index,
            "delta": {"type": "text_delta", "text": text},
        }
        return [*opened, ("content_block_delta", data)]

    def feed(self, chunk: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        if chunk.get("usage"):
            self.output_tokens = chunk["usage"].get("completion_tokens", self.output_tokens)
        out: list[tuple[str, dict[str, Any]]] = []
        for c in chunk.get("choices", ()):
            out += self._thinking(c.get("delta", {}).get("reasoning_content") or "")
            self.pending += c.get("delta", {}).get("content") or ""
            for frag in c.get("delta", {}).get("tool_calls") or ():
                out += self._tool(frag)
            if c.get("finish_reason"):
                self.finish = c["finish_reason"]
            if self.hold and len(self.pending) > self.hold and self.finish is None:
                cut = len(self.pending) - self.hold
                out += self._delta(self.pending[:cut])
                self.pending = self.pending[cut:]
            elif not self.hold:
                out += self._delta(self.pending)
                self.pending = ""
        return out

    def _tool(self, frag: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """A chat tool-call fragment (`Run._tool_chunks` sends each call whole: the head with id
        and name, then the arguments) as a ``tool_use`` block: start, input_json_delta, stop."""
        out: list[tuple[str, dict[str, Any]]] = self._open_text()
        if self.text_open:  # the text before a call is final: nothing held back can be a stop
            out += self._delta(self.pending)
            self.pending = ""
            stop = {"type": "content_block_stop", "index": self.text_index}
            out.append(("content_block_stop", stop))
            self.text_open = False
        if "id" in frag:
            block = {
                "type": "tool_use",
                "id": frag["id"],
                "name": frag["function"]["name"],
                "input": {},
            }
            start = {"type": "content_block_start", "index": self.blocks, "content_block": block}
            self.calls += 1
            return [*out, ("content_block_start", start)]
        k = self.blocks
        self.blocks += 1
        delta = {"type": "input_json_delta", "partial_json": frag["function"]["arguments"]}
        return [
            *out,
            ("content_block_delta", {"type": "content_block_delta", "index": k, "delta": delta}),
            ("content_block_stop", {"type": "content_block_stop", "index": k}),
        ]

    def end(self) -> list[tuple[str, dict[str, Any]]]:
        text, reason, seq = split_stop(self.pending, self.finish, self.stops)
        if self.calls and reason != "max_tokens":
            reason, seq = "tool_use", None
        opened = self._open_text()  # thinking on: a text block even when empty, as before
        closing = [("content_block_stop", {"type": "content_block_stop", "index": self.text_index})]
        return [
            *opened,
            *self._delta(text),
            *(closing if self.text_open else []),
            (
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": seq},
                    "usage": {"output_tokens": self.output_tokens},
                },
            ),
            ("message_stop", {"type": "message_stop"}),
        ]


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(err: StrataError) -> dict[str, Any]:
    """Anthropic's error shape: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = _ERROR_TYPES.get(err.http_status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}
