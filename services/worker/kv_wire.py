"""Direct prefill -> decode KV transfer: a request's prompt KV as layer-range frames.

Wire shape of one frame's tensor: ``[layers, 2 (k/v), num_tokens, kv_heads, head_dim]`` for layers
``[layer_start, layer_end)``. Consecutive small layers are merged into one frame (so short
sequences don't pay per-frame overhead); big layers travel alone and are chunked by the client.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch

from protos.kv_transfer_pb2 import BlockFrame, PushReply
from shared.kvtransfer.frames import FrameAssembler, frame_nbytes, frame_to_tensor, tensor_to_frames
from shared.kvtransfer.server import KVTransferHandler
from shared.protocol.errors import StrataError

log = logging.getLogger(__name__)


def layer_groups(num_layers: int, bytes_per_layer: int, merge_bytes: int) -> list[range]:
    """Split layers into consecutive groups of at least ``merge_bytes`` (one layer if bigger)."""
    per = max(1, -(-merge_bytes // max(1, bytes_per_layer))) if merge_bytes else 1
    return [range(s, min(s + per, num_layers)) for s in range(0, num_layers, per)]


def kv_frames(
    kv: torch.Tensor, layers: range, *, request_id: str, fingerprint: str, total_layers: int,
    int8: bool = False,
) -> list[BlockFrame]:
    """Frames for ``kv`` = ``[len(layers), 2, n, kvh, hd]``; the frame holding the last layer
    is marked ``last``."""
    n = kv.shape[2]
    return tensor_to_frames(
        kv.contiguous(), request_id=request_id, layer_start=layers.start, layer_end=layers.stop,
        num_tokens=n, total_tokens=n, fingerprint=fingerprint,
        last=layers.stop == total_layers, int8=int8,
    )


@dataclass
class _Pending:
    num_tokens: int
    kv: torch.Tensor
    covered: int = 0  # layer x token cells written so far
    done: asyncio.Event = field(default_factory=asyncio.Event)
    created: float = field(default_factory=time.monotonic)


class KVReceiver(KVTransferHandler):
    """Decode side of direct transfer: assembles pushed frames into per-request KV tensors.

    ``shape_of(num_tokens)`` gives the expected ``[L, 2, n, kvh, hd]``; frames are checked against
    it (dtype, shape, fingerprint). A stream that breaks mid-way leaves no partial state behind.
    """

    def __init__(
        self,
        fingerprint: str,
        shape_of: Callable[[int], tuple[int, ...]],
        dtype: torch.dtype,
        ttl: float = 60.0,
    ):
        self.fingerprint = fingerprint
        self.shape_of = shape_of
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
                self._accept(whole)
        except BaseException as exc:
            for rid in rids:  # a broken stream frees what it started
                p = self._pending.get(rid)
                if p is not None and not p.done.is_set():
                    self.drop(rid)
            if isinstance(exc, StrataError | asyncio.CancelledError):
                raise
            raise StrataError("bad_request", f"KV push failed: {exc}") from exc
        for rid in rids:  # a stream that ended without its last frame was cut: free it
            p = self._pending.get(rid)
            if p is not None and not p.done.is_set():
                self.drop(rid)
        return PushReply(frames=count, bytes=nbytes, stored=sorted(rids))

    def _accept(self, f: BlockFrame) -> None:
        if f.fingerprint != self.fingerprint:
            raise StrataError("bad_request", f"KV for {f.request_id} comes from another model "
                              f"({f.fingerprint[:12]} != {self.fingerprint[:12]})")
        p = self._pending.get(f.request_id)
        if p is None:
            self.expire()  # transfers whose request never showed up must not pile up
            shape = self.shape_of(f.total_tokens)
            p = _Pending(f.total_tokens, torch.empty(shape, dtype=self.dtype))
            self._pending[f.request_id] = p
        layers = range(f.layer_start, f.layer_end)
        n = f.num_tokens or p.num_tokens
        t0 = f.token_start
        if t0 + n > p.num_tokens or f.layer_end > p.kv.shape[0] or not layers:
            raise StrataError("bad_request", f"KV frame for {f.request_id} is out of range "
                              f"(layers {f.layer_start}-{f.layer_end}, tokens {t0}+{n})")
        want = (len(layers), 2, n, *p.kv.shape[3:])
        t = frame_to_tensor(f, dtype=self.dtype, shape=want)
        p.kv[layers.start:layers.stop, :, t0:t0 + n].copy_(t)
        p.covered += len(layers) * n
        if f.last:
            need = p.kv.shape[0] * p.num_tokens
            if p.covered < need:
                raise StrataError("bad_request", f"KV for {f.request_id} ended incomplete "
                                  f"({p.covered}/{need} layer-token cells)")
            p.done.set()

    async def take(self, request_id: str, num_tokens: int, timeout: float) -> torch.Tensor:
        """The complete KV of ``request_id`` (waits up to ``timeout``); removes it."""
        deadline = time.monotonic() + timeout
        while request_id not in self._pending:
            if time.monotonic() > deadline:
                raise StrataError("timeout", f"KV for {request_id} never arrived")
            await asyncio.sleep(0.005)
        p = self._pending[request_id]
        try:
            await asyncio.wait_for(p.done.wait(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise StrataError("timeout", f"KV for {request_id} incomplete after {timeout}s") from None
        finally:
            self._pending.pop(request_id, None)
        if p.num_tokens != num_tokens:
            raise StrataError("bad_request", f"KV for {request_id} covers {p.num_tokens} tokens, "
                              f"prompt has {num_tokens}")
        return p.kv

    def drop(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def expire(self) -> int:
        """Drop transfers whose request never showed up (the prefill side died)."""
        now = time.monotonic()
        old = [r for r, p in self._pending.items() if now - p.created > self.ttl]
        for r in old:
            self.drop(r)
        return len(old)
