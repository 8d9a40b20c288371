"""KV data plane: tensors <-> gRPC `BlockFrame`s, the KVTransfer server/client helpers, and the
`PoolClient` that spreads content-addressed blocks over kvstore instances."""

from shared.kvtransfer.frames import (
    FrameAssembler,
    FrameError,
    dequantize_int8,
    frame_to_tensor,
    frames_to_tensor,
    quantize_int8,
    tensor_to_frames,
)

__all__ = [
    "FrameAssembler",
    "FrameError",
    "dequantize_int8",
    "frame_to_tensor",
    "frames_to_tensor",
    "quantize_int8",
    "tensor_to_frames",
]
