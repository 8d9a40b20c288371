"""Speculative decoding when drafts are accepted: output equals plain greedy, accepted draft
tokens land in full blocks that are committed to the prefix cache, and the counters add up."""

from shared.engine.engine import LLMEngine
from shared.engine.params import EngineConfig
from shared.model.loader import load_model
from shared.protocol.sampling import SamplingParams
from tests.engine.conftest import prompts

CFG = dict(kv_cache_bytes=1 << 20, block_size=4, max_num_batched_tokens=64, max_num_seqs=8)


class Oracle:
    """Drafts the known greedy continuation; ``wrong_at`` corrupts that draft index."""

    def __init__(self, refs: dict, k: int, wrong_at: int | None = None):
        self.refs, self.k, self.wrong_at = refs, k, wrong_at

    def propose(self, seq) -> list[int]:
        ref = self.refs[tuple(seq.token_ids[: seq.num_prompt_tokens])]
        done = seq.num_tokens - seq.num_prompt_tokens
        d = ref[done : done + self.k]
        if self.wrong_at is not None and self.wrong_at < len(d):
            d[self.wrong_at] = (d[self.wrong_at] + 1) % 200
        return d


def test_accepted_drafts_equal_greedy_and_commit_blocks(qwen_ckpt):
    _, path = qwen_ckpt
    lm = load_model(path)
    ps = prompts(11, [5, 9, 14])
    sp = SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)
    ref = LLMEngine(lm, EngineConfig(**CFG)).generate(ps, sp)
    table = {tuple(p): r for p, r in zip(ps, ref, strict=True)}
    for wrong_at in (None, 1):
        eng = LLMEngine(
            lm, EngineConfig(**CFG, num_speculative_tokens=3), proposer=Oracle(table, 3, wrong_at)
        )
        assert eng.generate(ps, sp) == ref
        st = eng.stats()
        # Known counts: prefill gives token 1 of 13; each verify step then adds its accepted
        # drafts plus the bonus token. All right: 3 steps of 3 drafts (1+4+4+4 = 13). Wrong at
        # index 1: 6 steps accepting 1 draft each (1+2*6 = 13); the last proposes 2 drafts, as the
        # oracle has only 2 tokens left (3 * 5 + 2 = 17 drafts).
        want_accepted, want_drafts = (9, 9) if wrong_at is None else (6, 17)
        assert (st.spec_accepted_tokens, st.spec_draft_tokens) == (
            len(ps) * want_accepted,
            len(ps) * want_drafts,
        ), st
        # a rerun of prompt + output hits the blocks written by accepted drafts
        full = ps[2] + ref[2]
        eng.generate([full], SamplingParams(temperature=0, max_tokens=1))
        assert eng.stats().prefix_hit_tokens >= (len(full) - 1) // 4 * 4
