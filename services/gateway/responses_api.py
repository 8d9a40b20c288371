"""OpenAI's Responses API (``POST /v1/responses``) over the chat path: pure translation, no I/O.

Stateless (``store: false`` semantics): nothing is kept after the response, so ``store: true``,
``previous_response_id`` and ``background`` are 400s naming the field. `parse_request` validates
a body, `to_chat` turns it into an OpenAI chat body (``instructions`` as the system message,
message / function_call / function_call_output items as chat turns, function tools as chat tools,
``text.format`` as ``response_format``), `response` builds the response object from the chat
response, and `ResponseEvents` turns chat chunks into the Responses stream events.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import Field, TypeAdapter, ValidationError

from services.gateway.core import ApiError, validation_error
from services.gateway.schemas import JsonSchemaFormat, _Body


class InputPart(_Body):
    type: Literal["input_text", "output_text", "input_image", "reasoning_text"]
    text: str | None = None
    image_url: str | None = Field(None, max_length=64 << 20)
    detail: str | None = None
    annotations: list[Any] | None = None  # echoed back output_text parts carry them


class InputItem(_Body):
    """A message, a function call the model made, or a function's output."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    # a reasoning item of an earlier turn, sent back as OpenAI asks: taken, not prompted (chat
    # templates that think drop earlier turns' reasoning too)
    summary: list[Any] | None = None
    encrypted_content: str | None = None
    content: str | list[InputPart] | None = None
    id: str | None = None
    status: str | None = None
    call_id: str | None = Field(None, max_length=256)
    name: str | None = Field(None, max_length=256)
    arguments: str | None = None
    output: str | None = None


class FunctionTool(_Body):
    type: Literal["function"]
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Body):
    type: Literal["function"]
    name: str


class TextFormat(JsonSchemaFormat):
    type: Literal["text", "json_object", "json_schema"]


class TextOptions(_Body):
    format: TextFormat | None = None


class ReasoningOptions(_Body):
    """OpenAI's ``reasoning``: ``effort`` goes to the chat template as ``reasoning_effort`` (as
    vLLM does); Strata writes no summaries, so ``summary`` is taken and the items' summary is
    empty."""

    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Body):
    """The fields of ``POST /v1/responses`` that Strata serves (docs/api.md)."""

    model: str = Field(..., min_length=1, max_length=256)
    input: str | list[InputItem] = Field(..., min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: ReasoningOptions | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)  # vLLM: as in chat


_ITEMS = TypeAdapter(list[InputItem])


def parse_request(body: dict[str, Any]) -> ResponsesRequest:
    """A validated body; a bad input item's 400 names it (``input.<k>.<field>``), not the
    string-or-list union."""
    items = body.get("input")
    try:
        if isinstance(items, list):
            body = {**body, "input": _ITEMS.validate_python(items)}
    except ValidationError as exc:
        err = validation_error(exc)
        raise ApiError(
            "bad_request", err.message.replace("'", "'input.", 1), "input." + (err.param or "")
        ) from None
    try:
        req = ResponsesRequest.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
    for name, why in (
        ("store", "store: true is not supported: Strata keeps no responses (send false)"),
        (
            "previous_response_id",
            "previous_response_id is not supported: Strata keeps no "
            "responses; send the whole conversation as input items",
        ),
        ("background", "background: true is not supported"),
    ):
        if getattr(req, name):
            raise ApiError("bad_request", why, param=name)
    return req


def _text(content: str | list[InputPart] | None, where: str) -> str | list[dict[str, Any]]:
    if content is None:
        raise ApiError("bad_request", f"{where}: a message needs content", param="input")
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for p in content:
        if p.type == "reasoning_text":
            raise ApiError(
                "bad_request", f"{where}: reasoning_text belongs to a reasoning item", "input"
            )
        if p.type == "input_image":
            if not p.image_url:
                raise ApiError("bad_request", f"{where}: input_image needs an image_url", "input")
            parts.append({"type": "image_url", "image_url": {"url": p.image_url}})
        else:
            parts.append({"type": "text", "text": p.text or ""})
    return parts


def chat_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages: instructions first, then each input item."""
    msgs: list[dict[str, Any]] = []
    if req.instructions:
        msgs.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return [*msgs, {"role": "user", "content": req.input}]
    for k, it in enumerate(req.input):
        where = f"input[{k}]"
        if it.type == "reasoning":
            continue
        if it.type == "message":
            if it.role is None:
                raise ApiError("bad_request", f"{where}: a message needs a role", param="input")
            msgs.append({"role": it.role, "content": _text(it.content, where)})
        elif it.type == "function_call":
            if not (it.call_id and it.name and it.arguments is not None):
                raise ApiError(
                    "bad_request",
                    f"{where}: a function_call needs call_id, name and arguments",
                    param="input",
                )
            call = {
                "id": it.call_id,
                "type": "function",
                "function": {"name": it.name, "arguments": it.arguments},
            }
            if msgs and msgs[-1]["role"] == "assistant" and "tool_calls" in msgs[-1]:
                msgs[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            if not it.call_id or it.output is None:
                raise ApiError(
                    "bad_request",
                    f"{where}: a function_call_output needs call_id and output",
                    param="input",
                )
            msgs.append({"role": "tool", "tool_call_id": it.call_id, "content": it.output})
    return msgs


def to_chat(req: ResponsesRequest) -> dict[str, Any]:
    """The chat completion body that serves ``req``."""
    body: dict[str, Any] = {
        "model": req.model,
        "messages": chat_messages(req),
        "stream": req.stream,
    }
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    for name in ("temperature", "top_p", "user", "cache_salt"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in req.tools
        ]
    if req.tool_choice is not None:
        tc = req.tool_choice
        body["tool_choice"] = (
            tc if isinstance(tc, str) else {"type": "function", "function": {"name": tc.name}}
        )
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type != "text":
        rf: dict[str, Any] = {"type": fmt.type}
        if fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise ApiError("bad_request", "text.format json_schema needs a schema", "text")
            rf["json_schema"] = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}
        body["response_format"] = rf
    return body


def _message_item(rid: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": "msg_" + rid,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}]
        if text or status == "completed"
        else [],
    }


def _reasoning_item(rid: str, text: str, status: str = "completed") -> dict[str, Any]:
    """The chat answer's ``reasoning_content`` (the gateway's reasoning parser) as a reasoning
    item: its text as ``reasoning_text`` content, no summary."""
    return {
        "type": "reasoning",
        "id": "rs_" + rid,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else [],
        "status": status,
    }


def _call_item(rid: str, k: int, call: dict[str, Any], status: str = "completed") -> dict:
    f = call["function"]
    return {
        "type": "function_call",
        "id": f"fc_{rid}_{k}",
        "call_id": call["id"],
        "name": f["name"],
        "arguments": f["arguments"] if status == "completed" else "",
        "status": status,
    }


class ResponseShell:
    """The response object's fields that come from the request (``created`` once)."""

    def __init__(self, req: ResponsesRequest, request_id: str):
        self.req = req
        self.rid = request_id
        self.created = int(time.time())

    def build(self, status: str, output: list, use: dict | None, finish: str | None) -> dict:
        req = self.req
        tc = req.tool_choice
        out = {
            "id": "resp_" + self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": req.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None,
            "store": False,
            "temperature": req.temperature if req.temperature is not None else 1.0,
            "top_p": req.top_p if req.top_p is not None else 1.0,
            "text": {
                "format": (
                    req.text.format.model_dump(by_alias=True, exclude_none=True)
                    if req.text and req.text.format
                    else {"type": "text"}
                )
            },
            "tool_choice": tc.model_dump() if isinstance(tc, NamedFunctionChoice) else tc or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "truncation": "disabled",
            "metadata": req.metadata or {},
            "usage": None,
        }
        if use is not None:
            cached = (use.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            out["usage"] = {
                "input_tokens": use.get("prompt_tokens", 0),
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": use.get("completion_tokens", 0),
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": use.get("total_tokens", 0),
            }
        return out


def _status(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


def response(chat: dict[str, Any], req: ResponsesRequest, request_id: str) -> dict[str, Any]:
    """The response object of a finished (non-streamed) chat response."""
    choice = chat["choices"][0]
    msg, finish = choice["message"], choice["finish_reason"]
    output: list[dict[str, Any]] = []
    if msg.get("reasoning_content"):
        output.append(_reasoning_item(request_id, msg["reasoning_content"]))
    if msg.get("content"):
        output.append(_message_item(request_id, msg["content"]))
    for k, call in enumerate(msg.get("tool_calls") or []):
        output.append(_call_item(request_id, k, call))
    return ResponseShell(req, request_id).build(_status(finish), output, chat.get("usage"), finish)


class ResponseEvents:
    """Chat chunks in, Responses stream events out (each a dict with ``type`` and a
    ``sequence_number``): response.created / in_progress; per output item output_item.added,
    then for text content_part.added, output_text.delta..., output_text.done,
    content_part.done, and for a call function_call_arguments.delta / .done; output_item.done;
    response.completed (or response.incomplete at max_output_tokens) with the whole response."""

    def __init__(self, req: ResponsesRequest, request_id: str):
        self.shell = ResponseShell(req, request_id)
        self.rid = request_id
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # output so far (done items)
        self.text: str | None = None  # the open message item's text
        self.thought: str | None = None  # the open reasoning item's text
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> call so far
        self.usage: dict | None = None
        self.finish: str | None = None

    def _ev(self, kind: str, **data: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **data}

    def start(self) -> list[dict[str, Any]]:
        snap = self.shell.build("in_progress", [], None, None)
        return [
            self._ev("response.created", response=snap),
            self._ev("response.in_progress", response=snap),
        ]

    def _reasoning(self, delta: str) -> list[dict[str, Any]]:
        """Reasoning before the answer: a reasoning item (added on its first piece), its
        ``reasoning_text`` part, ``response.reasoning_text.delta`` events."""
        out: list[dict[str, Any]] = []
        k, iid = len(self.items), "rs_" + self.rid
        ids = {"item_id": iid, "output_index": k, "content_index": 0}
        if self.thought is None:
            self.thought = ""
            item = _reasoning_item(self.rid, "", "in_progress")
            out.append(self._ev("response.output_item.added", output_index=k, item=item))
            part = {"type": "reasoning_text", "text": ""}
            out.append(self._ev("response.content_part.added", **ids, part=part))
        self.thought += delta
        return [*out, self._ev("response.reasoning_text.delta", **ids, delta=delta)]

    def _close_reasoning(self) -> list[dict[str, Any]]:
        if self.thought is None:
            return []
        k, text = len(self.items), self.thought
        ids = {"item_id": "rs_" + self.rid, "output_index": k, "content_index": 0}
        item = _reasoning_item(self.rid, text)
        self.items.append(item)
        self.thought = None
        return [
            self._ev("response.reasoning_text.done", **ids, text=text),
            self._ev("response.content_part.done", **ids, part=item["content"][0]),
            self._ev("response.output_item.done", output_index=k, item=item),
        ]

    def _close_text(self) -> list[dict[str, Any]]:
        if self.text is None:
            return []
        k, text, iid = len(self.items), self.text, "msg_" + self.rid
        part = {"type": "output_text", "text": text, "annotations": []}
        item = _message_item(self.rid, text)
        self.items.append(item)
        self.text = None
        ids = {"item_id": iid, "output_index": k, "content_index": 0}
        return [
            self._ev("response.output_text.done", **ids, text=text, logprobs=[]),
            self._ev("response.content_part.done", **ids, part=part),
            self._ev("response.output_item.done", output_index=k, item=item),
        ]

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out: list[dict[str, Any]] = []
        for c in chunk.get("choices", ()):
            delta = c.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self._reasoning(delta["reasoning_content"])
            if delta.get("content") or delta.get("tool_calls") or c.get("finish_reason"):
                out += self._close_reasoning()
            if delta.get("content"):
                if self.text is None:
                    k, iid = len(self.items), "msg_" + self.rid
                    self.text = ""
                    out.append(
                        self._ev(
                            "response.output_item.added",
                            output_index=k,
                            item=_message_item(self.rid, "", "in_progress"),
                        )
                    )
                    out.append(
                        self._ev(
                            "response.content_part.added",
                            item_id=iid,
                            output_index=k,
                            content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []},
                        )
                    )
                self.text += delta["content"]
                out.append(
                    self._ev(
                        "response.output_text.delta",
                        item_id="msg_" + self.rid,
                        output_index=len(self.items),
                        content_index=0,
                        delta=delta["content"],
                        logprobs=[],
                    )
                )
            for frag in delta.get("tool_calls") or ():
                out += self._call(frag)
            if c.get("finish_reason"):
                self.finish = c["finish_reason"]
        return out

    def _call(self, frag: dict[str, Any]) -> list[dict[str, Any]]:
        """A chat tool-call fragment: the head (id, name) opens an item; arguments close it
        (`Run._tool_chunks` sends each call whole, as a head and then its arguments)."""
        out = self._close_text()
        i = frag["index"]
        if i not in self.calls:
            call = {
                "id": frag["id"],
                "function": {"name": frag["function"]["name"], "arguments": ""},
            }
            self.calls[i] = call
            item = _call_item(self.rid, i, call, "in_progress")
            out.append(
                self._ev("response.output_item.added", output_index=len(self.items), item=item)
            )
            return out
        call = self.calls[i]
        args = frag["function"].get("arguments", "")
        call["function"]["arguments"] += args
        k, iid = len(self.items), f"fc_{self.rid}_{i}"
        item = _call_item(self.rid, i, call)
        self.items.append(item)
        return [
            *out,
            self._ev(
                "response.function_call_arguments.delta", item_id=iid, output_index=k, delta=args
            ),
            self._ev(
                "response.function_call_arguments.done",
                item_id=iid,
                output_index=k,
                name=item["name"],
                arguments=item["arguments"],
            ),
            self._ev("response.output_item.done", output_index=k, item=item),
        ]

    def end(self) -> list[dict[str, Any]]:
        out = [*self._close_reasoning(), *self._close_text()]
        status = _status(self.finish)
        snap = self.shell.build(status, self.items, self.usage, self.finish)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return [*out, self._ev(kind, response=snap)]


def event_bytes(ev: dict[str, Any]) -> bytes:
    return f"event: {ev['type']}\ndata: {json.dumps(ev, separators=(',', ':'))}\n\n".encode()
