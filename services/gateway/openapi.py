"""The gateway's OpenAPI schema: request bodies from `schemas.py` (the routes read raw bodies)
and every error status a route can answer, each with the OpenAI error body."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from services.gateway.schemas import ChatCompletionRequest, CompletionRequest

_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
ERROR_SCHEMA = {
    "type": "object",
    "title": "ErrorResponse",
    "description": "OpenAI-style error body",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string", "description": "what is wrong, in words"},
                "type": {"type": "string", "examples": ["invalid_request_error"]},
                "param": {"type": ["string", "null"], "description": "field at fault"},
                "code": {"type": "string", "examples": ["bad_request"]},
            },
        }
    },
}

ERRORS = {
    400: "Bad request: malformed or too deeply nested JSON, invalid text, a field out of range, "
    "a prompt over the context length, an image that breaks a limit",
    401: "Missing or invalid API key (when API keys are on)",
    403: "The key may not use this model; an image source that is not allowed",
    404: "No such model on this gateway",
    429: "Overloaded or over the key's rate limit (Retry-After says when to retry)",
    503: "The cluster cannot serve now: starting, or no instance of a role (Retry-After)",
}
"""Status -> when it is returned, for the generation routes (also before a stream's first
token: a stream that fails before any token gets the real status, not an SSE error)."""

_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}}}


def _error(status: int, why: str) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "description": why,
        "content": {"application/json": {"schema": _ERROR_REF}},
    }
    if status in (429, 503):
        doc["headers"] = _RETRY_AFTER
    return doc


def body_doc(model: type) -> dict[str, Any]:
    """``openapi_extra`` of a route that reads ``model`` as its raw JSON body."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    schema.pop("$defs", None)  # added to components by `install`
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "responses": {str(s): _error(s, why) for s, why in ERRORS.items()},
    }


def install(app: FastAPI) -> None:
    """Make ``app.openapi`` build (once) the schema with the body models' definitions and the
    error body; every route but the health probes documents the 401 it answers when API keys
    are on."""

    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (ChatCompletionRequest, CompletionRequest):
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                comps.update(js.get("$defs", {}))
            comps["ErrorResponse"] = ERROR_SCHEMA
            for path, ops in schema.get("paths", {}).items():
                if path.startswith("/health"):
                    continue
                for op in ops.values():
                    op.setdefault("responses", {}).setdefault("401", _error(401, ERRORS[401]))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = build
