"""gRPC KVTransfer client: push frames to a peer, pull blocks by key, query presence.

gRPC failures come back as `StrataError` with the matching code (UNAVAILABLE -> "unavailable",
DEADLINE_EXCEEDED -> "timeout", ...), so callers handle one error type across NATS and gRPC.
`get_client(addr)` caches one channel per address (per event loop: grpc.aio channels are bound
to the loop that created them).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Sequence

import grpc
import torch

from protos import kv_transfer_pb2_grpc
from protos.kv_transfer_pb2 import BlockFrame, PullRequest, PushReply, QueryRequest
from shared.kvtransfer.frames import (
    DEFAULT_MAX_FRAME_BYTES,
    FrameAssembler,
    frame_to_tensor,
    split_frame,
)
from shared.kvtransfer.server import GRPC_OPTIONS, STATUS_OF_CODE
from shared.kvtransfer.tls import GrpcTls
from shared.protocol.errors import StrataError

_CODE_OF_STATUS: dict[grpc.StatusCode, str] = {
    grpc.StatusCode.INVALID_ARGUMENT: "bad_request",
    grpc.StatusCode.NOT_FOUND: "not_found",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "overloaded",
    grpc.StatusCode.CANCELLED: "cancelled",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
    grpc.StatusCode.UNAUTHENTICATED: "unauthorized",
    grpc.StatusCode.PERMISSION_DENIED: "forbidden",
}
assert set(STATUS_OF_CODE.values()) - {grpc.StatusCode.INTERNAL} <= set(_CODE_OF_STATUS)


def _to_strata(addr: str, method: str, exc: grpc.aio.AioRpcError) -> StrataError:
    code = _CODE_OF_STATUS.get(exc.code(), "internal")
    return StrataError(code, f"KVTransfer.{method} to {addr}: {exc.details() or exc.code().name}")


class KVClient:
    """One channel to one KVTransfer peer (``"host:port"``)."""

    def __init__(
        self,
        addr: str,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        tls: GrpcTls | None = None,
    ):
        """``tls`` (default: from the ``STRATA_GRPC_TLS_*`` settings) with a CA dials TLS."""
        self.addr = addr
        self.max_frame_bytes = max_frame_bytes
        tls = GrpcTls.from_env() if tls is None else tls
        if tls.dials_tls:
            self._channel = grpc.aio.secure_channel(
                addr, tls.channel_credentials(), options=GRPC_OPTIONS
            )
        else:
            self._channel = grpc.aio.insecure_channel(addr, options=GRPC_OPTIONS)
        self._stub = kv_transfer_pb2_grpc.KVTransferStub(self._channel)

    async def push(
        self,
        frames: AsyncIterable[BlockFrame] | Iterable[BlockFrame],
        timeout: float | None = 30.0,
    ) -> PushReply:
        """Stream ``frames`` to the peer (oversized unchunked frames are split on the way)."""

        async def gen() -> AsyncIterator[BlockFrame]:
            if isinstance(frames, AsyncIterable):
                async for f in frames:
                    for part in self._split(f):
                        yield part
            else:
                for f in frames:
                    for part in self._split(f):
                        yield part

        try:
            return await self._stub.Push(gen(), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise _to_strata(self.addr, "Push", exc) from None

    def _split(self, f: BlockFrame) -> list[BlockFrame]:
        if f.num_chunks <= 1 and len(f.data) > self.max_frame_bytes:
            return split_frame(f, self.max_frame_bytes)
        return [f]

    async def pull(
        self,
        keys: Sequence[str],
        fingerprint: str = "",
        request_id: str = "",
        *,
        timeout: float | None = 30.0,
        assemble: bool = True,
    ) -> AsyncIterator[BlockFrame]:
        """Frames of ``keys`` the peer holds (missing keys are skipped).

        With ``assemble`` (default) chunked frames are joined: each yielded frame is one
        complete tensor (``num_chunks == 1``), ready for `frame_to_tensor`.
        """
        req = PullRequest(keys=list(keys), fingerprint=fingerprint, request_id=request_id)
        asm = FrameAssembler()
        try:
            async for f in self._stub.Pull(req, timeout=timeout):
                if not assemble:
                    yield f
                    continue
                whole = asm.add(f)
                if whole is not None:
                    yield whole
        except grpc.aio.AioRpcError as exc:
            raise _to_strata(self.addr, "Pull", exc) from None

    async def pull_tensors(
        self,
        keys: Sequence[str],
        fingerprint: str = "",
        *,
        dtype: torch.dtype | None = None,
        timeout: float | None = 30.0,
    ) -> dict[str, torch.Tensor]:
        """``key -> tensor`` for the keys the peer holds (int8 frames dequantized to ``dtype``)."""
        out: dict[str, torch.Tensor] = {}
        async for f in self.pull(keys, fingerprint, timeout=timeout):
            out[f.key] = frame_to_tensor(f, dtype=dtype)
        return out

    async def query(
        self, keys: Sequence[str], fingerprint: str = "", *, timeout: float | None = 5.0
    ) -> dict[str, str]:
        """``key -> tier`` for the keys the peer holds; absent keys are left out."""
        try:
            rep = await self._stub.Query(
                QueryRequest(keys=list(keys), fingerprint=fingerprint), timeout=timeout
            )
        except grpc.aio.AioRpcError as exc:
            raise _to_strata(self.addr, "Query", exc) from None
        return dict(zip(rep.present, rep.tiers, strict=False))

    async def close(self) -> None:
        await self._channel.close()
        for k, v in list(_CLIENTS.items()):
            if v is self:
                del _CLIENTS[k]


_CLIENTS: dict[tuple[int, str], KVClient] = {}


def get_client(addr: str) -> KVClient:
    """The cached client of ``addr`` for the running event loop (created on first use)."""
    key = (id(asyncio.get_running_loop()), addr)
    client = _CLIENTS.get(key)
    if client is None:
        client = _CLIENTS[key] = KVClient(addr)
    return client


async def close_clients() -> None:
    """Close every cached client of the running loop (call on service shutdown)."""
    loop_id = id(asyncio.get_running_loop())
    for (lid, _), client in list(_CLIENTS.items()):
        if lid == loop_id:
            await client.close()
