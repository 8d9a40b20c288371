"""The engine counts the prompt tokens and forward seconds of its mostly-prefill forwards
(`StepTimes.prefill_tokens` / ``prefill_forward_s``), so an instance that prefills beside its
decodes (the colocated shape) measures its prefill rate from real work: a prompt alone counts,
decode steps do not, a step whose tokens are mostly decodes does not either."""

from __future__ import annotations

import torch

from shared.engine.engine import PROMPT_SHARE, LLMEngine
from shared.engine.params import EngineConfig
from shared.model.loader import load_model
from shared.protocol.sampling import SamplingParams
from tests.engine.conftest import prompts


def test_mostly_prefill_forwards_are_counted_and_decodes_are_not(qwen_ckpt):
    _, path = qwen_ckpt
    engine = LLMEngine(
        load_model(path), EngineConfig(kv_cache_bytes=8 << 20, async_scheduling=False)
    )
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with torch.inference_mode():
        for i, p in enumerate(prompts(0, [40] * 12)):
            engine.add_request(f"a{i}", p, params)
        engine.step()  # twelve 40-token prompts: all prefill
        s = engine.stats()
        assert s.prefill_tokens == 12 * 40 and s.prefill_forward_s > 0
        first = s.prefill_forward_s
        engine.step()  # twelve decodes
        assert engine.stats().prefill_tokens == 12 * 40
        # a 3-token prompt beside twelve decodes: 3 of 15 tokens, under PROMPT_SHARE
        assert 3 < PROMPT_SHARE * 15
        engine.add_request("b", prompts(1, [3])[0], params)
        engine.step()
        s = engine.stats()
        assert (s.prefill_tokens, s.prefill_forward_s) == (12 * 40, first)
        engine.add_request("c", prompts(2, [200])[0], params)  # 200 of 213 tokens
        engine.step()
        assert engine.stats().prefill_tokens == 12 * 40 + 200
        while engine.has_unfinished_requests():
            engine.step()
