"""KVTransfer server/client against a real grpc.aio server on a free port."""

from __future__ import annotations

import asyncio

import pytest
import torch

from protos.kv_transfer_pb2 import BlockFrame, PullRequest, PushReply, QueryReply, QueryRequest
from shared.kvtransfer.client import KVClient, close_clients, get_client
from shared.kvtransfer.frames import FrameAssembler, frame_to_tensor, tensor_to_frames
from shared.kvtransfer.server import KVTransferHandler, start_kv_server
from shared.protocol.errors import StrataError


class MemoryPeer(KVTransferHandler):
    """Stores assembled frames by key; serves them back."""

    def __init__(self):
        self.blocks: dict[str, BlockFrame] = {}
        self.chunks_seen = 0

    async def push(self, frames):
        asm, n, nbytes, stored = FrameAssembler(), 0, 0, []
        async for f in frames:
            n += 1
            nbytes += len(f.data)
            if f.key == "boom":
                raise StrataError("bad_request", "refused key boom")
            whole = asm.add(f)
            if whole is not None:
                self.blocks[whole.key] = whole
                stored.append(whole.key)
        self.chunks_seen += n
        return PushReply(frames=n, bytes=nbytes, stored=stored)

    async def pull(self, req: PullRequest):
        for k in req.keys:
            if k == "crash":
                raise RuntimeError("disk on fire")
            if k in self.blocks:
                yield self.blocks[k]

    async def query(self, req: QueryRequest):
        present = [k for k in req.keys if k in self.blocks]
        return QueryReply(present=present, tiers=["dram"] * len(present))


@pytest.fixture
async def peer():
    handler = MemoryPeer()
    server, addr = await start_kv_server(handler, "127.0.0.1", 0, max_frame_bytes=64 * 1024)
    yield handler, addr
    await server.stop(0)


async def test_push_pull_query_round_trip_with_chunking(peer):
    handler, addr = peer
    g = torch.Generator().manual_seed(0)
    big = torch.randn(4, 2, 16, 64, 32, generator=g).to(torch.bfloat16)  # 512 KiB -> chunked
    small = torch.randn(2, 8, generator=g)
    client = KVClient(addr, max_frame_bytes=100 * 1024)

    async def frames():
        for f in tensor_to_frames(big, key="big", fingerprint="fp", max_frame_bytes=100 * 1024):
            yield f
        for f in tensor_to_frames(small, key="small", fingerprint="fp"):
            yield f

    rep = await client.push(frames())
    assert rep.stored == ["big", "small"] and rep.frames == 7  # 6 chunks of big + 1
    assert rep.bytes == big.numel() * 2 + small.numel() * 4

    assert await client.query(["big", "nope", "small"]) == {"big": "dram", "small": "dram"}

    got = [f async for f in client.pull(["small", "nope", "big"])]
    assert [f.key for f in got] == ["small", "big"]
    assert all(f.num_chunks == 1 for f in got)
    assert torch.equal(frame_to_tensor(got[1], dtype=torch.bfloat16), big)

    raw = [f async for f in client.pull(["big"], assemble=False)]
    assert len(raw) == 8  # server re-chunks at its 64 KiB limit
    tensors = await client.pull_tensors(["big", "small"])
    assert torch.equal(tensors["small"], small) and torch.equal(tensors["big"], big)
    await client.close()


async def test_sync_iterable_push_and_client_side_split(peer):
    handler, addr = peer
    client = KVClient(addr, max_frame_bytes=1000)
    whole = tensor_to_frames(torch.arange(1000, dtype=torch.float32), key="a")
    rep = await client.push(whole)  # one 4000-byte frame, split by the client
    assert rep.frames == 4 and rep.stored == ["a"]
    assert torch.equal(
        frame_to_tensor(handler.blocks["a"]), torch.arange(1000, dtype=torch.float32)
    )
    await client.close()


async def test_errors_map_to_strata_codes(peer):
    _, addr = peer
    client = get_client(addr)
    assert get_client(addr) is client
    with pytest.raises(StrataError) as e:
        await client.push(tensor_to_frames(torch.zeros(2), key="boom"))
    assert e.value.code == "bad_request" and "refused key boom" in e.value.message
    with pytest.raises(StrataError) as e:
        _ = [f async for f in client.pull(["crash"])]
    assert e.value.code == "internal" and "disk on fire" in e.value.message
    await close_clients()

    dead = KVClient("127.0.0.1:1")
    with pytest.raises(StrataError) as e:
        await dead.query(["x"], timeout=2)
    assert e.value.code == "unavailable"
    await dead.close()


async def test_a_push_refused_mid_stream_reports_the_handlers_code(peer):
    """The handler refuses the first frame of a long stream the client is still writing. The
    server reads the rest before its status goes out, so the client gets ``bad_request``, never
    grpc.aio's INTERNAL "Internal error from Core" (grpc/grpc#36066: a status that arrives while
    the client still writes is replaced by that). Without the drain about half the tries failed."""
    handler, addr = peer
    client = KVClient(addr)
    chunk = bytes(1 << 20)

    async def frames():  # written over time, as a layer-by-layer push is
        yield BlockFrame(key="boom", data=chunk)
        for i in range(8):
            await asyncio.sleep(0.001)
            yield BlockFrame(key=f"k{i}", data=chunk)

    codes = []
    for _ in range(20):
        with pytest.raises(StrataError) as e:
            await client.push(frames())
        codes.append((e.value.code, e.value.message))
    assert all(c == "bad_request" and "refused key boom" in m for c, m in codes), codes
    assert await client.query(["k0"]) == {}  # nothing after the refused frame was stored
    await client.close()


async def test_default_handler_refuses_push():
    server, addr = await start_kv_server(KVTransferHandler(), "127.0.0.1", 0)
    client = KVClient(addr)
    with pytest.raises(StrataError) as e:
        await client.push(tensor_to_frames(torch.zeros(1), key="k"))
    assert e.value.code == "not_found"
    assert [f async for f in client.pull(["k"])] == []
    assert await client.query(["k"]) == {}
    await client.close()
    await server.stop(0)
