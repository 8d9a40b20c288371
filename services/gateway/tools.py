"""Tool calling (pure): the model family's call syntax, the grammar a forced tool choice gets,
and parsing output text into OpenAI ``tool_calls``, whole or as a stream.

Formats: ``hermes`` (Qwen2/Qwen3 and other ChatML templates: ``<tool_call>\\n{"name": ...,
"arguments": {...}}\\n</tool_call>``, one block per call) and ``llama3`` (Llama 3.x: a bare
``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``). `tool_format` picks
one from the checkpoint's chat template. ``tool_choice`` ``required`` or a named function is
enforced by a grammar (`tool_choice_spec`): a JSON schema of the call built from the
function's ``parameters`` wrapped in that syntax, so the arguments always validate.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from services.gateway.schemas import ChatCompletionRequest, NamedToolChoice
from shared.protocol.errors import StrataError
from shared.protocol.sampling import StructuredSpec

HERMES = "hermes"
LLAMA3 = "llama3"
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _bad(message: str, param: str = "tool_choice") -> StrataError:
    err = StrataError("bad_request", message)
    err.param = param  # type: ignore[attr-defined]
    return err


def tool_format(chat_template: str | None) -> str:
    """The call syntax the checkpoint's template teaches: llama3 for Llama 3.x templates,
    hermes otherwise (Qwen2/Qwen3 and plain ChatML)."""
    t = chat_template or ""
    if _OPEN in t:
        return HERMES
    if _PYTHON_TAG in t or ("<|eot_id|>" in t and "parameters" in t):
        return LLAMA3
    return HERMES


def parses_tools(req: ChatCompletionRequest) -> bool:
    """Whether the output is parsed for tool calls (tools given, tool_choice not "none")."""
    return bool(req.tools) and req.tool_choice != "none"


def call_schema(req: ChatCompletionRequest, fmt: str, only: str | None = None) -> dict[str, Any]:
    """JSON schema of one call: ``{"name": <const>, "arguments"|"parameters": <params>}``,
    any of the tools (or just ``only``)."""
    key = "parameters" if fmt == LLAMA3 else "arguments"
    options = []
    for t in req.tools or ():
        f = t.function
        if only is not None and f.name != only:
            continue
        params = f.parameters or {"type": "object", "properties": {}}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": f.name}, key: params},
                "required": ["name", key],
            }
        )
    return options[0] if len(options) == 1 else {"anyOf": options}


def tool_choice_spec(req: ChatCompletionRequest, fmt: str) -> StructuredSpec | None:
    """The grammar a forced tool choice gets (None for none/auto); a 400 for a choice that
    names no declared function or needs tools the request lacks."""
    choice = req.tool_choice
    if choice is None or choice in ("none", "auto"):
        return None
    if not req.tools:
        raise _bad("tool_choice needs tools")
    if isinstance(choice, NamedToolChoice):
        names = [t.function.name for t in req.tools]
        if choice.function.name not in names:
            raise _bad(
                f"tool_choice names function {choice.function.name!r}, which is not in "
                f"tools ({', '.join(names)})"
            )
        schema, parallel = call_schema(req, fmt, choice.function.name), False
    else:
        schema, parallel = call_schema(req, fmt), req.parallel_tool_calls and fmt == HERMES
    spec = {"format": fmt, "schema": schema, "parallel": parallel}
    return StructuredSpec(kind="tool_calls", spec=json.dumps(spec))


def new_call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": args},
    }


def _call_from_json(text: str, fmt: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("parameters" if fmt == LLAMA3 else "arguments", obj.get("arguments", {}))
    return new_call(obj["name"], args if args is not None else {})


def parse_tool_calls(text: str, fmt: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content or None, tool calls) of a whole output; text that is not a well-formed call
    stays content."""
    calls: list[dict[str, Any]] = []
    if fmt == LLAMA3:
        body = text.strip().removeprefix(_PYTHON_TAG).strip()
        call = _call_from_json(body, fmt) if body.startswith("{") else None
        return (None, [call]) if call else (text, [])
    content, last = [], 0
    for m in _HERMES_CALL.finditer(text):
        call = _call_from_json(m.group(1), fmt)
        if call is None:
            continue
        piece = text[last : m.start()]
        content.append(piece.lstrip("\n") if calls else piece)  # newlines between calls
        calls.append(call)
        last = m.end()
    content.append(text[last:].lstrip("\n") if calls else text[last:])
    rest = "".join(content)
    return (rest if rest.strip() or not calls else None), calls


class ToolStream:
    """Splits one choice's streamed text into content and complete tool calls.

    ``feed`` / ``finish`` return events: ``("content", text)`` or ``("tool", call)``; a hermes
    call is sent once its closing tag arrived, text that may be the start of a tag is held back,
    and an unfinished call (the output hit max_tokens) comes out as content."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self.buf = ""
        self.in_call = False
        self.calls = 0  # complete calls parsed
        self.calls_sent = 0  # of them, sent as deltas (the caller's count)
        self._after_call = False
        self._llama_hold: bool | None = None  # llama3: buffering a possible JSON call

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self.buf += text
        if self.fmt == LLAMA3:
            return self._feed_llama()
        out: list[tuple[str, Any]] = []
        while True:
            if not self.in_call:
                if self._after_call:  # newlines between calls are not content
                    self.buf = self.buf.lstrip("\n")
                    self._after_call = not self.buf
                i = self.buf.find(_OPEN)
                if i < 0:
                    keep = _partial_suffix(self.buf, _OPEN)
                    if len(self.buf) > keep:
                        out.append(("content", self.buf[: len(self.buf) - keep]))
                        self.buf = self.buf[len(self.buf) - keep :]
                    return out
                if i:
                    out.append(("content", self.buf[:i]))
                self.buf, self.in_call = self.buf[i + len(_OPEN) :], True
            j = self.buf.find(_CLOSE)
            if j < 0:
                return out
            call = _call_from_json(self.buf[:j].strip(), self.fmt)
            if call is None:
                out.append(("content", _OPEN + self.buf[: j + len(_CLOSE)]))
            else:
                out.append(("tool", call))
                self.calls += 1
            self.buf, self.in_call = self.buf[j + len(_CLOSE) :], False
            self._after_call = call is not None

    def _feed_llama(self) -> list[tuple[str, Any]]:
        if self._llama_hold is None:
            head = self.buf.lstrip()
            if not head:
                return []
            self._llama_hold = head.startswith(("{", _PYTHON_TAG[: len(head)]))
        if self._llama_hold:
            return []
        text, self.buf = self.buf, ""
        return [("content", text)]

    def finish(self) -> list[tuple[str, Any]]:
        """Whatever is still held, at the end of the output."""
        text, self.buf = self.buf, ""
        if self.fmt == LLAMA3 and self._llama_hold:
            content, calls = parse_tool_calls(text, LLAMA3)
            self.calls += len(calls)
            return [("tool", c) for c in calls] or [("content", content or "")]
        if self.in_call:
            text = _OPEN + text
        return [("content", text)] if text else []


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
