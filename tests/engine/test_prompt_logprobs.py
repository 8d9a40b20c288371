"""vLLM's prompt_logprobs from the engine's prefill logits, against a transformers forward."""

import pytest
import torch

from shared.engine.engine import LLMEngine
from shared.engine.params import EngineConfig
from shared.model.loader import load_model
from shared.protocol.sampling import SamplingParams
from tests.engine.conftest import prompts

TOL = 1e-4  # float32 tiny model: the engine's logits match transformers to ~1e-5


def engine(path, **kw) -> LLMEngine:
    cfg = dict(kv_cache_bytes=1 << 20, block_size=4, max_num_batched_tokens=64, max_num_seqs=8)
    cfg.update(kw)
    return LLMEngine(load_model(path), EngineConfig(**cfg))


def hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab] log-softmax: row p-1 is the distribution of prompt token p."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def run(eng: LLMEngine, reqs: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for rid, (p, sp) in reqs.items():
        eng.add_request(rid, p, sp)
    got: dict[str, list] = {rid: [] for rid in reqs}
    while eng.has_unfinished_requests():
        for o in eng.step():
            got[o.request_id].append(o)
    return got


def check(hf, prompt: list[int], out, n: int) -> None:
    ref = hf_prompt_logprobs(hf, prompt)
    assert len(out.prompt_logprobs) == len(out.prompt_ranks) == len(prompt) - 1
    for p in range(1, len(prompt)):
        d, rank, row = out.prompt_logprobs[p - 1], out.prompt_ranks[p - 1], ref[p - 1]
        tok = prompt[p]
        assert next(iter(d)) == tok  # the prompt token first
        assert d[tok] == pytest.approx(float(row[tok]), abs=TOL)
        assert rank == int((row > row[tok]).sum()) + 1
        top_v, top_i = row.topk(n)
        for t, v in zip(top_i.tolist(), top_v.tolist(), strict=True):
            assert d[t] == pytest.approx(v, abs=TOL)
        assert len(d) in (n, n + 1)  # the top-n, plus the prompt token when not among them


@pytest.mark.parametrize("budget", [64, 8], ids=["whole", "chunked"])
def test_prompt_logprobs_match_transformers(hf_ckpt, budget):
    hf, path = hf_ckpt
    p0, p1 = prompts(11, [21, 9])
    eng = engine(path, max_num_batched_tokens=budget)
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=3)
    plain = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    got = run(eng, {"a": (p0, sp), "b": (p1, plain)})
    first = got["a"][0]
    check(hf, p0, first, 3)
    assert all(o.prompt_logprobs is None for o in got["a"][1:])  # once, with the first token
    assert all(o.prompt_logprobs is None for o in got["b"])  # not asked for


def test_prompt_logprobs_skip_the_prefix_cache(qwen_ckpt):
    hf, path = qwen_ckpt
    [p] = prompts(12, [22])
    eng = engine(path)
    base = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    run(eng, {"warm": (p, base)})
    again = run(eng, {"again": (p, base)})["again"][0]
    assert again.num_cached_tokens == 20  # a plain repeat reuses 5 full blocks
    sp = base.model_copy(update={"prompt_logprobs": 0})
    out = run(eng, {"lp": (p, sp)})["lp"][0]
    assert out.num_cached_tokens == 0  # recomputed: the cached blocks have no logits
    check(hf, p, out, 0)
    assert all(len(d) == 1 for d in out.prompt_logprobs)  # 0: the prompt token only
