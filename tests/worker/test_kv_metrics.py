"""The KV transfer metrics' pure parts: fallback reasons and sent-byte counting."""

from __future__ import annotations

import asyncio

import pytest
import torch

from shared.kvtransfer.frames import tensor_to_frames
from shared.protocol.errors import StrataError
from shared.worker.kv_metrics import (
    FALLBACK_REASONS,
    count_fallback,
    counted_frames,
    fallback_reason,
)
from tests.worker.kv_counters import Transfers


def test_fallback_reason_of_a_failed_push():
    assert fallback_reason(TimeoutError()) == "timeout"
    assert fallback_reason(StrataError("timeout", "deadline")) == "timeout"
    assert fallback_reason(StrataError("bad_request", "fingerprint")) == "bad_frame"
    assert fallback_reason(StrataError("unavailable", "refused")) == "unreachable"
    assert fallback_reason(StrataError("internal", "x")) == "broken"
    assert fallback_reason(ConnectionResetError()) == "broken"
    assert fallback_reason(asyncio.CancelledError()) == "broken"
    assert {fallback_reason(e) for e in (TimeoutError(), ValueError())} <= set(FALLBACK_REASONS)


def test_count_fallback_refuses_an_unknown_reason():
    t = Transfers()
    count_fallback("no_kv")
    with pytest.raises(ValueError, match="unknown KV fallback reason 'lost'"):
        count_fallback("lost")
    assert t.moved() == {"fallback:no_kv": 1}


async def test_counted_frames_count_payload_bytes_as_handed_on():
    t8 = torch.randn(2, 2, 5, 2, 8)
    frames = tensor_to_frames(t8, int8=True, max_frame_bytes=64) + tensor_to_frames(t8)

    async def source():
        for f in frames:
            yield f

    t = Transfers()
    seen = [f async for f in counted_frames(source(), "after_prefill")]
    assert seen == frames
    int8_bytes = t8.numel() + 4 * t8.numel() // 8
    assert t.moved() == {"sent:after_prefill": int8_bytes + t8.numel() * 4}
