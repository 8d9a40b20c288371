"""The engine's KV cache fill as the worker exports it: ``strata:kv_cache_cached_blocks`` (blocks
holding a prefix-cached block) rises with the prompts served and reaches
``strata:kv_cache_total_blocks`` once the cache has filled (what the soak's warm-up waits for)."""

from prometheus_client import REGISTRY

from shared.engine.engine import LLMEngine
from shared.engine.params import EngineConfig
from shared.model.loader import load_model
from shared.protocol.sampling import SamplingParams
from shared.worker.metrics import EngineMetrics
from tests.engine.conftest import prompts

SP = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def run(eng: LLMEngine, batch: list[list[int]], tag: str) -> None:
    for i, p in enumerate(batch):
        eng.add_request(f"{tag}{i}", p, SP)
    while eng.seqs or eng.pending:
        eng.step()


def test_cached_blocks_rise_to_the_total_as_the_cache_fills(qwen_ckpt):
    _, path = qwen_ckpt
    eng = LLMEngine(load_model(path), EngineConfig(kv_cache_bytes=1 << 19, block_size=4))
    total = eng.stats().kv_blocks_total
    assert eng.stats().kv_blocks_cached == 0
    run(eng, prompts(5, [16]), "one")  # one prompt: its 4 full blocks are cached
    assert eng.stats().kv_blocks_cached == 4
    # unique prompts worth three caches: every block has been used, each new one evicts one
    run(eng, prompts(6, [64] * (3 * total // 16)), "fill")
    stats = eng.stats()
    assert stats.kv_blocks_cached == total
    m = EngineMetrics("decode", "cache-fill-test")
    m.update(stats)
    labels = {"role": "decode", "instance": "cache-fill-test"}
    assert REGISTRY.get_sample_value("strata:kv_cache_total_blocks", labels) == total
    assert REGISTRY.get_sample_value("strata:kv_cache_cached_blocks", labels) == total
