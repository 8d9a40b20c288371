"""FastAPI app: the OpenAI-compatible REST surface over a `GatewayService`.

Bodies are read raw (so malformed JSON is a 400 naming the problem, not a framework 422) and
validated by the pure core; the OpenAPI schema still documents them. Every error is an
OpenAI-style body; a client that disconnects cancels its request on the bus.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.gateway import anthropic, openapi, responses_api
from services.gateway import metrics as m
from services.gateway.auth import Auth
from services.gateway.core import ApiError, error_body, parse_json
from services.gateway.response_cache_run import headers as cache_headers
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from services.gateway.service import GatewayService
from shared.protocol.errors import StrataError

log = logging.getLogger(__name__)

try:
    VERSION = importlib.metadata.version("strata")
except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
    VERSION = "0.1.0"


def error_response(err: StrataError) -> JSONResponse:
    headers = {}
    if err.retry_after is not None:
        headers["Retry-After"] = str(max(1, int(err.retry_after + 0.999)))
    return JSONResponse(error_body(err), status_code=err.http_status, headers=headers)


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def _race(coro, request: Request):
    """Run ``coro`` unless the client disconnects first (then it is cancelled)."""
    task = asyncio.ensure_future(coro)
    disc = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, disc}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise ApiError("cancelled", "client disconnected")
    finally:
        for t in (task, disc):
            t.cancel()  # no await: the task cleans up (bus cancel) on its own


OPEN_PATHS = frozenset({"/health", "/health/live", "/health/ready", "/ping"})
"""Routes that need no API key when keys are on (probes); every other route needs one."""


class _RequireKey:
    """Pure ASGI middleware: with API keys on, every route but `OPEN_PATHS` answers 401 without
    a valid key (``/v1/*``, ``/metrics``, ``/docs``, ``/openapi.json``, unknown paths). The
    generation routes check the key's model permission again in `GatewayService.open`."""

    def __init__(self, app, auth: Auth):
        self.app = app
        self.auth = auth

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.auth.enabled and scope["path"] not in OPEN_PATHS:
            # OpenAI clients send ``Authorization: Bearer``, Anthropic's ``x-api-key``
            found = {k: v.decode("latin-1") for k, v in scope["headers"]}
            header = found.get(b"authorization", found.get(b"x-api-key"))
            try:
                self.auth.check_key(header)
            except StrataError as exc:
                return await error_response(exc)(scope, receive, send)
        return await self.app(scope, receive, send)


class _CountStatus:
    """Pure ASGI middleware counting responses by route and status (no body buffering, so
    streaming and disconnect detection are untouched). An unexpected error before the response
    started becomes a 500 body here, so the connection stays usable (raised further, the server
    would log it again and close the keep-alive connection). The route label is the app's
    route template (``known``: filled once the routes exist) or "other": a label per requested
    path would let any client grow the metric without bound."""

    def __init__(self, app, known: dict[str, str]):
        self.app, self.known = app, known

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_status(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        path = scope.get("path", "")
        route = self.known.get(path) or (
            "/v1/models/{model_id}" if path.startswith("/v1/models/") else "other"
        )
        started = [False]

        async def send_started(msg):
            started[0] = started[0] or msg["type"] == "http.response.start"
            await send_status(msg)

        try:
            await self.app(scope, receive, send_started)
        except Exception as exc:  # noqa: BLE001 - last line of defence, see the class doc
            log.error("unhandled %s on %s: %s", type(exc).__name__, path, exc, exc_info=exc)
            if started[0]:
                raise
            err = StrataError("internal", f"{type(exc).__name__}: {exc}")
            await error_response(err)(scope, receive, send_status)
        finally:
            m.HTTP.labels(route, str(status[0])).inc()


def build_app(service: GatewayService) -> FastAPI:
    app = FastAPI(title="Strata gateway", version="1", description=__doc__)
    cfg = service.cfg

    @app.exception_handler(StrataError)
    async def on_strata_error(_: Request, exc: StrataError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled %s: %s", type(exc).__name__, exc, exc_info=exc)
        return error_response(StrataError("internal", f"{type(exc).__name__}: {exc}"))

    app.add_middleware(_RequireKey, auth=service.auth)
    known: dict[str, str] = {}  # request path -> its route label (filled below)
    app.add_middleware(_CountStatus, known=known)

    async def handle(kind: str, request: Request) -> Response:
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > cfg.max_body_bytes:
            raise ApiError("bad_request", f"request body is larger than {cfg.max_body_bytes} bytes")
        raw = b""
        async for part in request.stream():
            raw += part
            if len(raw) > cfg.max_body_bytes:
                raise ApiError(
                    "bad_request", f"request body is larger than {cfg.max_body_bytes} bytes"
                )
        body = parse_json(raw)
        headers = dict(request.headers)
        run = await _race(
            service.open(
                kind,
                body,
                headers,
                request.headers.get("authorization"),
                request.headers.get("x-request-id", ""),
            ),
            request,
        )
        if not run.spec.request.stream:
            try:
                body = await _race(run.complete(), request)
                return JSONResponse(body, headers=cache_headers(run))
            finally:
                run.close()
        return _SSEResponse(run, cfg.sse_header_hold)

    @app.post("/v1/chat/completions", openapi_extra=openapi.body_doc(ChatCompletionRequest))
    async def chat(request: Request) -> Response:
        return await handle("chat", request)

    @app.post("/v1/completions", openapi_extra=openapi.body_doc(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await handle("completion", request)

    async def read_json(request: Request) -> dict[str, Any]:
        raw = await request.body()
        if len(raw) > cfg.max_body_bytes:
            raise ApiError("bad_request", f"request body is larger than {cfg.max_body_bytes} bytes")
        return parse_json(raw)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        """vLLM's tokenize: a prompt or chat messages -> token ids."""
        return await service.tokenize(await read_json(request))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        """vLLM's detokenize: token ids -> text."""
        return await service.detokenize(await read_json(request))

    @app.get("/version")
    async def version() -> dict[str, str]:
        """vLLM's ``/version``: the server's version."""
        return {"version": VERSION}

    def key_of(request: Request) -> str | None:
        return request.headers.get("authorization") or request.headers.get("x-api-key")

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        """Anthropic's Messages API over the chat path (`services.gateway.anthropic`)."""
        try:
            req = anthropic.parse_messages(await read_json(request))
            run = await _race(
                service.open(
                    "chat",
                    anthropic.to_chat(req),
                    dict(request.headers),
                    key_of(request),
                    request.headers.get("x-request-id", ""),
                ),
                request,
            )
        except StrataError as exc:
            return anthropic_error(exc)
        if req.stream:
            return StreamingResponse(
                _anthropic_events(run, req),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", **cache_headers(run)},
            )
        try:
            done = await _race(run.complete(), request)
            return JSONResponse(anthropic.message(done, req), headers=cache_headers(run))
        except StrataError as exc:
            return anthropic_error(exc)
        finally:
            run.close()

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        """OpenAI's Responses API, stateless, over the chat path (`responses_api`)."""
        req = responses_api.parse_request(await read_json(request))
        run = await _race(
            service.open(
                "chat",
                responses_api.to_chat(req),
                dict(request.headers),
                key_of(request),
                request.headers.get("x-request-id", ""),
            ),
            request,
        )
        if req.stream:
            return StreamingResponse(
                _response_events(run, req),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", **cache_headers(run)},
            )
        try:
            chat = await _race(run.complete(), request)
            return JSONResponse(
                responses_api.response(chat, req, run.request_id), headers=cache_headers(run)
            )
        finally:
            run.close()

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        """Anthropic's token count of a Messages request (the chat template's prompt)."""
        try:
            req = anthropic.parse_count_tokens(await read_json(request))
            body = {"model": req.model, "messages": anthropic.chat_messages(req)}
            if req.tools:  # the template renders them into the prompt
                body["tools"] = anthropic.chat_tools(req)["tools"]
            return JSONResponse({"input_tokens": (await service.tokenize(body))["count"]})
        except StrataError as exc:
            return anthropic_error(exc)

    def model_card() -> dict[str, Any]:
        return {
            "id": service.served_model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "strata",
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        """The served model; 503 until the cluster was first ready (`Readiness.require_started`:
        clients poll this as vLLM's readiness and send their first request after the 200)."""
        await service.readiness.require_started()
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        """OpenAI's retrieve-model (``client.models.retrieve``): the served model, or 404."""
        await service.readiness.require_started()
        if model_id != service.served_model:
            raise ApiError(
                "not_found",
                f"model '{model_id}' does not exist; this gateway serves '{service.served_model}'",
                param="model",
            )
        return model_card()

    async def ready() -> Response:
        st = await service.readiness.state()
        if st.ready:
            return JSONResponse(st.body())
        retry = str(max(1, int(cfg.unready_retry_after + 0.999)))
        return JSONResponse(st.body(), status_code=503, headers={"Retry-After": retry})

    @app.get("/health")
    async def health() -> Response:
        """Readiness with every dependency's state: 200 when ready, else 503."""
        return await ready()

    @app.get("/health/ready")
    async def health_ready() -> Response:
        return await ready()

    @app.get("/ping")
    async def ping() -> Response:
        """vLLM's (and SageMaker's) probe: readiness, as ``/health``."""
        return await ready()

    @app.post("/ping")
    async def ping_post() -> Response:
        return await ready()

    @app.get("/health/live")
    async def health_live() -> dict[str, str]:
        """The process is up and serving HTTP (no bus traffic)."""
        return {"status": "live"}

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    openapi.install(app)
    known.update((r.path, r.path) for r in app.routes if "{" not in r.path)
    return app


_DONE = b"data: [DONE]\n\n"


def anthropic_error(err: StrataError) -> JSONResponse:
    retry = error_response(err).headers.get("Retry-After")
    headers = {"Retry-After": retry} if retry else {}
    return JSONResponse(anthropic.error_body(err), err.http_status, headers)


async def _anthropic_events(run, req: anthropic.MessagesRequest):
    """The run's chat chunks as Messages SSE events; an error mid-stream is an ``error``
    event; the run is closed however the stream ends (a disconnect closes the generator)."""
    prompt = sum(len(p.prompt_token_ids) for p in run.prepared)
    events = anthropic.EventStream(req, run.request_id, prompt)
    try:
        for ev in events.start():
            yield _event(*ev)
        try:
            async for chunk in run.events():
                for ev in events.feed(chunk):
                    yield _event(*ev)
        except StrataError as exc:
            yield _event("error", anthropic.error_body(exc))
            return
        for ev in events.end():
            yield _event(*ev)
    finally:
        run.close()


async def _response_events(run, req: responses_api.ResponsesRequest):
    """The run's chat chunks as Responses SSE events; an error mid-stream is an ``error``
    event; the run is closed however the stream ends."""
    events = responses_api.ResponseEvents(req, run.request_id)
    try:
        for ev in events.start():
            yield responses_api.event_bytes(ev)
        try:
            async for chunk in run.events():
                for ev in events.feed(chunk):
                    yield responses_api.event_bytes(ev)
        except StrataError as exc:
            err = {"type": "error", "code": exc.code, "message": exc.message, "param": None}
            yield responses_api.event_bytes({**err, "sequence_number": events.seq})
            return
        for ev in events.end():
            yield responses_api.event_bytes(ev)
    finally:
        run.close()


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return (
        f"event: {kind}\ndata: ".encode()
        + json.dumps(data, separators=(",", ":")).encode()
        + b"\n\n"
    )


class _SSEResponse(StreamingResponse):
    """A run streamed as server-sent events: ``data: <chunk>`` lines ending in ``data: [DONE]``;
    an error after tokens were sent is sent as an error object. An error that comes before the
    headers went out (no token yet: overload 429, no instance 503, ...) gets its real status and
    the OpenAI error body instead, as a non-streaming request would.

    Written in as few socket writes as the stream allows: the status line and headers wait for
    the first token (at most ``hold`` seconds), so headers, the chat role chunk and the first
    token leave together; every later write carries all the chunks that are ready, and the last
    one also the usage chunk, ``[DONE]`` and the end of the body. A disconnect closes the run
    (which publishes the bus cancel); the run is closed however the response ends. Nothing here
    awaits on the way out, since the server may cancel this on disconnect: `Run.close` is
    synchronous.
    """

    def __init__(self, run, hold: float):
        super().__init__(
            iter(()),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", **cache_headers(run)},
        )
        self.run = run
        self.hold = hold

    async def __call__(self, scope, receive, send) -> None:
        run = self.run

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            run.close()  # ends next_events() at once

        disc = asyncio.create_task(watch())
        body, started = b"", False
        failed: StrataError | None = None
        try:
            try:
                while True:
                    held = not started and bool(body) and run.first_token_at is None
                    # Only role chunks so far: wait up to `hold` for a token to send them with.
                    batch = await run.next_events(self.hold if held else None)
                    body += b"".join(_line(ev) for ev in batch or ())
                    if batch is None or run.ended:
                        break
                    if not started:
                        if not held and run.first_token_at is None:
                            continue  # role chunks only: the next round holds them
                        started = True
                        await send(
                            {
                                "type": "http.response.start",
                                "status": self.status_code,
                                "headers": self.raw_headers,
                            }
                        )
                    if body:
                        await send({"type": "http.response.body", "body": body, "more_body": True})
                        body = b""
            except StrataError as exc:
                failed = exc
            except Exception as exc:  # noqa: BLE001 - reported to the client as a 500 object
                log.exception("stream %s failed", run.request_id)
                failed = StrataError("internal", f"{type(exc).__name__}: {exc}")
            if disc.done():
                return  # client gone
            if failed is not None and not started:  # nothing sent yet: the real status
                resp = error_response(failed)
                await send(
                    {
                        "type": "http.response.start",
                        "status": resp.status_code,
                        "headers": resp.raw_headers,
                    }
                )
                await send({"type": "http.response.body", "body": resp.body})
                return
            if failed is not None:
                body += _line(error_body(failed))
            if not started:
                await send(
                    {
                        "type": "http.response.start",
                        "status": self.status_code,
                        "headers": self.raw_headers,
                    }
                )
            await send({"type": "http.response.body", "body": body + _DONE, "more_body": False})
        finally:
            disc.cancel()
            run.close()


def _line(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
