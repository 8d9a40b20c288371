"""KVTransfer handler of the kvstore: gRPC frames in and out of the `KVStore`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from protos.kv_transfer_pb2 import BlockFrame, PullRequest, PushReply, QueryReply, QueryRequest
from services.kvstore.store import KVStore
from shared.kvtransfer.server import KVTransferHandler
from shared.kvtransfer.wire import FrameAssembler, FrameError
from shared.protocol.errors import StrataError


class KVStoreHandler(KVTransferHandler):
    """Push stores content-addressed blocks (idempotent); Pull streams the present ones in order
    (leased while they are sent; those only in the SSD tier read ahead in parallel and restored);
    Query reports tiers."""

    def __init__(self, store: KVStore):
        self.store = store

    async def push(self, frames: AsyncIterator[BlockFrame]) -> PushReply:
        asm = FrameAssembler()
        n = nbytes = 0
        stored: list[str] = []
        try:
            async for f in frames:
                n += 1
                nbytes += len(f.data) + len(f.scales)
                whole = asm.add(f)
                if whole is not None:
                    self.store.put(whole)
                    stored.append(whole.key)
        except FrameError as exc:
            raise StrataError("bad_request", str(exc)) from exc
        if asm.pending:
            raise StrataError("bad_request", f"stream ended inside blocks {asm.pending}")
        return PushReply(frames=n, bytes=nbytes, stored=stored)

    async def pull(self, req: PullRequest) -> AsyncIterator[BlockFrame]:
        keys = [(req.fingerprint, h) for h in req.keys]
        async with contextlib.aclosing(self.store.acquire_many(keys)) as run:
            async for key, got in run:
                if got is None:
                    continue
                frame, leased = got
                try:
                    yield frame
                finally:
                    if leased:
                        self.store.release(key)

    async def query(self, req: QueryRequest) -> QueryReply:
        tiers = await self.store.query([(req.fingerprint, h) for h in req.keys])
        present = [(h, t) for h, t in zip(req.keys, tiers, strict=True) if t is not None]
        return QueryReply(present=[h for h, _ in present], tiers=[t for _, t in present])
