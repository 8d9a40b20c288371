"""Layer-wise KV streaming: prefill's KV leaves layer by layer while later layers compute.

`LayerTap` is the prefill engine's KV connector (`EnginePort.set_connector`): after layer ``i``
of a step has written its K/V, the engine hands it each streamed request's view of that layer
(on the thread that runs the forward); it copies the new tokens' K/V and hands them to that
request's queue on the event loop. `merged_frames` turns a queue into
gRPC frames, merging consecutive small layers of the same token range (no tiny packets for short
sequences) and marking the frame that carries the last layer of the sampling chunk ``last``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from protos.kv_transfer_pb2 import BlockFrame
from shared.engine.port_types import KVConnector, LayerKV
from shared.kvtransfer.frames import tensor_to_frames


@dataclass
class Piece:
    layers: range
    token_start: int
    kv: torch.Tensor  # [len(layers), 2, n, kvh, hd]
    final: bool  # carries the last layer of the chunk that samples the first token


class LayerTap(KVConnector):
    """The prefill engine's `KVConnector`: requests opened here get their K/V as it is computed,
    layer by layer, on an asyncio queue (`Piece`s, consumed by `merged_frames`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, num_layers: int):
        self.loop = loop
        self.num_layers = num_layers
        self._queues: dict[str, asyncio.Queue] = {}
        self._seen: set[str] = set()

    def open(self, request_id: str) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        return q

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._seen.discard(request_id)

    def wants(self, request_id: str) -> bool:
        return request_id in self._queues

    def save_layer(self, request_id: str, layer: int, kv: LayerKV) -> None:
        q = self._queues.get(request_id)
        if q is None:
            return
        if request_id not in self._seen:  # cached prefix (own memory or pool): all layers, once
            self._seen.add(request_id)
            if kv.token_start > 0:
                every = range(self.num_layers)
                self._put(q, Piece(every, 0, kv.read(every, 0, kv.token_start), False))
        self._put(q, Piece(range(layer, layer + 1), kv.token_start, kv.new_tokens(), kv.final))

    def _put(self, q: asyncio.Queue, piece: Piece) -> None:
        self.loop.call_soon_threadsafe(q.put_nowait, piece)


async def merged_frames(
    q: asyncio.Queue,
    *,
    request_id: str,
    fingerprint: str,
    total_tokens: int,
    merge_bytes: int,
    int8: bool = False,
) -> AsyncIterator[BlockFrame]:
    """Frames from a tap queue until the final piece; consecutive layers of one token range are
    merged until they reach ``merge_bytes``."""
    held: list[Piece] = []

    def flush(last: bool) -> list[BlockFrame]:
        if not held:
            return []
        kv = torch.cat([p.kv for p in held], dim=0) if len(held) > 1 else held[0].kv
        first = held[0]
        frames = tensor_to_frames(
            kv.contiguous(),
            request_id=request_id,
            layer_start=first.layers.start,
            layer_end=held[-1].layers.stop,
            token_start=first.token_start,
            num_tokens=kv.shape[2],
            total_tokens=total_tokens,
            fingerprint=fingerprint,
            last=last,
            int8=int8,
        )
        held.clear()
        return frames

    while True:
        piece: Piece = await q.get()
        if held and (
            piece.token_start != held[-1].token_start or piece.layers.start != held[-1].layers.stop
        ):
            for f in flush(False):
                yield f
        held.append(piece)
        size = sum(p.kv.numel() * p.kv.element_size() for p in held)
        if piece.final or size >= merge_bytes:
            for f in flush(piece.final):
                yield f
        if piece.final:
            return
