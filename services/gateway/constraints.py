"""A request's decoding constraint (pure): ``response_format``, vLLM's ``guided_*`` extras and
``structured_outputs`` object, or a tool choice that must call a tool, as one `StructuredSpec`.

At most one source may be given (two are a 400 naming both); ``response_format: text`` and
``tool_choice: none/auto`` add none. The gateway imports no torch, so it compiles no grammar: the
spec rides the `TokenizeRequest` and the tokenizer service compiles (and so validates) it before
tokenizing; an invalid, unsupported, too big or too slow one comes back as a ``bad_request``
``"<param>: <problem>"`` that `constraint_error` turns into the 400 naming ``param``.
"""

from __future__ import annotations

import json
from typing import Any

from services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from services.gateway.tools import tool_choice_spec
from shared.protocol.errors import StrataError
from shared.protocol.sampling import StructuredSpec


class ConstraintError(StrataError):
    """A 400 about a constraint field (``param`` names it)."""

    def __init__(self, message: str, param: str):
        super().__init__("bad_request", message)
        self.param = param


def _schema_text(value: dict[str, Any] | str, param: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ConstraintError(f"{param} is not valid JSON: {exc}", param) from None
    if not isinstance(value, dict):
        raise ConstraintError(f"{param} must be a JSON schema object", param)
    return json.dumps(value)


def _choice(choices: list[str], param: str) -> StructuredSpec:
    if not choices or any(not c for c in choices):
        raise ConstraintError(f"{param} needs a non-empty list of non-empty strings", param)
    return StructuredSpec(kind="choice", spec=json.dumps(choices))


def _sources(req: ChatCompletionRequest | CompletionRequest) -> list[tuple[str, StructuredSpec]]:
    out: list[tuple[str, StructuredSpec]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        out.append(("response_format", StructuredSpec(kind="json")))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise ConstraintError(
                "response_format json_schema needs json_schema.schema",
                "response_format.json_schema",
            )
        text = _schema_text(rf.json_schema.schema_, "response_format.json_schema.schema")
        out.append(("response_format", StructuredSpec(kind="json_schema", spec=text)))
    if req.guided_json is not None:
        text = _schema_text(req.guided_json, "guided_json")
        out.append(("guided_json", StructuredSpec(kind="json_schema", spec=text)))
    if req.guided_regex is not None:
        out.append(("guided_regex", StructuredSpec(kind="regex", spec=req.guided_regex)))
    if req.guided_choice is not None:
        out.append(("guided_choice", _choice(req.guided_choice, "guided_choice")))
    if req.guided_grammar is not None:
        out.append(("guided_grammar", StructuredSpec(kind="grammar", spec=req.guided_grammar)))
    so = req.structured_outputs
    if so is not None:
        given = [
            k
            for k in ("json_", "regex", "choice", "grammar", "json_object")
            if getattr(so, k) not in (None, False)
        ]
        if len(given) != 1:
            raise ConstraintError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, json_object",
                "structured_outputs",
            )
        k = given[0]
        if k == "json_":
            spec = StructuredSpec(
                kind="json_schema", spec=_schema_text(so.json_, "structured_outputs.json")
            )
        elif k == "choice":
            spec = _choice(so.choice or [], "structured_outputs.choice")
        elif k == "json_object":
            spec = StructuredSpec(kind="json")
        else:
            spec = StructuredSpec(kind=k, spec=getattr(so, k))
        out.append(("structured_outputs", spec))
    return out


def request_constraint(
    req: ChatCompletionRequest | CompletionRequest, tool_format: str = "hermes"
) -> tuple[str, StructuredSpec] | None:
    """(the field it came from, the one constraint of ``req``), None for free text; a 400 for
    two sources or a bad one."""
    sources = _sources(req)
    if isinstance(req, ChatCompletionRequest):
        tool = tool_choice_spec(req, tool_format)
        if tool is not None:
            sources.append(("tool_choice", tool))
    if len(sources) > 1:
        names = " and ".join(n for n, _ in sources)
        raise ConstraintError(f"give one output constraint, not {names}", sources[1][0])
    return sources[0] if sources else None


def constraint_error(exc: StrataError, param: str) -> StrataError:
    """The tokenizer's answer to a bad constraint (a ``bad_request`` starting with ``param``)
    as the 400 that names ``param``; any other error as it is."""
    if param and exc.code == "bad_request" and exc.message.startswith(f"{param}: "):
        return ConstraintError(exc.message, param)
    return exc
