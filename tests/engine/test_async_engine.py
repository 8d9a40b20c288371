import asyncio

from shared.engine.async_engine import AsyncEngine
from shared.engine.engine import LLMEngine
from shared.engine.params import EngineConfig, SamplingParams
from shared.model.loader import load_model
from tests.engine.conftest import prompts

CFG = dict(kv_cache_bytes=1 << 20, block_size=4, max_num_batched_tokens=64, max_num_seqs=8)
SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


async def test_async_streams_match_sync_and_abort_frees(qwen_ckpt):
    _, path = qwen_ckpt
    model = load_model(path)
    ps = prompts(14, [5, 9, 13])
    want = LLMEngine(model, EngineConfig(**CFG)).generate(ps, SP)
    eng = LLMEngine(model, EngineConfig(**CFG))
    ae = AsyncEngine(eng)
    try:

        async def one(i, p):
            return sum([o.new_token_ids async for o in ae.generate(f"r{i}", p, SP)], [])

        got = await asyncio.wait_for(asyncio.gather(*(one(i, p) for i, p in enumerate(ps))), 60)
        assert list(got) == want
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        async for _ in ae.generate("cut", ps[0], long):
            break  # leaving early aborts
        for _ in range(100):
            if await ae.call(lambda e: e.bm.num_free_blocks) == eng.bm.num_blocks:
                break
            await asyncio.sleep(0.02)
        assert await ae.call(lambda e: e.bm.num_free_blocks) == eng.bm.num_blocks
        st = ae.stats()
        assert st.steps > 0 and 0 < st.forward_time_s <= st.step_time_s
    finally:
        ae.shutdown()
