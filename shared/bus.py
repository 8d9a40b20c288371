"""NATS helpers: connect with reconnect, typed request/reply, and the handler wrapper.

`serve()` is the one wrapper every service uses: it decodes the request model, calls the handler,
encodes the reply, turns a `StrataError` into an error reply and anything else into ``internal``,
and counts requests, errors and latency per subject.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg as NatsMsg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from pydantic import BaseModel, ValidationError

from shared import metrics
from shared.badmsg import BadMessages, one_line
from shared.config import ConfigError, is_nats_url
from shared.nats_auth import NatsAuth
from shared.protocol import subjects
from shared.protocol.codec import decode, encode, encode_error
from shared.protocol.errors import StrataError
from shared.protocol.health import Ping, Pong

log = logging.getLogger(__name__)

Req = TypeVar("Req", bound=BaseModel)
Rep = TypeVar("Rep", bound=BaseModel)


def nats_servers(url: str | Sequence[str]) -> list[str]:
    """The seed list in ``url``: one URL, a comma-separated list of a cluster's servers, or
    the list itself (`ServiceConfig.nats_url`); raises `ConfigError` naming
    ``STRATA_NATS_URL`` for an empty entry or a non-NATS scheme."""
    servers = [u.strip() for u in (url.split(",") if isinstance(url, str) else url)]
    for u in servers or [""]:
        if not is_nats_url(u):
            raise ConfigError(
                f"invalid setting STRATA_NATS_URL (--nats-url): {u!r} in {url!r} "
                "is not a nats://host:port URL"
            )
    return servers


async def connect(
    url: str | Sequence[str],
    name: str,
    auth: NatsAuth | None = None,
    on_disconnect: Callable[[], None] | None = None,
) -> NATS:
    """Connect, retrying forever while the server is unreachable or drops us; logs state changes.
    Subscriptions are sent again on reconnect; ``on_disconnect`` is called (in the event loop)
    each time the connection drops, e.g. to fail what cannot wait for the reconnect.

    ``auth`` (default: `NatsAuth.from_env`, the ``STRATA_NATS_*`` vars) gives the user,
    password, reply-inbox prefix and TLS. A login the server refuses is not retried: it raises
    `ConfigError` naming the user. Permission violations are logged as warnings."""
    auth = NatsAuth.from_env() if auth is None else auth
    refused: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()

    async def on_disconnected() -> None:
        log.warning("nats disconnected")
        if on_disconnect is not None:
            on_disconnect()

    async def on_reconnected() -> None:
        log.info("nats reconnected")

    async def on_error(exc: Exception) -> None:
        text = str(exc).lower()
        if "authorization" in text or "authentication" in text:
            log.error("nats-server refused login as %s: %s", _who(auth), exc)
            if not refused.done():
                refused.set_result(exc)
        elif "permissions violation" in text:
            log.warning("nats refused (user %s): %s", _who(auth), exc)
        else:
            log.debug("nats error: %s", exc)

    nc = NATS()
    connecting = asyncio.ensure_future(
        nc.connect(
            servers=nats_servers(url),
            name=name,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            connect_timeout=5,
            allow_reconnect=True,
            disconnected_cb=on_disconnected,
            reconnected_cb=on_reconnected,
            error_cb=on_error,
            **auth.connect_kwargs(),
        )
    )
    await asyncio.wait({connecting, refused}, return_when=asyncio.FIRST_COMPLETED)
    if connecting.done():
        connecting.result()
        return nc
    connecting.cancel()
    with contextlib.suppress(BaseException):
        await connecting
    with contextlib.suppress(Exception):
        await nc.close()
    raise ConfigError(
        f"nats-server {url} refused login as {_who(auth)} "
        "(check STRATA_NATS_USER and STRATA_NATS_PASSWORD[_FILE])"
    )


def _who(auth: NatsAuth) -> str:
    return repr(auth.user) if auth.user else "anonymous (STRATA_NATS_USER unset)"


async def request(
    nc: NATS, subject: str, msg: BaseModel, reply_type: type[Rep], timeout: float = 10.0
) -> Rep:
    """Request/reply with typed errors: no responder -> ``unavailable``, timeout -> ``timeout``.

    The messages name the role (`subjects.describe`: "tokenizer not available"), never the
    subject: they reach HTTP clients, and subject names are internal."""
    try:
        reply = await nc.request(subject, encode(msg), timeout=timeout)
    except NoRespondersError as exc:
        raise StrataError("unavailable", f"{subjects.describe(subject)} not available") from exc
    except (TimeoutError, NatsTimeoutError) as exc:
        raise StrataError(
            "timeout", f"{subjects.describe(subject)} did not answer within {timeout:.1f}s"
        ) from exc
    return decode(reply.data, reply_type)


async def publish(nc: NATS, subject: str, msg: BaseModel) -> None:
    await nc.publish(subject, encode(msg))


Handler = Callable[[Req], Awaitable[BaseModel | None]]


async def serve(
    nc: NATS,
    subject: str,
    req_type: type[Req],
    handler: Callable[[Req], Awaitable[BaseModel | None]],
    queue: str = "",
    bad: BadMessages | None = None,
):
    """Subscribe ``handler``; each message is handled in its own task so one slow or bad request
    never blocks or kills the others. A message that does not decode to ``req_type`` gets a
    ``bad_request`` reply and is counted in ``bad`` (default: ``strata_bad_messages_total``)
    with a rate-limited one-line warning, never a traceback."""
    tasks: set[asyncio.Task] = set()
    bad = bad or _BAD

    async def handle(m: NatsMsg) -> None:
        start = time.perf_counter()
        status = "ok"
        try:
            try:
                req = decode(m.data, req_type)
            except (ValidationError, StrataError) as exc:  # garbage, or an error map as request
                status = "error"
                why = one_line(exc)
                bad.report(_family(subject), m.subject, why)
                await _reply_error(
                    m, StrataError("bad_request", f"invalid {req_type.__name__}: {why}")
                )
                return
            rep = await handler(req)
            if m.reply and rep is not None:
                await m.respond(encode(rep))
        except ValidationError as exc:
            status = "error"
            await _reply_error(m, StrataError("bad_request", _validation_message(exc)))
        except StrataError as exc:
            status = "error"
            await _reply_error(m, exc)
        except Exception as exc:  # noqa: BLE001 - the wrapper is the last line of defence
            status = "error"
            log.exception("handler for %s failed", subject)
            await _reply_error(m, StrataError("internal", f"{type(exc).__name__}: {exc}"))
        finally:
            metrics.HANDLER_REQUESTS.labels(subject=_family(subject), status=status).inc()
            metrics.HANDLER_LATENCY.labels(subject=_family(subject)).observe(
                time.perf_counter() - start
            )

    async def cb(m: NatsMsg) -> None:
        t = asyncio.create_task(handle(m))
        tasks.add(t)
        t.add_done_callback(tasks.discard)

    sub = await nc.subscribe(subject, queue=queue, cb=cb)
    await _flush(nc)
    return sub


async def _flush(nc: NATS, timeout: float = 5.0) -> None:
    """Wait until the server has seen what was sent (a PING/PONG round trip), so a request
    another connection sends after `serve` returns finds the new subscription instead of "no
    responders". Disconnected: the subscription is replayed on reconnect, nothing to wait for.

    nats-py's `flush` writes its PING straight to the socket, ahead of commands still in its
    pending buffer (a SUB not yet written by its flusher task), so the PONG alone can come back
    before the server saw the SUB (measured: about 1 in 100 requests got "no responders").
    The buffer is let drain first."""
    if not nc.is_connected:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        while nc.pending_data_size and loop.time() < deadline:
            await asyncio.sleep(0.001)
        await nc.flush(timeout)
    except Exception:  # noqa: BLE001 - connection lost meanwhile; reconnect resubscribes
        log.debug("flush after subscribe failed", exc_info=True)


_BAD = BadMessages(metrics.BAD_MESSAGES, log)


async def serve_ping(nc: NATS, subject: str, role: str, instance_id: str, queue: str = ""):
    """Answer `Ping` on ``subject`` (``strata.<role>.ping``) with this instance's `Pong`: the
    gateway's readiness probe of a queue-group role. Returns the subscription."""
    pong = Pong(role=role, instance_id=instance_id)

    async def handle(_: Ping) -> Pong:
        return pong

    return await serve(nc, subject, Ping, handle, queue=queue)


async def _reply_error(m: NatsMsg, err: StrataError) -> None:
    if m.reply:
        try:
            await m.respond(encode_error(err))
        except Exception:  # noqa: BLE001 - connection gone; nothing more to do
            log.debug("could not send error reply", exc_info=True)


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for e in exc.errors()[:5]:
        loc = ".".join(str(p) for p in e["loc"]) or "body"
        parts.append(f"{loc}: {e['msg']}")
    return "; ".join(parts)


def _family(subject: str) -> str:
    # strata.prefill.<id>.submit -> strata.prefill.*.submit keeps label cardinality bounded
    parts = subject.split(".")
    if len(parts) == 4 and parts[1] in ("prefill", "decode", "admin"):
        parts[2] = "*"
    return ".".join(parts)
