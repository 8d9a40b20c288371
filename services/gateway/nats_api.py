"""`strata.api.v1.<client>.generate`: the REST semantics over NATS (see `shared.protocol.api`).

The ``<client>`` token is the caller's identity: under NATS auth, nats-server lets client NAME
publish only ``strata.api.v1.NAME.>`` (`services.infra.nats_auth`; the legacy
``strata.api.v1.generate`` / ``.cancel`` only to ``api``), so the token is authenticated. Each
request is owned by the identity that opened it: only that identity cancels it, and (``strict``:
when the gateway itself runs under NATS auth) its events go only into that identity's inbox
``_INBOX.<client>.``, never another client's. Nothing the client writes in the body decides
ownership.
"""

from __future__ import annotations

import hmac
import logging

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg as NatsMsg

from services.gateway import metrics
from services.gateway.core import ApiError, error_body
from services.gateway.service import GatewayService
from shared.nats_auth import inbox_prefix
from shared.protocol import subjects
from shared.protocol.api import ApiCancel, GenerateEvent, GenerateRequest
from shared.protocol.codec import decode, encode
from shared.protocol.errors import StrataError

log = logging.getLogger(__name__)


async def serve_api(nc: NATS, service: GatewayService, strict: bool = False) -> list:
    """Subscribe ``strata.api.v1.*.generate`` and the legacy `strata.api.v1.generate` (queue
    group "gateway"), ``strata.api.v1.*.cancel`` and `strata.api.v1.cancel` (every gateway);
    returns the subscriptions. ``strict``: replies and streams only into the caller's inbox."""
    running: dict[str, tuple[str, str]] = {}  # request id -> (client, api key) that opened it

    def own_inbox(client: str, subject: str) -> bool:
        return not strict or subject.startswith(inbox_prefix(client) + ".")

    async def handle(msg: NatsMsg) -> None:
        rid = ""
        client = subjects.api_client(msg.subject)
        target = msg.reply
        if target and not own_inbox(client, target):
            metrics.NATS_API_REFUSED.labels(op="reply").inc()
            return  # answering would write into someone else's inbox
        reserved = False  # a caller-chosen id held in `running` before the run exists

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
            if req.stream_subject and not own_inbox(client, req.stream_subject):
                metrics.NATS_API_REFUSED.labels(op="stream").inc()
                raise ApiError(
                    "bad_request",
                    f"stream_subject must be under your own inbox {inbox_prefix(client)}.",
                )
            if rid:
                if rid in running:  # ids name bus subjects: one live request per id
                    raise ApiError("bad_request", f"request id {rid!r} is in use")
                running[rid], reserved = (client, req.api_key), True
            target = req.stream_subject or msg.reply
            headers = {}
            if req.priority is not None:
                headers["x-strata-priority"] = str(req.priority)
            if req.slo_class is not None:
                headers["x-strata-slo-class"] = req.slo_class
            run = await service.open(
                req.kind,
                req.body,
                headers,
                req.api_key,
                req.request_id,
                transport="nats",
                client=client,
            )
            rid = run.request_id
            running[rid], reserved = (client, req.api_key), False
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
        finally:
            if reserved:  # open() failed after the id was reserved
                running.pop(rid, None)

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
        owner = running.get(req.request_id)
        if owner is None:
            return  # not running here (maybe on another gateway)
        client = subjects.api_client(msg.subject)
        if owner[0] != client or not hmac.compare_digest(owner[1], req.api_key):
            metrics.NATS_API_REFUSED.labels(op="cancel").inc()
            return  # another client's request, or not its key: nothing happens, as for no id
        await service.pipeline.cancel(req.request_id, reason="cancelled by the API client")

    _tasks: set = set()
    return [
        await nc.subscribe(subjects.api_cancel("*"), cb=on_cancel),
        await nc.subscribe(subjects.API_CANCEL, cb=on_cancel),
        await nc.subscribe(subjects.api_generate("*"), queue="gateway", cb=cb),
        await nc.subscribe(subjects.API_GENERATE, queue="gateway", cb=cb),
    ]


def _check_stream_subject(subject: str) -> None:
    """A client picks where the gateway streams its events: never onto Strata's own subjects
    (a cancel or token stream of another request) nor a wildcard. Under NATS auth the gateway
    may publish only into API clients' inboxes anyway (`services.infra.nats_auth`)."""
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
            "subject of your own, under _INBOX.<your user>. (no wildcards, not strata.*)",
        )
