"""Riding out a JetStream without a leader: a NATS cluster electing its meta leader or a
stream's leader (after a node loss, at start-up, a replicated stream just created), or a
server too busy to answer its API within the request timeout. What every JetStream call made
at start-up (the KV-event stream, the registry bucket) retries with backoff until a deadline."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import NoStreamResponseError, ServiceUnavailableError

log = logging.getLogger(__name__)

T = TypeVar("T")

ELECTING = (NoStreamResponseError, ServiceUnavailableError, NatsTimeoutError, TimeoutError)
"""What JetStream answers while a replicated stream or the cluster's meta layer has no leader
(or while the server is too busy to answer its API in time)."""


class JetStreamUnavailable(SystemExit):
    """JetStream gave no answer for a whole start-up retry window: the process exits with this
    one line (what was asked, for how long, the last error)."""


async def while_electing(op: Callable[[], Awaitable[T]], what: str, retry_s: float) -> T:
    """``op()``, retried while it fails with one of `ELECTING` (backoff 0.1 s doubling to 1 s)
    for up to ``retry_s`` seconds; then the last error is raised. Other errors are raised at
    once."""
    deadline = time.monotonic() + retry_s
    delay = 0.1
    while True:
        try:
            return await op()
        except ELECTING as exc:
            if time.monotonic() + delay > deadline:
                raise
            log.info("%s waits for JetStream (%s)", what, type(exc).__name__)
            await asyncio.sleep(delay)
            delay = min(2 * delay, 1.0)


async def at_start(op: Callable[[], Awaitable[T]], what: str, retry_s: float) -> T:
    """`while_electing` for a call a process cannot start without: past ``retry_s`` it ends
    the process in one line (`JetStreamUnavailable`: ``what``, for how long, the last error)."""
    try:
        return await while_electing(op, what, retry_s)
    except ELECTING as exc:
        raise JetStreamUnavailable(
            f"JetStream gave no answer about {what} for {retry_s:g}s ({type(exc).__name__}): "
            "is the NATS server up with JetStream enabled, and its cluster whole?"
        ) from None
