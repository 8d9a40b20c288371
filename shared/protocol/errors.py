"""Typed errors that cross the bus and map to HTTP statuses at the gateway."""

from __future__ import annotations

from pydantic import BaseModel

ERROR_KEY = "__error__"

# code -> HTTP status. The gateway turns a code into this status and an OpenAI-style error body.
HTTP_STATUS: dict[str, int] = {
    "bad_request": 400,
    "context_length_exceeded": 400,
    "unauthorized": 401,
    "forbidden": 403,
    "not_found": 404,
    "overloaded": 429,
    "rate_limited": 429,
    "cancelled": 499,
    "internal": 500,
    "unavailable": 503,
    "timeout": 504,
}


INSTANCE_ERRORS = frozenset({"unavailable", "timeout"})
"""Codes that are an instance's fault (gone, not answering), not the request's: a stream that
ends with one is failed over with that instance excluded, not ended with the error."""


class ErrorInfo(BaseModel):
    code: str
    message: str
    retry_after: float | None = None

    def to_exception(self) -> StrataError:
        return StrataError(self.code, self.message, retry_after=self.retry_after)


class StrataError(Exception):
    """An error with a stable code; ``http_status`` follows from the code."""

    def __init__(self, code: str, message: str, *, retry_after: float | None = None):
        super().__init__(message)
        self.code = code if code in HTTP_STATUS else "internal"
        self.message = message
        self.retry_after = retry_after

    @property
    def http_status(self) -> int:
        return HTTP_STATUS[self.code]

    def info(self) -> ErrorInfo:
        return ErrorInfo(code=self.code, message=self.message, retry_after=self.retry_after)

    def __repr__(self) -> str:
        return f"StrataError({self.code!r}, {self.message!r})"
