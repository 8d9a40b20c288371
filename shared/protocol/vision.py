"""`strata.vision.encode`: images -> content hashes; embeddings stay on the vision instance.

Raw image bytes ride here (bounded by the gateway's image size limit); embeddings never do:
prefill pulls them by hash over gRPC from `source_addr`.
"""

from __future__ import annotations

from shared.protocol.base import Msg


class VisionEncodeRequest(Msg):
    request_id: str
    images: list[bytes]


class ImageInfo(Msg):
    hash: str  # sha256 hex of the raw image bytes; part of KV block identity
    num_tokens: int
    width: int
    height: int


class VisionEncodeReply(Msg):
    images: list[ImageInfo]
    instance_id: str
    source_addr: str  # gRPC address to pull embeddings from (KVTransfer.Pull by image hash)
    cache_hits: int = 0
    # Wall-clock (time.time()) bounds of the encode work, so callers can check EPD overlap.
    started_at: float = 0.0
    finished_at: float = 0.0
