"""vLLM's allowed_token_ids, bad_words and include_stop_str_in_output in the sampler, the text
tracker and the engine, at toy size with exact assertions."""

from __future__ import annotations

import torch

from shared.engine.detok import TextTracker
from shared.engine.engine import LLMEngine
from shared.engine.params import EngineConfig
from shared.engine.sampler import Sampler, SampleRow, adjust_logits, bad_word_bans
from shared.engine.sequence import Sequence
from shared.engine.spec_decode import eligible
from shared.model.loader import load_model
from shared.protocol.sampling import SamplingParams
from tests.engine.conftest import prompts

INF = float("-inf")
LOGITS = torch.tensor([[0.0, 5.0, 4.5, 10.0, -1.0]])


def _row(outs=(), prompt=(0,), **kw) -> SampleRow:
    return SampleRow(SamplingParams(**kw), [*prompt, *outs], len(prompt))


def test_allowed_token_ids_mask_every_other_id():
    got = adjust_logits(LOGITS.repeat(2, 1), [_row(allowed_token_ids=[2, 4]), _row()])
    assert got.tolist() == [[INF, INF, 4.5, INF, -1.0], LOGITS[0].tolist()]
    s = Sampler()
    assert s(LOGITS, [_row(temperature=0, allowed_token_ids=[2, 4])]).token_ids == [2]
    for seed in range(20):  # sampled: never outside the allowed set
        row = _row(temperature=1.5, seed=seed, allowed_token_ids=[0, 4])
        assert s(LOGITS, [row]).token_ids[0] in (0, 4)
    # an id beyond the logits' width is ignored; the rest still apply
    assert adjust_logits(LOGITS, [_row(allowed_token_ids=[1, 99])]).tolist() == [
        [INF, 5.0, INF, INF, INF]
    ]


def test_bad_words_ban_the_last_id_when_the_prefix_matches():
    rows = [
        _row(bad_words_ids=[[3]]),  # one id: always banned
        _row(outs=[4, 2], bad_words_ids=[[2, 3], [4, 1]]),  # outputs end in 2: 3 banned only
        _row(outs=[2, 4], bad_words_ids=[[2, 3]]),  # outputs end in 4: nothing banned
        _row(outs=[], prompt=[2], bad_words_ids=[[2, 3]]),  # the prompt does not count (vLLM)
        _row(outs=[1, 2], bad_words_ids=[[1, 2, 3], [9, 9, 9, 9]]),  # longer than the outputs
    ]
    assert bad_word_bans(rows) == ([0, 1, 4], [3, 3, 3])
    got = adjust_logits(LOGITS.repeat(5, 1), rows)
    want = LOGITS.repeat(5, 1)
    want[[0, 1, 4], 3] = INF
    assert torch.equal(got, want)
    greedy = [
        SampleRow(r.params.model_copy(update={"temperature": 0.0}), r.token_ids, 1) for r in rows
    ]
    assert Sampler()(LOGITS.repeat(5, 1), greedy).token_ids == [1, 1, 3, 3, 1]


def test_bias_and_masks_compose_and_logprobs_stay_the_models():
    row = _row(temperature=0, logit_bias={4: 20.0}, allowed_token_ids=[1, 4], logprobs=0)
    res = Sampler()(LOGITS, [row])
    assert res.token_ids == [4]  # -1 + 20 beats 5 among the allowed
    want = float(torch.log_softmax(LOGITS[0], -1)[4])
    assert res.logprobs[0] == {4: want}


def test_masked_requests_do_not_speculate():
    for kw in ({"allowed_token_ids": [1]}, {"bad_words_ids": [[1]]}, {"logit_bias": {1: 1.0}}):
        seq = Sequence("r", [1, 2], 2, SamplingParams(temperature=0, **kw))
        assert not eligible(seq), kw
    assert eligible(Sequence("r", [1, 2], 2, SamplingParams(temperature=0)))


class _CharDetok:
    """One character per token id (``chr(id)``)."""

    def add(self, token_id: int) -> str:
        return chr(token_id)


def _feed(text: str, stop: list[str], include: bool) -> tuple[str, bool]:
    t = TextTracker(_CharDetok(), stop, include_stop=include)
    out = ""
    for ch in text:
        delta, hit = t.add(ord(ch))
        out += delta
        if hit:
            return out, True
    return out + t.flush(), False


def test_include_stop_str_in_output_keeps_exactly_the_stop_string():
    assert _feed("hello END more", ["END"], False) == ("hello ", True)
    assert _feed("hello END more", ["END"], True) == ("hello END", True)
    # the earliest stop wins; its own text is what is kept
    assert _feed("a.b!c", ["!", "."], True) == ("a.", True)
    assert _feed("no stop here", ["END"], True) == ("no stop here", False)


def test_engine_allowed_and_bad_words_change_greedy_tokens(qwen_ckpt):
    _, path = qwen_ckpt
    eng = LLMEngine(load_model(path), EngineConfig(kv_cache_bytes=1 << 20, block_size=4))
    [p] = prompts(3, [9])
    base = dict(temperature=0, max_tokens=6, ignore_eos=True)
    free = eng.generate([p], SamplingParams(**base))[0]
    x = (free[0] + 17) % 250
    only = eng.generate([p], SamplingParams(**base, allowed_token_ids=[x]))[0]
    assert only == [x] * 6
    banned = eng.generate([p], SamplingParams(**base, bad_words_ids=[[free[0]]]))[0]
    assert free[0] not in banned and banned[0] != free[0]
    # a two-token bad word: its last token is avoided right after its first
    pair = eng.generate([p], SamplingParams(**base, bad_words_ids=[[free[0], free[1]]]))[0]
    assert pair[0] == free[0] and pair[1] != free[1]


class _PairTok:
    """Each id decodes to two letters, so a stop string can sit inside one token."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) + chr(97 + (i // 26) % 26) for i in ids)


def test_a_stop_string_in_the_last_allowed_token_finishes_with_stop(qwen_ckpt):
    """A stop string inside the token that also reaches max_tokens (a prefill instance runs
    max_tokens=1): the text is cut and the reason is "stop", so decode does not go on."""
    _, path = qwen_ckpt
    eng = LLMEngine(load_model(path), EngineConfig(kv_cache_bytes=1 << 20), tokenizer=_PairTok())
    [p] = prompts(4, [9])

    def run_one(**kw):
        eng.add_request("r", p, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, **kw))
        outs = []
        while eng.has_unfinished_requests():
            outs += [o for o in eng.step() if o.request_id == "r"]
        return "".join(o.text_delta for o in outs), outs[-1].finish_reason

    text, reason = run_one()
    assert reason == "length" and len(text) == 6
    stop = text[3:5]  # the second token's last letter and the third's first: complete only
    assert text.find(stop) == 3, f"{stop!r} occurs earlier in {text!r}"  # with the last token
    assert run_one(stop=[stop]) == (text[:3], "stop")
    assert run_one(stop=[stop], include_stop_str_in_output=True) == (text[:5], "stop")
