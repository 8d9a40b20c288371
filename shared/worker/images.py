"""Pull image embeddings (kept by the vision instance, keyed by image hash) over gRPC."""

from __future__ import annotations

import torch

from shared.kvtransfer.client import get_client
from shared.protocol.errors import StrataError
from shared.protocol.work import ImageRef


async def fetch_mm_inputs(images: list[ImageRef], dtype: torch.dtype) -> list:
    """`MMInput`s for the engine: each image's embeddings spliced in at its placeholder span."""
    from shared.engine.port_types import MMInput

    out = []
    for ref in images:
        tensors = await get_client(ref.source_addr).pull_tensors([ref.hash], dtype=dtype)
        emb = tensors.get(ref.hash)
        if emb is None:
            raise StrataError(
                "unavailable", f"image {ref.hash[:12]} is no longer cached at {ref.source_addr}"
            )
        emb = emb.reshape(-1, emb.shape[-1]).to(dtype)
        if emb.shape[0] != ref.length:
            raise StrataError(
                "bad_request",
                f"image {ref.hash[:12]} has {emb.shape[0]} "
                f"embeddings for a span of {ref.length} tokens",
            )
        out.append(MMInput(offset=ref.offset, embeds=emb, content_hash=ref.hash))
    return out
