"""Degradation level 1 turns speculation off end to end: the scheduler's `RouteReply` says so,
`routed_submit` carries it into the `WorkItem`'s sampling params (what the instance receives, over
the codec), and the engine drafts nothing for that request while the same engine still drafts
for a request routed at level 0 — with identical greedy tokens either way."""

from __future__ import annotations

from shared.engine.engine import LLMEngine
from shared.engine.params import EngineConfig
from shared.model.loader import load_model
from shared.protocol.codec import decode, encode
from shared.protocol.sampling import SamplingParams
from shared.protocol.sched import RouteReply, routed_submit
from shared.protocol.work import DecodeWork, WorkItem

CFG = dict(kv_cache_bytes=1 << 20, block_size=4, max_num_batched_tokens=64, max_num_seqs=8)
PROMPT = [5, 6, 7, 8, 9] * 4  # repetitive: the n-gram proposer always finds a draft


def _received(level: int) -> DecodeWork:
    item = WorkItem(
        request_id=f"r{level}",
        prompt_token_ids=PROMPT,
        sampling=SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
    )
    route = RouteReply(
        decode_instance="d0", decode_addr="127.0.0.1:1", degrade_level=level, speculation=level == 0
    )
    _, routed = routed_submit(item, route)
    return decode(encode(routed), DecodeWork)


def test_level_1_request_runs_without_drafts(qwen_ckpt):
    _, path = qwen_ckpt
    lm = load_model(path)
    at0, at1 = _received(0), _received(1)
    assert at0.sampling.speculation and not at1.sampling.speculation
    plain = LLMEngine(lm, EngineConfig(**CFG)).generate([PROMPT], at0.sampling)[0]

    eng = LLMEngine(lm, EngineConfig(**CFG, num_speculative_tokens=3))
    assert eng.generate([PROMPT], at1.sampling)[0] == plain
    assert eng.stats().spec_draft_tokens == 0  # level 1: not one draft token
    assert eng.generate([PROMPT], at0.sampling)[0] == plain
    assert eng.stats().spec_draft_tokens > 0  # the same engine drafts at level 0
