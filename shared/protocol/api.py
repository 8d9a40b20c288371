"""`strata.api.v1.generate`: the gateway's public NATS entry point (same semantics as REST).

The caller sends a `GenerateRequest` whose ``body`` is exactly the JSON body it would POST to
``/v1/chat/completions`` (``kind="chat"``) or ``/v1/completions`` (``kind="completion"``).

- ``body.stream`` false: one `GenerateEvent` reply (``done=True``, ``data`` = the OpenAI response
  object) on the request's reply inbox.
- ``body.stream`` true: `GenerateEvent`s (``data`` = one OpenAI chunk object each) are published to
  ``stream_subject`` when given, else to the request's reply inbox; the last one has ``done=True``.
  Cancel with an `ApiCancel` on ``strata.api.v1.cancel`` (same ``request_id`` and ``api_key``).
- Errors arrive as an event with ``error`` set and ``done=True`` (codes as in `errors.HTTP_STATUS`).
"""

from __future__ import annotations

from typing import Any, Literal

from shared.protocol.base import Msg
from shared.protocol.errors import ErrorInfo


class GenerateRequest(Msg):
    kind: Literal["chat", "completion"] = "chat"
    body: dict[str, Any]
    api_key: str = ""  # checked like the REST Authorization header when auth is on
    request_id: str = ""  # optional caller-chosen id (else the gateway makes one)
    stream_subject: str = ""  # where streamed events go (default: the reply inbox)
    priority: int | None = None  # same as the X-Strata-Priority header
    slo_class: str | None = None  # same as the X-Strata-Slo-Class header


class GenerateEvent(Msg):
    request_id: str
    data: dict[str, Any] | None = None  # OpenAI response object or stream chunk
    done: bool = False
    error: ErrorInfo | None = None
    status: int = 200  # the HTTP status REST would have returned


class ApiCancel(Msg):
    """Published on ``strata.api.v1.cancel``: end the caller's request ``request_id`` (its stream
    ends with ``finish_reason: "abort"``). Only the gateway running it acts, and only when
    ``api_key`` is the key the request was opened with."""

    request_id: str
    api_key: str = ""
