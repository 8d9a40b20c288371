"""`strata.api.v1.generate`: the REST semantics over NATS (see `shared.protocol.api`)."""

from __future__ import annotations

import logging

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg as NatsMsg

from services.gateway.core import ApiError, error_body
from services.gateway.service import GatewayService
from shared.protocol import subjects
from shared.protocol.api import GenerateEvent, GenerateRequest
from shared.protocol.codec import decode, encode
from shared.protocol.errors import StrataError

log = logging.getLogger(__name__)


async def serve_api(nc: NATS, service: GatewayService):
    """Subscribe `strata.api.v1.generate` (queue group "gateway"); returns the subscription."""

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
            target = req.stream_subject or msg.reply
            headers = {}
            if req.priority is not None:
                headers["x-strata-priority"] = str(req.priority)
            if req.slo_class is not None:
                headers["x-strata-slo-class"] = req.slo_class
            run = await service.open(req.kind, req.body, headers, req.api_key, req.request_id)
            rid = run.request_id
            try:
                if not run.spec.request.stream:
                    await send(GenerateEvent(request_id=rid, data=await run.complete(), done=True))
                    return
                async for chunk in run.events():
                    await send(GenerateEvent(request_id=rid, data=chunk))
            finally:
                run.close()
            await send(GenerateEvent(request_id=rid, done=True))
        except StrataError as exc:
            await send(GenerateEvent(request_id=rid, done=True, error=exc.info(),
                                     status=exc.http_status, data=error_body(exc)))  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - last line of defence: a 500 event
            log.exception("api.v1.generate failed")
            err = StrataError("internal", f"{type(exc).__name__}: {exc}")
            await send(GenerateEvent(request_id=rid, done=True, error=err.info(), status=500))

    async def cb(msg: NatsMsg) -> None:
        import asyncio

        t = asyncio.create_task(handle(msg))
        _tasks.add(t)
        t.add_done_callback(_tasks.discard)

    _tasks: set = set()
    return await nc.subscribe(subjects.API_GENERATE, queue="gateway", cb=cb)
