import pytest

from shared.engine.engine import LLMEngine
from shared.engine.params import EngineConfig
from shared.model.loader import load_model
from shared.protocol.sampling import SamplingParams
from tests.engine.conftest import hf_greedy, prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def engine(path, **kw) -> LLMEngine:
    cfg = dict(kv_cache_bytes=1 << 20, block_size=4, max_num_batched_tokens=64, max_num_seqs=8)
    cfg.update(kw)
    return LLMEngine(load_model(path), EngineConfig(**cfg))


@pytest.mark.parametrize(
    "kw",
    [
        {},  # batched
        {"max_num_batched_tokens": 8},  # chunked prefill with a small budget
        {"enable_prefix_caching": False},
    ],
    ids=["batched", "chunked", "nocache"],
)
def test_batched_matches_transformers(hf_ckpt, kw):
    hf, path = hf_ckpt
    ps = prompts(1, [5, 13, 9, 22])
    ps.append(ps[1][:8] + [7, 7, 7])  # shares two full blocks with prompt 1
    want = [hf_greedy(hf, p, 8) for p in ps]
    eng = engine(path, **kw)
    assert eng.generate(ps, GREEDY) == want
    alone = engine(path)
    assert [alone.generate([p], GREEDY)[0] for p in ps] == want
    assert eng.bm.num_free_blocks == eng.bm.num_blocks  # everything released


def test_prefix_cache_hit_same_tokens(qwen_ckpt):
    hf, path = qwen_ckpt
    [p] = prompts(2, [30])
    eng = engine(path)
    first = eng.generate([p], GREEDY)[0]
    eng.add_request("again", p, GREEDY)
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert outs[0].num_cached_tokens == 28  # 7 full blocks; the last token is recomputed
    assert sum((o.new_token_ids for o in outs), []) == first == hf_greedy(hf, p, 8)
    st = eng.stats()
    assert st.prefix_hit_tokens == 28 and st.prefix_query_tokens == 60


def test_preemption_recompute_and_swap_keep_greedy(qwen_ckpt):
    hf, path = qwen_ckpt
    ps = prompts(3, [10, 11, 12])
    want = [hf_greedy(hf, p, 8) for p in ps]
    for mode in ("recompute", "swap"):
        # 12 blocks of 4 tokens: three sequences of ~20 tokens cannot all fit
        bpb = 2 * 2 * 4 * 2 * 16 * 4
        eng = engine(path, kv_cache_bytes=12 * bpb, preemption_mode=mode)
        assert eng.bm.num_blocks == 12
        assert eng.generate(ps, GREEDY) == want, mode
        assert eng.stats().preemptions > 0
        assert eng.bm.num_free_blocks == 12


def test_priority_class_finishes_first(qwen_ckpt):
    _, path = qwen_ckpt
    eng = engine(path, max_num_seqs=1)
    ps = prompts(4, [6, 6])
    eng.add_request("batch", ps[0], GREEDY, priority=5)
    eng.step()
    eng.add_request("interactive", ps[1], GREEDY, priority=0)
    order = []
    while eng.has_unfinished_requests():
        order += [o.request_id for o in eng.step() if o.finished]
    assert order == ["interactive", "batch"]
    assert eng.stats().preemptions == 1
