"""gRPC KVTransfer server: subclass `KVTransferHandler`, hand it to `start_kv_server`.

The handler speaks plain Python (async iterators of `BlockFrame`, reply messages); this module
owns the grpc.aio plumbing: message limits, mapping a `StrataError` to a gRPC status (and any
other exception to INTERNAL, logged), and counting calls, errors and bytes per method.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator

import grpc
from prometheus_client import Counter

from protos import kv_transfer_pb2_grpc
from protos.kv_transfer_pb2 import BlockFrame, PullRequest, PushReply, QueryReply, QueryRequest
from shared import metrics
from shared.kvtransfer.tls import GrpcTls
from shared.kvtransfer.wire import DEFAULT_MAX_FRAME_BYTES, split_frame
from shared.protocol.errors import StrataError

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# A refused push is read to its end (up to this much) before the error status is sent: `_drain`.
PUSH_DRAIN_BYTES = 1 << 30

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

# StrataError code <-> gRPC status (the client maps back with the inverse table).
STATUS_OF_CODE: dict[str, grpc.StatusCode] = {
    "bad_request": grpc.StatusCode.INVALID_ARGUMENT,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "overloaded": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "rate_limited": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "cancelled": grpc.StatusCode.CANCELLED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "timeout": grpc.StatusCode.DEADLINE_EXCEEDED,
    "unauthorized": grpc.StatusCode.UNAUTHENTICATED,
    "forbidden": grpc.StatusCode.PERMISSION_DENIED,
    "internal": grpc.StatusCode.INTERNAL,
}

KV_RPC_CALLS = Counter("strata_kv_rpc_total", "KVTransfer server calls", ["method", "status"])
KV_RPC_BYTES = Counter("strata_kv_rpc_bytes_total", "KVTransfer payload bytes", ["direction"])
KV_RPC_LATENCY = metrics.latency_histogram(
    "strata_kv_rpc_latency_seconds", "KVTransfer server call latency", ("method",)
)


class KVTransferHandler:
    """What a KVTransfer peer implements. The default methods refuse (``not_found``/empty).

    - ``push(frames)``: consume the incoming frames (chunks as sent; use `FrameAssembler`) and
      return a `PushReply` (frames/bytes counted, keys stored).
    - ``pull(req)``: yield the frames of the requested keys; missing keys are skipped. Frames
      larger than the message limit are chunked by the server (see `split_frame`).
    - ``query(req)``: which keys are present, and in which tier.

    Raise `StrataError` for an expected failure; its code becomes the gRPC status.
    """

    async def push(self, frames: AsyncIterator[BlockFrame]) -> PushReply:
        raise StrataError("not_found", f"{type(self).__name__} does not accept pushes")

    async def pull(self, req: PullRequest) -> AsyncIterator[BlockFrame]:
        return
        yield  # pragma: no cover - makes this an async generator

    async def query(self, req: QueryRequest) -> QueryReply:
        return QueryReply()


class _Servicer(kv_transfer_pb2_grpc.KVTransferServicer):
    def __init__(self, handler: KVTransferHandler, max_frame_bytes: int):
        self.handler = handler
        self.max_frame_bytes = max_frame_bytes

    async def Push(self, request_iterator, context):  # noqa: N802 - gRPC naming
        start, status = time.perf_counter(), "ok"

        async def counted() -> AsyncIterator[BlockFrame]:
            async for f in request_iterator:
                KV_RPC_BYTES.labels("in").inc(len(f.data) + len(f.scales))
                yield f

        try:
            return await self.handler.push(counted())
        except Exception as exc:  # noqa: BLE001 - mapped to a status below
            status = "error"
            await _drain(counted())
            await _abort(context, "Push", exc)
        finally:
            _observe("Push", status, start)

    async def Pull(self, request, context):  # noqa: N802
        start, status = time.perf_counter(), "ok"
        try:
            async for f in self.handler.pull(request):
                for part in split_frame(f, self.max_frame_bytes):
                    KV_RPC_BYTES.labels("out").inc(len(part.data) + len(part.scales))
                    yield part
        except Exception as exc:  # noqa: BLE001
            status = "error"
            await _abort(context, "Pull", exc)
        finally:
            _observe("Pull", status, start)

    async def Query(self, request, context):  # noqa: N802
        start, status = time.perf_counter(), "ok"
        try:
            return await self.handler.query(request)
        except Exception as exc:  # noqa: BLE001
            status = "error"
            await _abort(context, "Query", exc)
        finally:
            _observe("Query", status, start)


async def _drain(frames: AsyncIterator[BlockFrame], limit: int = PUSH_DRAIN_BYTES) -> None:
    """Read (and drop) the rest of a push the handler refused, up to ``limit`` bytes, before the
    status goes out. A grpc.aio client that is still writing when the status arrives reports
    INTERNAL "Internal error from Core" instead of it (grpc/grpc#36066), so the sender could not
    tell a refused frame (``bad_request``) from a broken transport. A stream that breaks while
    draining just ends the drain."""
    n = 0
    with contextlib.suppress(Exception):
        async for f in frames:
            n += len(f.data) + len(f.scales)
            if n > limit:
                return


async def _abort(context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    if isinstance(exc, StrataError):
        await context.abort(STATUS_OF_CODE.get(exc.code, grpc.StatusCode.INTERNAL), exc.message)
    log.exception("KVTransfer.%s failed", method)
    await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")


def _observe(method: str, status: str, start: float) -> None:
    KV_RPC_CALLS.labels(method, status).inc()
    KV_RPC_LATENCY.labels(method).observe(time.perf_counter() - start)


async def start_kv_server(
    handler: KVTransferHandler,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    max_frame_bytes: int | None = None,
    tls: GrpcTls | None = None,
) -> tuple[grpc.aio.Server, str]:
    """Bind and start a KVTransfer server; returns it and its ``"host:port"`` (port 0 = free).
    ``tls`` (default: from the ``STRATA_GRPC_TLS_*`` settings) with a certificate serves TLS.

    Stop it with ``await server.stop(grace)``.
    """
    tls = GrpcTls.from_env() if tls is None else tls
    server = grpc.aio.server(options=GRPC_OPTIONS)
    kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(
        _Servicer(handler, max_frame_bytes or DEFAULT_MAX_FRAME_BYTES), server
    )
    if tls.serves_tls:
        bound = server.add_secure_port(f"{host}:{port}", tls.server_credentials())
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise StrataError("unavailable", f"could not bind gRPC server on {host}:{port}")
    await server.start()
    return server, f"{host}:{bound}"
