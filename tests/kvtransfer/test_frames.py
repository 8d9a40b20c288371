"""Frames: chunking, reassembly, dtype/shape checks, int8 round trip (pure, no gRPC)."""

from __future__ import annotations

import pytest
import torch

from shared.kvtransfer.frames import (
    FrameAssembler,
    FrameError,
    dequantize_int8,
    frame_nbytes,
    frame_to_tensor,
    frames_to_tensor,
    payload_nbytes,
    quantize_int8,
    split_frame,
    tensor_to_frames,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_exact_bytes_each_dtype(dtype):
    t = torch.randn(2, 3, 5, 4, generator=torch.Generator().manual_seed(0)).to(dtype)
    frames = tensor_to_frames(t, key="k", layer_start=1, layer_end=3, fingerprint="fp")
    assert len(frames) == 1 and frames[0].dtype == str(dtype).removeprefix("torch.")
    assert list(frames[0].shape) == [2, 3, 5, 4]
    out = frames_to_tensor(frames, dtype=dtype, shape=(2, 3, 5, 4))
    assert out.dtype == dtype and torch.equal(out, t)


def test_chunking_under_limit_and_reassembly():
    t = torch.arange(1000, dtype=torch.float32).reshape(10, 100)  # 4000 bytes
    frames = tensor_to_frames(t, key="big", last=True, max_frame_bytes=1024)
    assert [f.chunk_index for f in frames] == [0, 1, 2, 3]
    assert all(f.num_chunks == 4 for f in frames)
    assert [len(f.data) for f in frames] == [1024, 1024, 1024, 928]
    assert [f.last for f in frames] == [False, False, False, True]
    assert torch.equal(frames_to_tensor(frames), t)


def test_assembler_interleaved_keys_and_errors():
    a = tensor_to_frames(torch.ones(64), key="a", max_frame_bytes=100)
    b = tensor_to_frames(torch.zeros(64), key="b", max_frame_bytes=100)
    asm = FrameAssembler()
    done = []
    for fa, fb in zip(a, b, strict=True):
        for f in (fa, fb):
            whole = asm.add(f)
            if whole is not None:
                done.append(whole)
    assert [d.key for d in done] == ["a", "b"] and asm.pending == []
    assert torch.equal(frame_to_tensor(done[0]), torch.ones(64))
    # out of order
    asm = FrameAssembler()
    asm.add(a[0])
    with pytest.raises(FrameError, match="out of order"):
        asm.add(a[2])
    # missing first chunk
    with pytest.raises(FrameError, match="without its first chunk"):
        FrameAssembler().add(b[1])
    # incomplete
    with pytest.raises(FrameError, match="incomplete"):
        frames_to_tensor(a[:-1])


def test_mismatch_errors_are_clear():
    frames = tensor_to_frames(torch.zeros(2, 3), key="x")
    with pytest.raises(FrameError, match=r"shape \[2, 3\] != expected \[3, 2\]"):
        frames_to_tensor(frames, shape=(3, 2))
    with pytest.raises(FrameError, match="dtype float32 != expected bfloat16"):
        frames_to_tensor(frames, dtype=torch.bfloat16)
    bad = frames[0]
    bad.data = bad.data[:-4]
    with pytest.raises(FrameError, match="20 bytes but dtype"):
        frame_to_tensor(bad)
    with pytest.raises(FrameError, match="unsupported KV dtype"):
        tensor_to_frames(torch.zeros(2, dtype=torch.int64))


def test_int8_quantization_error_bound_and_frames():
    g = torch.Generator().manual_seed(1)
    t = torch.randn(4, 8, 16, generator=g) * 3
    q, s = quantize_int8(t)
    assert q.dtype == torch.int8 and s.shape == (4, 8) and s.dtype == torch.float32
    back = dequantize_int8(q, s)
    assert torch.all((back - t).abs() <= s.unsqueeze(-1) / 2 + 1e-6)
    zero_q, zero_s = quantize_int8(torch.zeros(2, 4))
    assert torch.equal(zero_s, torch.ones(2)) and torch.equal(
        dequantize_int8(zero_q, zero_s), torch.zeros(2, 4)
    )
    frames = tensor_to_frames(t.to(torch.bfloat16), key="q", int8=True, max_frame_bytes=100)
    assert frames[0].dtype == "int8" and len(frames[0].scales) == 4 * 8 * 4
    assert all(f.scales == b"" for f in frames[1:])
    out = frames_to_tensor(frames, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), t, atol=float(s.max()) / 2 + 0.05 * 3)
    raw = frame_to_tensor(FrameAssembler().add(tensor_to_frames(t, int8=True)[0]), dequantize=False)
    assert torch.equal(raw, q)


def test_split_frame_rechunks_a_logical_frame():
    t = torch.arange(50, dtype=torch.float16)
    whole = tensor_to_frames(t, key="s", last=True, int8=False)[0]
    parts = split_frame(whole, 30)
    assert len(parts) == 4 and parts[-1].last and not parts[0].last
    assert split_frame(whole, 1000) == [whole]
    assert torch.equal(frames_to_tensor(parts), t)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_payload_nbytes_is_what_the_frames_carry(int8, dtype):
    t = torch.randn(4, 2, 16, 2, 64).to(dtype)  # a KV block: [L, 2, block, kvh, hd]
    frames = tensor_to_frames(t, key="b", int8=int8, max_frame_bytes=1000)
    assert len(frames) > 1  # chunked: only the first chunk carries the scales
    want = 4 * 2 * 16 * 2 * (64 + 4) if int8 else t.numel() * t.element_size()
    assert payload_nbytes(t, int8) == sum(frame_nbytes(f) for f in frames) == want
