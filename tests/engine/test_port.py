"""`EnginePort`: streams equal the synchronous engine, leaving a stream aborts and frees, errors
of typed commands reach their caller, and a `KVConnector` sees every layer of the requests it
wants (and nothing else), with the K/V the request's blocks hold."""

import asyncio

import pytest
import torch

from shared.engine.engine import LLMEngine
from shared.engine.params import EngineConfig
from shared.engine.port import EnginePort
from shared.engine.port_types import KVConnector, LayerKV
from shared.model.loader import load_model
from shared.protocol.sampling import SamplingParams
from tests.engine.conftest import prompts

CFG = dict(kv_cache_bytes=1 << 20, block_size=4, max_num_batched_tokens=64, max_num_seqs=8)
SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


async def test_streams_match_sync_and_abort_frees(qwen_ckpt):
    _, path = qwen_ckpt
    model = load_model(path)
    ps = prompts(14, [5, 9, 13])
    want = LLMEngine(model, EngineConfig(**CFG)).generate(ps, SP)
    port = EnginePort(LLMEngine(model, EngineConfig(**CFG)))
    total = port.stats().kv_blocks_total
    try:

        async def one(i, p):
            return sum([o.new_token_ids async for o in port.generate(f"r{i}", p, SP)], [])

        got = await asyncio.wait_for(asyncio.gather(*(one(i, p) for i, p in enumerate(ps))), 60)
        assert list(got) == want
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        async for _ in port.generate("cut", ps[0], long):
            break  # leaving early aborts
        for _ in range(100):
            if port.stats().kv_blocks_free == total:
                break
            await asyncio.sleep(0.02)
        assert port.stats().kv_blocks_free == total and port.queued_tokens() == 0
        st = port.stats()
        assert st.steps > 0 and 0 < st.forward_time_s <= st.step_time_s
        # a bad request fails its own stream with the engine's reason; the port goes on
        with pytest.raises(ValueError, match="prompt token ids must be in"):
            _ = [o async for o in port.generate("bad", [10**6], SP)]
        with pytest.raises(KeyError, match="no request 'nope'"):
            await port.read_kv("nope")
        assert sum([o.new_token_ids async for o in port.generate("ok", ps[0], SP)], []) == want[0]
    finally:
        port.shutdown()


async def test_a_step_hands_its_outputs_to_the_event_loop_at_once(qwen_ckpt, monkeypatch):
    """Every output of one step reaches the event loop in one ``call_soon_threadsafe`` (one
    self-pipe write and GIL hand-over), not one per running request."""
    from shared.engine import port as port_module

    _, path = qwen_ckpt
    model = load_model(path)
    ps = prompts(16, [5, 9, 13, 6])
    want = LLMEngine(model, EngineConfig(**CFG)).generate(ps, SP)
    port = EnginePort(LLMEngine(model, EngineConfig(**CFG)))
    loop = asyncio.get_running_loop()
    handed, orig = [], loop.call_soon_threadsafe

    def counting(callback, *args, **kwargs):
        if callback is port_module._put_all:
            handed.append(len(args[0]))
        return orig(callback, *args, **kwargs)

    monkeypatch.setattr(loop, "call_soon_threadsafe", counting)
    try:

        async def one(i, p):
            return [o async for o in port.generate(f"r{i}", p, SP)]

        outs = await asyncio.wait_for(asyncio.gather(*(one(i, p) for i, p in enumerate(ps))), 60)
        assert [sum((o.new_token_ids for o in out), []) for out in outs] == want
        assert sum(handed) == sum(map(len, outs))  # every output went through a batch
        assert len(handed) <= port.stats().steps  # at most one hand-over per step
        assert max(handed) == len(ps)  # the decode steps carried all four requests at once
    finally:
        port.shutdown()


class Recorder(KVConnector):
    def __init__(self, wanted: set[str]):
        self.wanted = wanted
        self.saved: list[tuple[str, int, int, int, bool]] = []
        self.kv: dict[tuple[str, int], list[torch.Tensor]] = {}
        self.waits = 0

    def wants(self, request_id: str) -> bool:
        return request_id in self.wanted

    def save_layer(self, request_id: str, layer: int, kv: LayerKV) -> None:
        self.saved.append((request_id, layer, kv.token_start, kv.token_end, kv.final))
        self.kv.setdefault((request_id, layer), []).append(kv.new_tokens()[0])

    def wait_for_save(self) -> None:
        self.waits += 1


async def test_connector_sees_each_layer_of_wanted_requests(qwen_ckpt):
    _, path = qwen_ckpt
    model = load_model(path)
    p, q = prompts(15, [10, 7])
    port = EnginePort(LLMEngine(model, EngineConfig(**{**CFG, "max_num_batched_tokens": 8})))
    rec = Recorder({"tap"})
    port.set_connector(rec)
    try:
        one = SamplingParams(temperature=0, max_tokens=1)
        outs = await asyncio.gather(
            _collect(port.generate("tap", p, one, hold_kv=True)),
            _collect(port.generate("other", q, one)),
        )
        assert all(o[-1].finished for o in outs)
        L = port.kv_spec.num_layers
        mine = [s for s in rec.saved if s[0] == "tap"]
        assert len(mine) == len(rec.saved)  # nothing of the request it did not want
        # 10 prompt tokens in chunks under an 8-token budget: every layer of every chunk, in
        # order, the last layer of the sampling chunk marked final
        ranges = sorted({(s[2], s[3]) for s in mine})
        assert ranges[0][0] == 0 and ranges[-1][1] == 10
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
        assert [s[1] for s in mine] == [layer for _ in ranges for layer in range(L)]
        assert [s for s in mine if s[4]] == [("tap", L - 1, *ranges[-1], True)]
        assert rec.waits >= len(ranges)
        held = (await port.read_kv("tap")).tokens()
        for layer in range(L):
            assert torch.equal(torch.cat(rec.kv[("tap", layer)], dim=1), held[layer])
        await port.release("tap")
    finally:
        port.shutdown()


async def _collect(stream):
    return [o async for o in stream]


async def test_warm_up_blocks_are_not_written_through_but_computed_ones_are(qwen_ckpt):
    """The warm-up prefill's synthetic blocks never reach `drain_computed`; a real request's
    full blocks do, with the KV its blocks hold."""
    _, path = qwen_ckpt
    cfg = EngineConfig(**CFG, pool_save="all")
    port = EnginePort.open(load_model(path), cfg, warm_up_tokens=16)
    try:
        assert await port.drain_computed() == []
        p = prompts(14, [9])[0]  # 2 full blocks of 4 computed (+ 6 outputs: 3 more)
        _ = [o async for o in port.generate("r", p, SP)]
        got = await port.drain_computed()
        hashes = (await port.match_prefix(p)).hashes
        assert [b.hash for b in got][:2] == hashes[:2] and len(got) == (9 + 6 - 1) // 4
    finally:
        port.shutdown()


async def test_match_prefix_answers_without_the_engine_thread(qwen_ckpt, monkeypatch):
    """A prompt's pool lookup starts from `match_prefix`; it is answered on the caller's thread
    (no command through the engine's inbox, so it never waits for a step), and after a request
    it sees the blocks that request cached. The warm-up's synthetic blocks are not findable."""
    _, path = qwen_ckpt
    port = EnginePort.open(load_model(path), EngineConfig(**CFG), warm_up_tokens=16)
    try:
        synthetic = [(i * 7919) % port._engine.loaded.config.vocab_size for i in range(16)]
        p = prompts(14, [9])[0]
        _ = [o async for o in port.generate("r", p, SP)]

        def no_inbox(command):
            raise AssertionError(f"{type(command).__name__} went through the engine thread")

        monkeypatch.setattr(port, "_submit", no_inbox)
        got = await port.match_prefix(p)
        assert len(got.hashes) == 2 and got.cached_tokens == 8
        assert (await port.match_prefix(synthetic)).cached_tokens == 0
    finally:
        port.shutdown()
