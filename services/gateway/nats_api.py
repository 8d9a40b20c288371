"""`strata.api.v1.generate`: the REST semantics over NATS (see `shared.protocol.api`)."""

from __future__ import annotations

import hmac
import logging

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg as NatsMsg

from services.gateway.core import ApiError, error_body
from services.gateway.service import GatewayService
from shared.protocol import subjects
from shared.protocol.api import ApiCancel, GenerateEvent, GenerateRequest
from shared.protocol.codec import decode, encode
from shared.protocol.errors import StrataError

log = logging.getLogger(__name__)


async def serve_api(nc: NATS, service: GatewayService):
    """Subscribe `strata.api.v1.generate` (queue group "gateway") and `strata.api.v1.cancel`
    (every gateway); returns the generate subscription."""
    running: dict[str, str] = {}  # request id -> the api key it was opened with

    async def handle(msg: NatsMsg) -> None:
        rid = ""
        target = msg.reply

        async def send(ev: GenerateEvent) -> None:
            if target:
                await nc.publish(target, encode(ev))

        try:
            try:
                req = decode(msg.data, GenerateRequest)
            except Exception as exc:  # noqa: BLE001 - pydantic or msgpack
                raise ApiError("bad_request", f"invalid GenerateRequest: {exc}") from None
            rid = req.request_id
            _check_stream_subject(req.stream_subject)
            target = req.stream_subject or msg.reply
            headers = {}
            if req.priority is not None:
                headers["x-strata-priority"] = str(req.priority)
            if req.slo_class is not None:
                headers["x-strata-slo-class"] = req.slo_class
            run = await service.open(
                req.kind, req.body, headers, req.api_key, req.request_id, transport="nats"
            )
            rid = run.request_id
            running[rid] = req.api_key
            try:
                if not run.spec.request.stream:
                    await send(GenerateEvent(request_id=rid, data=await run.complete(), done=True))
                    return
                async for chunk in run.events():
                    await send(GenerateEvent(request_id=rid, data=chunk))
            finally:
                running.pop(rid, None)
                run.close()
            await send(GenerateEvent(request_id=rid, done=True))
        except StrataError as exc:
            await send(
                GenerateEvent(
                    request_id=rid,
                    done=True,
                    error=exc.info(),
                    status=exc.http_status,
                    data=error_body(exc),
                )
            )
        except Exception as exc:  # noqa: BLE001 - last line of defence: a 500 event
            log.exception("api.v1.generate failed")
            err = StrataError("internal", f"{type(exc).__name__}: {exc}")
            await send(GenerateEvent(request_id=rid, done=True, error=err.info(), status=500))

    async def cb(msg: NatsMsg) -> None:
        import asyncio

        t = asyncio.create_task(handle(msg))
        _tasks.add(t)
        t.add_done_callback(_tasks.discard)

    async def on_cancel(msg: NatsMsg) -> None:
        try:
            req = decode(msg.data, ApiCancel)
        except Exception:  # noqa: BLE001 - not an ApiCancel: nothing to cancel
            return
        key = running.get(req.request_id)
        if key is not None and hmac.compare_digest(key, req.api_key):
            await service.pipeline.cancel(req.request_id, reason="cancelled by the API client")

    _tasks: set = set()
    await nc.subscribe(subjects.API_CANCEL, cb=on_cancel)
    return await nc.subscribe(subjects.API_GENERATE, queue="gateway", cb=cb)


def _check_stream_subject(subject: str) -> None:
    """A client picks where the gateway streams its events: never onto Strata's own subjects
    (a cancel or token stream of another request) nor a wildcard. Under NATS auth the gateway
    may publish only to ``_INBOX.api.>`` anyway (`services.infra.nats_auth`)."""
    if not subject:
        return
    bad = (
        subject.startswith((f"{subjects.PREFIX}.", "$"))
        or any(c in subject for c in "*> \t")
        or "" in subject.split(".")
    )
    if bad:
        raise ApiError(
            "bad_request",
            f"stream_subject {subject[:80]!r} is not allowed: use a "
            "subject of your own, e.g. under _INBOX.api. (no wildcards, not strata.*)",
        )
