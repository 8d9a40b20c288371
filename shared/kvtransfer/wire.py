"""`BlockFrame` chunks as bytes: re-chunking under the gRPC message limit and reassembly.

No torch here: the kvstore stores and serves frames without decoding them, so it imports only
this module (``frames`` adds the tensor side and re-exports these names).
"""

from __future__ import annotations

from protos.kv_transfer_pb2 import BlockFrame

DEFAULT_MAX_FRAME_BYTES = 4 * 1024 * 1024  # well under the 64 MiB limit; keeps frames pipelined


class FrameError(ValueError):
    """A frame (or a chunk sequence) does not describe the tensor it claims to carry."""


def split_frame(
    frame: BlockFrame, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> list[BlockFrame]:
    """Re-chunk one logical (assembled) frame for sending; small frames pass through unchanged."""
    data = frame.data
    n = max(1, -(-len(data) // max_frame_bytes))
    if n == 1 and frame.num_chunks <= 1:
        return [frame]
    out = []
    for i in range(n):
        f = BlockFrame()
        f.CopyFrom(frame)
        f.data = data[i * max_frame_bytes : (i + 1) * max_frame_bytes]
        f.scales = frame.scales if i == 0 else b""
        f.last = frame.last and i == n - 1
        f.chunk_index, f.num_chunks = i, n
        out.append(f)
    return out


def _ident(f: BlockFrame) -> tuple:
    return (
        f.request_id,
        f.key,
        f.layer_start,
        f.layer_end,
        f.token_start,
        f.num_tokens,
        f.dtype,
        tuple(f.shape),
        f.fingerprint,
    )


class FrameAssembler:
    """Reassembles chunked frames into one logical frame per tensor.

    Chunks of one tensor must arrive in order (gRPC streams are ordered); chunks of different
    tensors may interleave. ``add`` returns the complete logical frame (``num_chunks == 1``)
    once its last chunk arrived, else None. ``pending`` lists tensors still incomplete.
    """

    def __init__(self) -> None:
        self._parts: dict[tuple, tuple[BlockFrame, list[bytes]]] = {}

    def add(self, frame: BlockFrame) -> BlockFrame | None:
        n = max(1, frame.num_chunks)
        if frame.chunk_index >= n:
            raise FrameError(f"chunk {frame.chunk_index} of {n} for key {frame.key!r}")
        if n == 1:
            return frame
        ident = _ident(frame)
        if frame.chunk_index == 0:
            if ident in self._parts:
                raise FrameError(f"chunk 0 of key {frame.key!r} repeated before completion")
            self._parts[ident] = (frame, [frame.data])
            return None
        if ident not in self._parts:
            raise FrameError(
                f"chunk {frame.chunk_index}/{n} of key {frame.key!r} without its first chunk"
            )
        head, parts = self._parts[ident]
        if frame.chunk_index != len(parts) or head.num_chunks != n:
            raise FrameError(
                f"chunk {frame.chunk_index}/{n} of key {frame.key!r} out of order "
                f"(expected {len(parts)}/{head.num_chunks})"
            )
        parts.append(frame.data)
        if len(parts) < n:
            return None
        del self._parts[ident]
        whole = BlockFrame()
        whole.CopyFrom(head)
        whole.data = b"".join(parts)
        whole.last = frame.last
        whole.chunk_index, whole.num_chunks = 0, 1
        return whole

    @property
    def pending(self) -> list[str]:
        return [ident[1] for ident in self._parts]


def frame_nbytes(frame: BlockFrame) -> int:
    """Payload bytes of a frame (data + scales)."""
    return len(frame.data) + len(frame.scales)
