"""Direct prefill -> decode KV transfer: a request's prompt KV as layer-range frames.

Wire shape of one frame's tensor: ``[layers, 2 (k/v), num_tokens, kv_heads, head_dim]`` for layers
``[layer_start, layer_end)``. Consecutive small layers are merged into one frame (so short
sequences don't pay per-frame overhead); big layers travel alone and are chunked by the client.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch

from protos.kv_transfer_pb2 import BlockFrame, PushReply
from shared.engine.port import EnginePort
from shared.kvtransfer.frames import FrameAssembler, frame_nbytes, frame_to_tensor, tensor_to_frames
from shared.kvtransfer.server import KVTransferHandler
from shared.protocol.errors import StrataError
from shared.protocol.work import engine_ids_of

log = logging.getLogger(__name__)


def layer_groups(num_layers: int, bytes_per_layer: int, merge_bytes: int) -> list[range]:
    """Split layers into consecutive groups of at least ``merge_bytes`` (one layer if bigger)."""
    per = max(1, -(-merge_bytes // max(1, bytes_per_layer))) if merge_bytes else 1
    return [range(s, min(s + per, num_layers)) for s in range(0, num_layers, per)]


def kv_frames(
    kv: torch.Tensor,
    layers: range,
    *,
    request_id: str,
    fingerprint: str,
    total_layers: int,
    int8: bool = False,
) -> list[BlockFrame]:
    """Frames for ``kv`` = ``[len(layers), 2, n, kvh, hd]``; the frame holding the last layer
    is marked ``last``."""
    n = kv.shape[2]
    return tensor_to_frames(
        kv.contiguous(),
        request_id=request_id,
        layer_start=layers.start,
        layer_end=layers.stop,
        num_tokens=n,
        total_tokens=n,
        fingerprint=fingerprint,
        last=layers.stop == total_layers,
        int8=int8,
    )


class TransferFailed(StrataError):
    """Pushed KV that cannot be used; ``reason`` is the fallback counter's label (see
    `shared.worker.kv_metrics.FALLBACK_REASONS`)."""

    def __init__(self, reason: str, code: str, message: str):
        super().__init__(code, message)
        self.reason = reason


@dataclass
class _Pending:
    num_tokens: int
    num_layers: int
    covered: int = 0  # layer x token cells written so far
    nbytes: int = 0  # payload bytes written so far (after the frame checks)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    created: float = field(default_factory=time.monotonic)


class PagedSink:
    """Writes received KV straight into the decode engine's paged cache through its port: blocks
    are reserved at the first frame, each frame's layers are written as it arrives (on the engine
    thread, between steps), so the hand-off itself only commits. ``cancel`` frees a reservation."""

    def __init__(self, port: EnginePort):
        self.port = port

    async def open(self, request_id: str, num_tokens: int) -> None:
        await self.port.reserve_kv(request_id, num_tokens)

    async def write(
        self, request_id: str, layers: range, token_start: int, kv: torch.Tensor
    ) -> None:
        await self.port.write_kv(request_id, layers, token_start, kv)

    async def cancel(self, request_id: str) -> None:
        await self.port.cancel_kv(request_id)


class KVReceiver(KVTransferHandler):
    """Decode side of direct transfer: checks pushed frames (fingerprint, dtype, shape, range,
    coverage) and writes them through ``sink``. A stream that breaks or ends early, or whose
    request never shows up within ``ttl``, leaves no reserved blocks behind.
    """

    def __init__(
        self,
        fingerprint: str,
        sink: PagedSink,
        num_layers: int,
        kv_tail: tuple[int, int],
        dtype: torch.dtype,
        ttl: float = 60.0,
    ):
        self.fingerprint = fingerprint
        self.sink = sink
        self.num_layers = num_layers
        self.kv_tail = kv_tail  # (kv_heads, head_dim)
        self.dtype = dtype
        self.ttl = ttl
        self._pending: dict[str, _Pending] = {}

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    async def push(self, frames: AsyncIterator[BlockFrame]) -> PushReply:
        asm = FrameAssembler()
        count = nbytes = 0
        rids: set[str] = set()
        try:
            async for chunk in frames:
                whole = asm.add(chunk)
                if whole is None:
                    continue
                count += 1
                nbytes += frame_nbytes(whole)
                rids.add(whole.request_id)
                await self._accept(whole)
        except BaseException as exc:
            await self._drop_unfinished(rids)  # a broken stream frees what it started
            if isinstance(exc, StrataError | asyncio.CancelledError):
                raise
            raise StrataError("bad_request", f"KV push failed: {exc}") from exc
        await self._drop_unfinished(rids)  # ended without its last frame: it was cut
        return PushReply(frames=count, bytes=nbytes, stored=sorted(rids))

    async def _drop_unfinished(self, rids: set[str]) -> None:
        for rid in rids:
            p = self._pending.get(rid)
            if p is not None and not p.done.is_set():
                await self.drop(rid)

    async def _accept(self, f: BlockFrame) -> None:
        if f.fingerprint != self.fingerprint:
            raise StrataError(
                "bad_request",
                f"KV for {f.request_id} comes from another model "
                f"({f.fingerprint[:12]} != {self.fingerprint[:12]})",
            )
        p = self._pending.get(f.request_id)
        if p is None:
            await self.expire()  # transfers whose request never showed up must not pile up
            if f.total_tokens <= 0:
                raise StrataError("bad_request", f"KV for {f.request_id}: no total_tokens")
            p = _Pending(f.total_tokens, self.num_layers)
            self._pending[f.request_id] = p
            try:
                await self.sink.open(f.request_id, f.total_tokens)
            except Exception as exc:
                self._pending.pop(f.request_id, None)
                raise StrataError("unavailable", f"no KV blocks for {f.request_id}: {exc}") from exc
        layers = range(f.layer_start, f.layer_end)
        n = f.num_tokens or p.num_tokens
        t0 = f.token_start
        if t0 + n > p.num_tokens or f.layer_end > p.num_layers or not layers:
            raise StrataError(
                "bad_request",
                f"KV frame for {f.request_id} is out of range "
                f"(layers {f.layer_start}-{f.layer_end}, tokens {t0}+{n})",
            )
        want = (len(layers), 2, n, *self.kv_tail)
        t = frame_to_tensor(f, dtype=self.dtype, shape=want)
        await self.sink.write(f.request_id, layers, t0, t)
        p.covered += len(layers) * n
        p.nbytes += frame_nbytes(f)
        if f.last:
            need = p.num_layers * p.num_tokens
            if p.covered < need:
                raise StrataError(
                    "bad_request",
                    f"KV for {f.request_id} ended incomplete "
                    f"({p.covered}/{need} layer-token cells)",
                )
            p.done.set()

    async def take(self, request_id: str, num_tokens: int, timeout: float) -> int:
        """Wait until the KV of ``request_id`` is complete in the engine's reserved blocks (up to
        ``timeout``); the caller then commits the reservation. Returns the payload bytes written.
        Raises `TransferFailed` and frees the reservation otherwise."""
        deadline = time.monotonic() + timeout
        while request_id not in self._pending:
            if time.monotonic() > deadline:
                raise TransferFailed("no_kv", "timeout", f"KV for {request_id} never arrived")
            await asyncio.sleep(0.005)
        p = self._pending[request_id]
        try:
            await asyncio.wait_for(p.done.wait(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            await self.drop(request_id)
            raise TransferFailed(
                "timeout", "timeout", f"KV for {request_id} incomplete after {timeout}s"
            ) from None
        self._pending.pop(request_id, None)
        if p.num_tokens != num_tokens:
            await self.sink.cancel(request_id)
            raise TransferFailed(
                "bad_frame",
                "bad_request",
                f"KV for {request_id} covers {p.num_tokens} tokens, prompt has {num_tokens}",
            )
        return p.nbytes

    def pending_of(self, request_id: str, attempt: int | None = None) -> set[str]:
        """Transfers in progress for ``request_id``: of every attempt, or of ``attempt``."""
        return engine_ids_of(request_id, attempt, self._pending)

    async def drop(self, request_id: str) -> None:
        if self._pending.pop(request_id, None) is not None:
            await self.sink.cancel(request_id)

    async def expire(self) -> int:
        """Drop transfers whose request never showed up (the prefill side died)."""
        now = time.monotonic()
        old = [r for r, p in self._pending.items() if now - p.created > self.ttl]
        for r in old:
            await self.drop(r)
        return len(old)
