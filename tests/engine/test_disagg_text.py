"""Disaggregated prefill and the KV pool through the engine's port: the held KV read on one
engine, reserved, written (whole or frame by frame) and committed on another; prefix match,
cached-block insertion, KV events and evicted blocks."""

import asyncio
import contextlib

import pytest
import torch

from shared.engine.engine import LLMEngine
from shared.engine.params import EngineConfig
from shared.engine.port import EnginePort
from shared.engine.port_types import ExternalKV
from shared.model.loader import load_model
from shared.protocol.sampling import SamplingParams
from tests.engine.conftest import prompts

CFG = dict(kv_cache_bytes=1 << 20, block_size=4, max_num_batched_tokens=64, max_num_seqs=8)
SP = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


async def _prefill(a: EnginePort, rid, prompt):
    sp = SamplingParams(temperature=0, max_tokens=1)
    [o] = [o async for o in a.generate(rid, prompt, sp, hold_kv=True)]
    assert o.finished and o.finish_reason == "length"
    got = await a.read_kv(rid)  # blocks [L, 2, nb, bs, kvh, hd]
    assert got.num_tokens == len(prompt)
    return o.new_token_ids[0], got.tokens(), got.blocks


async def _decode(b: EnginePort, rid, prompt, first):
    return sum([o.new_token_ids async for o in b.generate_prefilled(rid, prompt, first, SP)], [])


@contextlib.contextmanager
def _ports(model, n: int, **cfg):
    ports = [EnginePort(LLMEngine(model, EngineConfig(**{**CFG, **cfg}))) for _ in range(n)]
    try:
        yield ports
    finally:
        for port in ports:
            port.shutdown()


async def test_prefill_on_a_decode_on_b_equals_single_engine(qwen_ckpt):
    _, path = qwen_ckpt
    model = load_model(path)
    [p] = prompts(9, [14])
    want = LLMEngine(model, EngineConfig(**CFG)).generate([p], SP)[0]
    with _ports(model, 2) as (a, b):
        first, flat, _ = await _prefill(a, "r", p)
        assert first == want[0]
        held = a.stats().kv_blocks_free
        await a.release("r")
        assert a.stats().kv_blocks_free == held + 4  # 14 tokens in 4 blocks
        L = flat.shape[0]
        # whole request in one write
        assert await b.reserve_kv("r", len(p)) == 0
        assert await b.write_kv("r", range(L), 0, flat) == 14
        assert [first] + await _decode(b, "r", p, first) == want
        # frame by frame (a layer and a token range each) with a prefix hit on B: its 3 full
        # blocks are cached now, so only tokens 12 and 13 are written
        base = b.stats().kv_blocks_free
        assert await b.reserve_kv("r2", len(p), p) == 12
        written = [
            await b.write_kv(
                "r2", range(layer, layer + 1), t0, flat[layer : layer + 1, :, t0 : t0 + 7]
            )
            for layer in range(L)
            for t0 in (0, 7)
        ]
        assert written == [0, 2] * L
        assert [first] + await _decode(b, "r2", p, first) == want
        assert b.stats().kv_blocks_free == base
        # cancel frees a partial reservation; bad writes are refused with the reason
        await b.reserve_kv("r3", 30)
        assert await b.write_kv("r3", range(0, 1), 0, torch.zeros(1, 2, 30, 2, 16)) == 30
        with pytest.raises(ValueError, match="out of range"):
            await b.write_kv("r3", range(0, 1), 20, torch.zeros(1, 2, 11, 2, 16))
        assert await b.cancel_kv("r3") and not await b.cancel_kv("r3")
        assert b.stats().kv_blocks_free == base
        with pytest.raises(KeyError, match="no KV reservation"):
            await b.write_kv("r3", range(0, 1), 0, torch.zeros(1, 2, 1, 2, 16))
        with pytest.raises(KeyError, match="no KV reservation"):
            await _decode(b, "r3", p, first)


async def test_pool_hooks_match_insert_and_evicted(qwen_ckpt):
    _, path = qwen_ckpt
    model = load_model(path)
    [p] = prompts(10, [17])
    want = LLMEngine(model, EngineConfig(**CFG)).generate([p], SP)[0]
    with (
        _ports(model, 1) as (a,),
        _ports(model, 1, kv_cache_bytes=40 * 2048, collect_evicted_kv=True) as (b,),
    ):  # 40 blocks
        _, _, kv = await _prefill(a, "x", p)
        hashes, cached = await a.match_prefix(p)
        assert len(hashes) == 4 and cached == 16
        ev = await a.drain_kv_events()
        assert [e.kind for e in ev] == ["stored"] and ev[0].hashes == hashes
        assert await a.drain_kv_events() == []
        # B takes the pool blocks in with the request (admitted like a prefix hit): the output
        # equals the single engine's, and the blocks are cached from then on
        assert (await b.match_prefix(p)).cached_tokens == 0
        ext = ExternalKV(hashes, kv[:, :, :4])
        outs = [o async for o in b.generate("y", p, SP, external_kv=ext)]
        assert outs[0].num_cached_tokens == 16
        assert sum((o.new_token_ids for o in outs), []) == want
        assert b.stats().external_blocks == {"used": 4, "skipped": 0}
        assert await b.match_prefix(p) == (hashes, 16)
        # a second request carrying blocks B holds by now: skipped, not written again
        ext = ExternalKV(hashes[:2], kv[:, :, :2])
        outs = [o async for o in b.generate("z", p, SP, external_kv=ext)]
        assert sum((o.new_token_ids for o in outs), []) == want
        assert b.stats().external_blocks == {"used": 4, "skipped": 2}
        # fill B so the cached blocks get evicted; their bytes come out intact
        [long] = prompts(11, [159])
        _ = [o async for o in b.generate("z", long, SamplingParams(temperature=0, max_tokens=1))]
        ev = dict(await b.drain_evicted())
        assert len(ev) == 6  # 4 inserted + 2 more full blocks of request y
        assert hashes[0] in ev
        assert torch.equal(ev[hashes[0]], kv[:, :, 0])
        assert await b.drain_evicted() == []


class CharTok:
    """Each id decodes to one letter; enough for IncrementalDetokenizer."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_stop_strings_trimmed_and_text_deltas(qwen_ckpt):
    _, path = qwen_ckpt
    model = load_model(path)
    [p] = prompts(12, [9])
    free = LLMEngine(model, EngineConfig(**CFG)).generate([p], SP)[0]
    text = CharTok().decode(free)
    stop = text[4:6]
    cut = text.find(stop)
    eng = LLMEngine(model, EngineConfig(**CFG), tokenizer=CharTok())
    sp = SP.model_copy(update={"stop": [stop, "never-there"]})
    eng.add_request("s", p, sp)
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert "".join(o.text_delta for o in outs) == text[:cut]
    assert outs[-1].finish_reason == "stop" and outs[-1].finished
    got = sum((o.new_token_ids for o in outs), [])
    assert got == free[: cut + len(stop)]
    eng.add_request("plain", p, SP)
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert "".join(o.text_delta for o in outs) == text and len(outs) == 10


def test_abort_frees_blocks_and_reports(qwen_ckpt):
    _, path = qwen_ckpt
    eng = LLMEngine(load_model(path), EngineConfig(**CFG))
    eng.add_request("a", prompts(13, [20])[0], SP)
    eng.step()
    assert eng.bm.num_free_blocks < eng.bm.num_blocks
    eng.abort_request("a")
    assert eng.bm.num_free_blocks == eng.bm.num_blocks
    [o] = eng.step()
    assert o.finished and o.finish_reason == "abort" and not eng.has_unfinished_requests()


async def test_pushed_kv_is_admitted_at_its_first_frame_and_holds_a_batch_slot(qwen_ckpt):
    """A push is admitted by B's scheduler at its first frame (`Scheduler.admit_incoming`): its
    blocks are allocated then, and with max_num_seqs=1 the slot it takes keeps a waiting
    request out until its decode is done. A push whose blocks are not free is refused (the
    caller computes the prompt instead), never by preempting a running sequence."""
    _, path = qwen_ckpt
    model = load_model(path)
    [p, q] = prompts(21, [13, 9])
    want_q = LLMEngine(model, EngineConfig(**CFG)).generate([q], SP)[0]
    with _ports(model, 1) as (a,), _ports(model, 1, max_num_seqs=1) as (b,):
        first, flat, _ = await _prefill(a, "p", p)
        free = b.stats().kv_blocks_free
        await b.reserve_kv("p", len(p))
        assert b.stats().kv_blocks_free == free - 4  # admitted: its 4 blocks are held
        waiting = asyncio.create_task(_collect(b.generate("q", q, SP)))
        await asyncio.sleep(0.3)  # B steps meanwhile, but the incoming push holds the slot
        assert b.stats().waiting == 1 and b.stats().running == 0 and not waiting.done()
        await b.write_kv("p", range(flat.shape[0]), 0, flat)
        await _decode(b, "p", p, first)
        assert await waiting == want_q
    with _ports(model, 1, kv_cache_bytes=11 * 2048) as (c,):  # 11 blocks of 4 tokens
        held = await _collect(c.generate("r", prompts(22, [20])[0], SP, hold_kv=True))
        assert len(held) == 10 and c.stats().kv_blocks_free == 3  # r keeps its 8 blocks
        with pytest.raises(MemoryError, match="no KV blocks"):
            await c.reserve_kv("p", len(p))  # 4 blocks: not free, and nothing is taken
        await c.release("r")
        await c.reserve_kv("p", len(p))
        assert c.stats().kv_blocks_free == 7 and c.stats().preemptions == 0


async def _collect(stream) -> list[int]:
    return sum([o.new_token_ids async for o in stream], [])
