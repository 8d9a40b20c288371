"""Draft-model speculation and rejection sampling.

- A draft model proposes greedy drafts from its own KV cache; greedy output equals the plain
  engine's whatever the draft. With the target itself as its draft every draft is accepted,
  which holds only if the draft's KV is right for every context: after a prefix hit (the
  target's KV came from its cache, the draft computes the context itself), after preemption,
  and for sequences that join while others run.
- Rejection sampling keeps each emitted token distributed as the target's filtered
  distribution, whatever the drafts (checked statistically on the sampler alone).
"""

from __future__ import annotations

import pytest
import torch

from shared.engine.engine import LLMEngine
from shared.engine.params import EngineConfig, EngineConfigError
from shared.engine.sampler import Sampler, SampleRow, filtered_probs
from shared.model.errors import CheckpointError
from shared.model.loader import load_model
from shared.protocol.sampling import SamplingParams
from tests.engine.conftest import _save, prompts

CFG = dict(kv_cache_bytes=1 << 20, block_size=4, max_num_batched_tokens=64, max_num_seqs=8)
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """(target dir, other draft dir): a Qwen3 target and a Llama draft of the same vocab."""
    a, b = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("draft")
    _save("qwen3", a)
    _save("llama", b)
    return a, b


@pytest.fixture(scope="module")
def target(ckpts):
    return load_model(ckpts[0])


def _spec(lm, draft, k=3, **kw) -> LLMEngine:
    cfg = {**CFG, **kw}
    return LLMEngine(
        lm, EngineConfig(**cfg, num_speculative_tokens=k, speculative_model=str(draft))
    )


def test_greedy_output_equals_plain_with_any_draft(ckpts, target):
    ps = prompts(11, [5, 9, 14, 30])
    ref = LLMEngine(target, EngineConfig(**CFG)).generate(ps, GREEDY)
    own = _spec(target, ckpts[0])
    assert own.generate(ps, GREEDY) == ref
    st = own.stats()
    # the target as its own draft: every draft is the target's own argmax
    assert st.spec_draft_tokens > 0 and st.spec_accepted_tokens == st.spec_draft_tokens
    assert st.spec_draft_forwards > 0
    drafted = own.proposer.stats
    assert drafted.proposed == st.spec_draft_tokens and drafted.no_room == 0
    # the draft computed every prompt token itself before proposing
    assert drafted.catch_up_tokens >= sum(len(p) for p in ps)
    other = _spec(target, ckpts[1])
    assert other.generate(ps, GREEDY) == ref
    st = other.stats()
    assert st.spec_draft_tokens > 0 and st.spec_accepted_tokens < st.spec_draft_tokens
    # all draft blocks are returned once the requests finish (next proposal's clean-up)
    other.generate(ps[:1], SamplingParams(temperature=0, max_tokens=1))
    assert not other.proposer.states


def test_draft_kv_is_right_after_a_prefix_hit_and_preemption(ckpts, target):
    """A prompt whose prefix the target has cached (the draft has not computed it for this
    sequence), and a KV budget so small that sequences are preempted and recomputed: the
    self-draft still has every draft accepted."""
    ps = prompts(12, [24, 31])
    eng = _spec(target, ckpts[0])
    first = eng.generate(ps[:1], GREEDY)[0]
    hits = eng.stats().prefix_hit_tokens
    longer = ps[0] + first + ps[1][:5]
    got = eng.generate([longer], GREEDY)
    assert eng.stats().prefix_hit_tokens - hits >= 40
    assert got == LLMEngine(target, EngineConfig(**CFG)).generate([longer], GREEDY)
    st = eng.stats()
    assert st.spec_accepted_tokens == st.spec_draft_tokens > 0
    # preemption: 6 sequences of up to 60 tokens in 2 x 16 blocks of 4 tokens
    small = dict(CFG, kv_cache_bytes=0)
    per_block = eng.runner.bytes_per_block(eng.runner.model, 4, torch.float32) * 2
    small["kv_cache_bytes"] = 32 * per_block
    tight = _spec(
        target,
        ckpts[0],
        **{k: v for k, v in small.items() if k != "kv_cache_bytes"},
        kv_cache_bytes=small["kv_cache_bytes"],
    )
    many = prompts(13, [20, 22, 25, 27, 30, 33])
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert tight.generate(many, sp) == LLMEngine(target, EngineConfig(**CFG)).generate(many, sp)
    st = tight.stats()
    assert st.preemptions > 0
    assert st.spec_accepted_tokens == st.spec_draft_tokens > 0


def test_draft_cache_shares_the_kv_budget(ckpts, target):
    plain = LLMEngine(target, EngineConfig(**CFG, num_speculative_tokens=3))  # n-gram
    own = _spec(target, ckpts[0])
    # the self-draft's blocks are as big as the target's: half as many blocks each
    assert own.bm.num_blocks == plain.bm.num_blocks // 2
    assert own.runner.kv_bytes + own.proposer.runner.kv_bytes <= CFG["kv_cache_bytes"]


def test_sampled_requests_speculate_reproducibly(ckpts, target):
    """Seeded sampled requests go through rejection sampling (drafts accepted and refused)
    and, like plain seeded sampling, pick the same tokens alone or in a batch."""
    ps = prompts(14, [6, 11, 17])
    sp = SamplingParams(temperature=0.7, max_tokens=16, ignore_eos=True, seed=5)
    eng = _spec(target, ckpts[0])
    batch = eng.generate(ps, sp)
    st = eng.stats()
    assert 0 < st.spec_accepted_tokens < st.spec_draft_tokens
    alone = [_spec(target, ckpts[0]).generate([p], sp)[0] for p in ps]
    assert alone == batch


def test_bad_draft_settings_are_one_clear_error(tmp_path, target):
    with pytest.raises(EngineConfigError, match="speculative_model: needs num_speculative"):
        EngineConfig(speculative_model="somewhere", num_speculative_tokens=0)
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    tf.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=r"vocab_size is 300, the target's 256"):
        _spec(target, tmp_path)
    missing = tmp_path / "missing"
    with pytest.raises(CheckpointError, match=rf"^speculative_model {missing}: "):
        _spec(target, missing)


# ----- rejection sampling ------------------------------------------------------------------


def _freqs(draws: list[int], n: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(draws), minlength=n).double() / len(draws)


@pytest.mark.parametrize("top_k", [0, 3])
def test_rejection_sampling_preserves_the_target_distribution(top_k):
    """Drafts [d0, d1] against fixed logits: the first emitted token is distributed as p0,
    and (first = d0, second = x) as p0(d0) * p1(x), within 5 standard errors over 20k runs."""
    g = torch.Generator().manual_seed(1)
    vocab, n = 6, 20_000
    logits = torch.randn(3, vocab, generator=g) * 1.5
    sp = SamplingParams(temperature=0.9, top_k=top_k)
    p = filtered_probs(logits, sp).double()
    p = p / p.sum(dim=-1, keepdim=True)
    d0, d1 = int(p[0].argsort()[-2]), int(p[1].argsort()[-1])  # a likely, not surest, d0
    sampler = Sampler(generator=torch.Generator().manual_seed(2))
    row = SampleRow(sp, [1, 2, 3], 3)
    outs = [sampler.verify(logits, [d0, d1], row) for _ in range(n)]
    first = _freqs([o[0] for o in outs], vocab)
    tol = 5 * (p[0] * (1 - p[0]) / n).sqrt() + 1e-4
    assert ((first - p[0]).abs() <= tol).all(), (first, p[0])
    second = _freqs([o[1] if o[0] == d0 else vocab for o in outs], vocab + 1)[:vocab]
    want = p[0, d0] * p[1]
    tol = 5 * (want * (1 - want) / n).sqrt() + 1e-4
    assert ((second - want).abs() <= tol).all(), (second, want)
    # every run emits accepted drafts then one token of its own
    assert all(1 <= len(o) <= 3 for o in outs)
    assert any(len(o) == 3 for o in outs) and any(len(o) == 1 for o in outs)


def test_speculation_pauses_while_drafts_are_refused(ckpts, target):
    """A draft that never agrees (the Llama draft) pauses each sequence's speculation with a
    growing backoff: far fewer drafts, the same greedy output; with a threshold of 0 it drafts
    every step; the self-draft (always accepted) never pauses."""
    ps = prompts(15, [7, 12])
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = LLMEngine(target, EngineConfig(**CFG)).generate(ps, sp)
    always = _spec(target, ckpts[1], spec_min_acceptance=0.0)
    paused = _spec(target, ckpts[1])  # the default threshold, 0.1
    assert always.generate(ps, sp) == ref == paused.generate(ps, sp)
    a, p = always.stats(), paused.stats()
    assert a.spec_paused_steps == 0 and p.spec_paused_steps > 40
    assert p.spec_draft_tokens < a.spec_draft_tokens / 3
    own = _spec(target, ckpts[0])
    assert own.generate(ps, sp) == ref and own.stats().spec_paused_steps == 0
