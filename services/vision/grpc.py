"""KVTransfer handler of the vision service: ``Pull(keys=image hashes)`` yields embeddings."""

from __future__ import annotations

from collections.abc import AsyncIterator

from protos.kv_transfer_pb2 import BlockFrame, PullRequest, QueryReply, QueryRequest
from services.vision.core import VisionCore
from shared.kvtransfer.frames import tensor_to_frames
from shared.kvtransfer.server import KVTransferHandler


class EmbeddingHandler(KVTransferHandler):
    """Serves cached image embeddings (``[num_tokens, hidden]``) keyed by image hash."""

    def __init__(self, core: VisionCore):
        self.core = core

    def _ours(self, fingerprint: str) -> bool:
        return not fingerprint or fingerprint == self.core.fingerprint

    async def pull(self, req: PullRequest) -> AsyncIterator[BlockFrame]:
        if not self._ours(req.fingerprint):
            return
        for key in req.keys:
            t = self.core.get(key)
            if t is None:
                continue
            for f in tensor_to_frames(
                t,
                key=key,
                request_id=req.request_id,
                num_tokens=t.shape[0],
                fingerprint=self.core.fingerprint,
            ):
                yield f

    async def query(self, req: QueryRequest) -> QueryReply:
        if not self._ours(req.fingerprint):
            return QueryReply()
        present = [k for k in req.keys if self.core.get(k) is not None]
        return QueryReply(present=present, tiers=["engine"] * len(present))
