"""`KVPrefaulter`: the idle engine makes the KV cache's pages past the blocks in use resident
(``mincore`` says so, where a cache nobody prefaulted has them absent), without changing a
block's contents, only up to the window past the high-water mark, and `EnginePort` runs it
while no request is unfinished, with streams unchanged."""

import asyncio
import ctypes
import mmap
import sys
import time

import pytest
import torch

from shared.engine.block_manager import BlockManager
from shared.engine.engine import LLMEngine
from shared.engine.params import EngineConfig
from shared.engine.port import EnginePort
from shared.engine.prefault import KVPrefaulter
from shared.model.api import KVCache
from shared.model.loader import load_model
from shared.protocol.sampling import SamplingParams
from tests.engine.conftest import prompts

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="MADV_POPULATE_WRITE is Linux's")

LAYERS, BLOCKS, BS, HEADS, DIM = 2, 512, 16, 4, 64  # 16 KiB a layer's block: 4 pages
BLOCK = BS * HEADS * DIM * 4

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)


def resident(t: torch.Tensor, layer: int, first: int, last: int) -> float:
    """Share of the pages of blocks ``[first, last)`` of ``layer`` in memory now."""
    block = t[0, 0].numel() * t.element_size()
    lo = t.data_ptr() + (layer * t.shape[1] + first) * block
    hi = t.data_ptr() + (layer * t.shape[1] + last) * block
    lo -= lo % mmap.PAGESIZE
    hi += -hi % mmap.PAGESIZE
    pages = (hi - lo) // mmap.PAGESIZE
    vec = ctypes.create_string_buffer(pages)
    assert _libc.mincore(lo, hi - lo, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw) / pages


def cache() -> KVCache:
    return KVCache.allocate(LAYERS, BLOCKS, BS, HEADS, DIM, torch.float32)


def test_faults_in_the_window_past_the_high_water_mark_and_keeps_contents():
    kv = cache()
    assert resident(kv.k, 1, 100, 140) == 0.0  # lazily zeroed: nothing there before
    kv.k[1, 3].fill_(7.0)  # a block in use
    window = 40 * 2 * LAYERS * BLOCK  # 40 blocks of every layer, k and v
    p = KVPrefaulter(kv.k, kv.v, window)
    assert p.why == "" and p.window == 40
    total = 0
    while p.pending(high_water=100):
        total += p.step(high_water=100)
    assert p.done == 140 and p.bytes == total >= window
    for t in (kv.k, kv.v):
        for layer in range(LAYERS):
            assert resident(t, layer, 100, 140) == 1.0
    assert torch.equal(kv.k[1, 3], torch.full_like(kv.k[1, 3], 7.0))  # populated, not written
    assert torch.count_nonzero(kv.k[:, 100:140]) == 0
    # the high-water mark moves on: the window follows it, blocks below it are skipped
    assert p.pending(high_water=130) and p.step(high_water=130) > 0 and p.done == 170
    assert p.step(high_water=BLOCKS) == 0 and not p.pending(high_water=BLOCKS)


def test_window_zero_is_off():
    kv = cache()
    p = KVPrefaulter(kv.k, kv.v, 0)
    assert p.why == "off" and not p.pending(0) and p.step(0) == 0


def test_block_manager_high_water_is_the_blocks_ever_handed_out():
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    a: list[int] = []
    b: list[int] = []
    assert bm.allocate_slots(a, 12) and a == [0, 1, 2] and bm.high_water == 3
    bm.free(a)  # freed uncached blocks are reused first: the mark stays
    assert bm.allocate_slots(b, 8) and sorted(b) == [0, 1] and bm.high_water == 3
    assert bm.allocate_slots(b, 28) and bm.high_water == 7


CFG = dict(kv_cache_bytes=8 << 20, block_size=16, max_num_batched_tokens=64, max_num_seqs=8)
SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("window", [4 << 20, 0])
async def test_the_idle_port_prefaults_and_streams_are_unchanged(qwen_ckpt, window):
    _, path = qwen_ckpt
    model = load_model(path)
    ps = prompts(14, [5, 9, 13])
    want = LLMEngine(model, EngineConfig(**CFG)).generate(ps, SP)
    engine = LLMEngine(model, EngineConfig(**CFG, kv_prefault_bytes=window))
    port = EnginePort(engine)
    try:
        end = time.monotonic() + 20
        while window and engine.prefault.pending(engine.bm.high_water):
            assert time.monotonic() < end, "the idle engine did not prefault its window"
            await asyncio.sleep(0.01)
        k, blocks = engine.runner.kv.k, engine.prefault.window
        got = port.stats().kv_prefaulted_bytes
        if window:
            assert got >= window and blocks > 0
            assert resident(k, 0, 0, blocks) == 1.0
        else:
            assert got == 0 and resident(k, 0, 0, 8) == 0.0  # nobody touched it

        async def one(i, p):
            return sum([o.new_token_ids async for o in port.generate(f"r{i}", p, SP)], [])

        outs = await asyncio.wait_for(asyncio.gather(*(one(i, p) for i, p in enumerate(ps))), 60)
        assert list(outs) == want
    finally:
        port.shutdown()
