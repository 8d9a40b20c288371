"""Tensors <-> `BlockFrame`s: chunking under the gRPC message limit, reassembly, int8 packing.

A logical frame carries one tensor (a block, a layer range, an image embedding). When its bytes
exceed ``max_frame_bytes`` it travels as ``num_chunks`` frames with the same metadata and
``chunk_index`` 0..n-1; only chunk 0 carries ``scales`` and only the final chunk carries ``last``.
`FrameAssembler` turns the chunk stream back into one logical frame per tensor (pure bytes, so
the kvstore can store it without decoding); `frame_to_tensor` turns that into a torch tensor,
checking dtype, shape and byte counts with errors that say what disagreed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from protos.kv_transfer_pb2 import BlockFrame
from shared.kvtransfer.wire import (  # re-exported: the byte-level half of the frame format
    DEFAULT_MAX_FRAME_BYTES,
    FrameAssembler,
    FrameError,
    frame_nbytes,
    split_frame,
)
from shared.protocol import dtypes

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "FrameAssembler",
    "FrameError",
    "dequantize_int8",
    "frame_nbytes",
    "frame_to_tensor",
    "frames_to_tensor",
    "payload_nbytes",
    "quantize_int8",
    "split_frame",
    "tensor_to_frames",
]


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return dtypes.dtype_name(dtype)
    except ValueError as exc:
        raise FrameError(f"unsupported KV dtype: {exc}") from None


def torch_dtype(name: str) -> torch.dtype:
    try:
        return dtypes.torch_dtype(name)
    except ValueError as exc:
        raise FrameError(f"unknown frame dtype: {exc}") from None


def tensor_bytes(t: torch.Tensor) -> bytes:
    """Raw little-endian bytes of ``t`` (any supported dtype, bfloat16 included)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    if flat.numel() == 0:
        return b""
    return flat.view(torch.uint8).numpy().tobytes()


def bytes_to_tensor(data: bytes, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """Inverse of :func:`tensor_bytes`; owns its memory (safe to keep after ``data`` dies)."""
    numel = math.prod(shape)
    want = numel * torch.empty((), dtype=dtype).element_size()
    if len(data) != want:
        raise FrameError(
            f"frame has {len(data)} bytes but dtype {dtype} x shape {list(shape)} needs {want}"
        )
    if numel == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(tuple(shape))


# ---------------------------------------------------------------- int8 quantization


def quantize_int8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: ``q = round(t / s)`` with ``s = max|row| / 127`` (float32).

    Rows are the last dimension; ``scales`` has shape ``t.shape[:-1]``. A zero row gets scale 1.
    The round-trip error is at most ``s / 2`` per element.
    """
    x = t.detach().float()
    amax = x.abs().amax(dim=-1) if x.dim() > 0 else x.abs()
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.clamp(
        torch.round(x / scales.unsqueeze(-1) if x.dim() > 0 else x / scales), -127, 127
    ).to(torch.int8)
    return q, scales.to(torch.float32)


def dequantize_int8(
    q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_int8` into ``dtype``."""
    if tuple(scales.shape) != tuple(q.shape[:-1]):
        raise FrameError(f"scales shape {list(scales.shape)} != rows {list(q.shape[:-1])}")
    return (q.float() * scales.float().unsqueeze(-1)).to(dtype)


# ---------------------------------------------------------------- tensor -> frames


def tensor_to_frames(
    t: torch.Tensor,
    *,
    key: str = "",
    request_id: str = "",
    layer_start: int = 0,
    layer_end: int = 0,
    token_start: int = 0,
    num_tokens: int = 0,
    fingerprint: str = "",
    total_tokens: int = 0,
    last: bool = False,
    int8: bool = False,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> list[BlockFrame]:
    """Frames carrying ``t`` (chunked when its bytes exceed ``max_frame_bytes``).

    With ``int8=True`` the tensor is quantized per row; the frame dtype is "int8" and ``scales``
    holds the float32 per-row scales (the receiver dequantizes to the dtype it wants).
    """
    if max_frame_bytes <= 0:
        raise ValueError("max_frame_bytes must be positive")
    scales = b""
    if int8:
        q, s = quantize_int8(t)
        data, dtype, scales = tensor_bytes(q), "int8", tensor_bytes(s)
    else:
        data, dtype = tensor_bytes(t), dtype_name(t.dtype)
    n = max(1, -(-len(data) // max_frame_bytes))
    frames = []
    for i in range(n):
        frames.append(
            BlockFrame(
                request_id=request_id,
                key=key,
                layer_start=layer_start,
                layer_end=layer_end,
                token_start=token_start,
                num_tokens=num_tokens,
                dtype=dtype,
                shape=list(t.shape),
                data=data[i * max_frame_bytes : (i + 1) * max_frame_bytes],
                scales=scales if i == 0 else b"",
                fingerprint=fingerprint,
                total_tokens=total_tokens,
                last=last and i == n - 1,
                chunk_index=i,
                num_chunks=n,
            )
        )
    return frames


# ---------------------------------------------------------------- frames -> tensor


def frame_to_tensor(
    frame: BlockFrame,
    *,
    dtype: torch.dtype | None = None,
    shape: Sequence[int] | None = None,
    dequantize: bool = True,
) -> torch.Tensor:
    """Tensor of one complete logical frame.

    ``dtype``/``shape`` are what the caller expects; a mismatch raises `FrameError` naming both.
    An int8 frame with scales is dequantized to ``dtype`` (float32 by default) unless
    ``dequantize=False``.
    """
    if frame.num_chunks > 1:
        raise FrameError(
            f"frame for key {frame.key!r} is chunk {frame.chunk_index} of "
            f"{frame.num_chunks}; assemble it first"
        )
    got_shape = list(frame.shape)
    if shape is not None and list(shape) != got_shape:
        raise FrameError(f"key {frame.key!r}: shape {got_shape} != expected {list(shape)}")
    t = bytes_to_tensor(frame.data, torch_dtype(frame.dtype), got_shape)
    if frame.dtype == "int8" and frame.scales and dequantize:
        rows = got_shape[:-1]
        scales = bytes_to_tensor(frame.scales, torch.float32, rows)
        return dequantize_int8(t, scales, dtype or torch.float32)
    if dtype is not None and t.dtype != dtype:
        raise FrameError(f"key {frame.key!r}: dtype {frame.dtype} != expected {dtype_name(dtype)}")
    return t


def frames_to_tensor(
    frames: Iterable[BlockFrame],
    *,
    dtype: torch.dtype | None = None,
    shape: Sequence[int] | None = None,
) -> torch.Tensor:
    """The one tensor carried by ``frames`` (all chunks of a single logical frame)."""
    asm = FrameAssembler()
    out: BlockFrame | None = None
    for f in frames:
        whole = asm.add(f)
        if whole is not None:
            if out is not None:
                raise FrameError("frames carry more than one tensor; use FrameAssembler")
            out = whole
    if out is None:
        raise FrameError(f"incomplete frames: missing chunks for {asm.pending or 'no frames'}")
    if asm.pending:
        raise FrameError(f"frames carry more than one tensor; incomplete: {asm.pending}")
    return frame_to_tensor(out, dtype=dtype, shape=shape)


def payload_nbytes(t: torch.Tensor, int8: bool = False) -> int:
    """Payload bytes (data + scales) of the frames `tensor_to_frames` makes of ``t``, without
    making them: int8 is one byte per element plus a float32 scale per last-dim row."""
    if int8:
        rows = t.numel() // t.shape[-1] if t.dim() > 0 and t.shape[-1] else 1
        return t.numel() + 4 * rows
    return t.numel() * t.element_size()
