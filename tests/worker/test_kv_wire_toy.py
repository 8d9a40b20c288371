"""Toy-size checks of the direct-transfer wire: `layer_groups`, `KVReceiver`'s frame checks,
`merged_frames`, and `ReuseCostModel.blocks_to_load`. A recording sink stands in for the engine port
(the receiver's only dependency); no gRPC, no engine."""

from __future__ import annotations

import asyncio

import pytest
import torch

from shared.kvtransfer.frames import tensor_to_frames
from shared.protocol.errors import StrataError
from shared.worker.cost import ReuseCostModel
from shared.worker.kv_wire import KVReceiver, TransferFailed, kv_frames, layer_groups
from shared.worker.layerwise import Piece, merged_frames

LAYERS, KVH, HD, FP = 4, 2, 3, "fp-model"


class Sink:
    """Records what the receiver does to the engine's reservations."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def open(self, rid: str, n: int) -> None:
        self.calls.append(("open", rid, n))

    async def write(self, rid: str, layers: range, t0: int, kv: torch.Tensor) -> None:
        self.calls.append(("write", rid, layers, t0, tuple(kv.shape)))

    async def cancel(self, rid: str) -> None:
        self.calls.append(("cancel", rid))


def kv(layers: int, n: int) -> torch.Tensor:
    return torch.arange(layers * 2 * n * KVH * HD, dtype=torch.float32).reshape(
        layers, 2, n, KVH, HD
    )


def frames(rid: str, n: int, groups: list[range], fp: str = FP, total: int | None = None):
    out = []
    for g in groups:
        out += kv_frames(
            kv(len(g), n),
            g,
            request_id=rid,
            fingerprint=fp,
            total_layers=LAYERS if total is None else total,
        )
    return out


async def push(rx: KVReceiver, fs) -> object:
    async def gen():
        for f in fs:
            yield f

    return await rx.push(gen())


def receiver() -> tuple[KVReceiver, Sink]:
    sink = Sink()
    return KVReceiver(FP, sink, LAYERS, (KVH, HD), torch.float32), sink


def test_layer_groups():
    assert layer_groups(4, 100, 0) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    assert layer_groups(5, 100, 250) == [range(0, 3), range(3, 5)]
    assert layer_groups(3, 1000, 10) == [range(0, 1), range(1, 2), range(2, 3)]  # big: alone


async def test_receiver_writes_each_frame_and_take_returns_bytes():
    rx, sink = receiver()
    reply = await push(rx, frames("r1", 5, [range(0, 2), range(2, 4)]))
    assert reply.frames == 2 and reply.stored == ["r1"]
    assert sink.calls == [
        ("open", "r1", 5),
        ("write", "r1", range(0, 2), 0, (2, 2, 5, KVH, HD)),
        ("write", "r1", range(2, 4), 0, (2, 2, 5, KVH, HD)),
    ]
    assert await rx.take("r1", 5, timeout=1.0) == LAYERS * 2 * 5 * KVH * HD * 4
    assert rx.num_pending == 0


@pytest.mark.parametrize(
    ("fs", "match"),
    [
        (frames("r1", 5, [range(0, 4)], fp="other"), "another model"),
        (frames("r1", 5, [range(0, 2), range(2, 5)], total=5), "out of range"),
        (frames("r1", 5, [range(2, 4)]), "ended incomplete"),
    ],
    ids=["fingerprint", "layer-range", "coverage"],
)
async def test_receiver_refuses_bad_frames_and_frees_the_reservation(fs, match):
    rx, sink = receiver()
    with pytest.raises(StrataError, match=match) as exc:
        await push(rx, fs)
    assert exc.value.code == "bad_request"
    assert rx.num_pending == 0
    opened = [c for c in sink.calls if c[0] == "open"]
    assert [c for c in sink.calls if c[0] == "cancel"] == [("cancel", "r1")] * len(opened)


async def test_receiver_refuses_a_wrong_shape():
    rx, sink = receiver()
    bad = tensor_to_frames(
        torch.zeros(1, 2, 5, KVH, HD + 1),
        request_id="r1",
        layer_start=0,
        layer_end=1,
        num_tokens=5,
        total_tokens=5,
        fingerprint=FP,
    )
    with pytest.raises(StrataError, match="shape"):
        await push(rx, bad)
    assert sink.calls == [("open", "r1", 5), ("cancel", "r1")]


async def test_stream_cut_before_last_frame_is_dropped_and_token_mismatch_fails():
    rx, sink = receiver()
    await push(rx, frames("r1", 5, [range(0, 2)]))  # no frame with the last layer
    assert rx.num_pending == 0 and sink.calls[-1] == ("cancel", "r1")
    await push(rx, frames("r2", 5, [range(0, 4)]))
    with pytest.raises(TransferFailed) as exc:
        await rx.take("r2", 6, timeout=1.0)
    assert exc.value.reason == "bad_frame" and sink.calls[-1] == ("cancel", "r2")


async def test_merged_frames_merges_small_layers_of_one_token_range():
    q: asyncio.Queue = asyncio.Queue()
    one = kv(1, 2)  # 1*2*2*2*3 floats = 96 bytes per layer
    q.put_nowait(Piece(range(0, 4), 0, kv(4, 3), False))  # cached prefix, all layers
    for layer in range(LAYERS):
        q.put_nowait(Piece(range(layer, layer + 1), 3, one, layer == LAYERS - 1))
    got = [
        (f.layer_start, f.layer_end, f.token_start, f.num_tokens, f.last)
        async for f in merged_frames(
            q, request_id="r", fingerprint=FP, total_tokens=5, merge_bytes=200
        )
    ]
    # The prefix is over 200 bytes: alone. Then layers pair up (2 x 96 < 200 < 3 x 96).
    assert got == [(0, 4, 0, 3, False), (0, 3, 3, 2, False), (3, 4, 3, 2, True)]


def test_blocks_to_load_picks_the_cheapest_prefix():
    cm = ReuseCostModel(block_size=4, prefill_s_per_token=1e-3)  # recompute: 4 ms per block
    cm.load_s_per_block.update({"dram": 1e-3, "ssd": 6e-3})
    assert cm.blocks_to_load(["dram", "dram", None, "dram"]) == 2  # stops at the gap
    assert cm.blocks_to_load(["ssd", "ssd"]) == 0  # slower than recomputing
    assert cm.blocks_to_load(["dram", "ssd", "dram", "dram"]) == 4  # 3+(-2)+3+3 saved
    assert cm.blocks_to_load(["dram", "ssd", "ssd", "ssd"]) == 1
    assert cm.blocks_to_load([]) == 0
