"""Structured outputs in the engine (oracle-style: a random-weight model cannot produce valid
JSON by chance, so validity proves the grammar constrained it): the bitmask in the sampler for
the constrained rows only, mixed batches, the matcher rebuilt by replay at a prefill hand-off
and on a failover resume (same tokens as one uninterrupted run), the grammar cache and its
limits, "length" vs "stop", the prefix cache, speculation off, logit_bias."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest
import torch

from shared.engine.engine import LLMEngine
from shared.engine.params import EngineConfig
from shared.engine.sampler import Sampler, SampleRow
from shared.engine.structured import (
    GrammarCache,
    GrammarError,
    GrammarLimits,
    allocate_bitmask,
    apply_bitmask,
    tokenizer_info,
)
from shared.model.loader import load_model
from shared.model.tokenizer import Tokenizer
from shared.protocol.sampling import SamplingParams, StructuredSpec

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
        "tag": {"type": "string", "maxLength": 4},
    },
    "required": ["ok", "n", "color", "tag"],
}
SPEC = StructuredSpec(kind="json_schema", spec=json.dumps(SCHEMA))
CFG = dict(kv_cache_bytes=16 << 20, block_size=16)


@pytest.fixture(scope="module")
def model_dir():
    from services.cluster_config import ensure_model

    torch.set_num_threads(1)
    return ensure_model("")


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load_model(model_dir)


def _engine(loaded, tok, **kw) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig(**{**CFG, **kw}), tokenizer=tok)


def _prompt(tok, text="Give me a record.") -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def _sp(seed, **kw) -> SamplingParams:
    kw = {"max_tokens": 64, "temperature": 0.8, "seed": seed, "structured": SPEC, **kw}
    return SamplingParams(**kw)


def _run(engine: LLMEngine, reqs: dict[str, tuple[list[int], SamplingParams]], **add):
    for rid, (p, sp) in reqs.items():
        engine.add_request(rid, p, sp, **add.get(rid, {}))
    toks = {rid: [] for rid in reqs}
    reasons = {}
    with torch.inference_mode():
        while engine.has_unfinished_requests():
            for o in engine.step():
                toks[o.request_id] += o.new_token_ids
                if o.finished:
                    reasons[o.request_id] = o.finish_reason
    return toks, reasons


def test_apply_bitmask_masks_only_the_listed_rows():
    logits = torch.zeros(3, 70)
    bm = allocate_bitmask(1, 70)
    bm.zero_()
    bm[0, 0] = 0b1010  # tokens 1 and 3 allowed
    apply_bitmask(logits, bm, [1])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [1, 3]
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()


def test_sampler_constrains_masked_rows_and_leaves_free_rows_alone():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 70, generator=g)
    sp = SamplingParams(temperature=0.8, seed=7)
    rows = [SampleRow(sp, [1, 2, 3], 3), SampleRow(sp, [1, 2, 3], 3)]
    free = Sampler()(logits, rows).token_ids
    bm = allocate_bitmask(1, 70)
    bm.zero_()
    bm[0, 1] = 1 << 9  # only token 41
    got = Sampler()(logits, rows, bm, [1]).token_ids
    assert got == [free[0], 41]


def test_json_schema_outputs_validate_in_a_mixed_batch(loaded, tok):
    e = _engine(loaded, tok)
    p = _prompt(tok)
    reqs = {f"s{i}": (p, _sp(i)) for i in range(4)}
    reqs["free"] = (p, SamplingParams(max_tokens=24, temperature=0.8, seed=1))
    toks, reasons = _run(e, reqs)
    for i in range(4):
        assert reasons[f"s{i}"] == "stop"
        jsonschema.validate(json.loads(tok.decode(toks[f"s{i}"])), SCHEMA)
    alone, _ = _run(_engine(loaded, tok), {"free": reqs["free"]})
    assert toks["free"] == alone["free"]  # the free row is untouched by its neighbours' masks
    with pytest.raises(ValueError):
        json.loads(tok.decode(toks["free"]))  # unconstrained output of this model is not JSON


def test_other_kinds_regex_choice_json_object(loaded, tok):
    e = _engine(loaded, tok)
    p = _prompt(tok)
    specs = {
        "regex": StructuredSpec(kind="regex", spec=r"[0-9]{3}-[a-z]{2}"),
        "choice": StructuredSpec(kind="choice", spec=json.dumps(["yes", "no", "maybe"])),
        "obj": StructuredSpec(kind="json"),
    }
    toks, reasons = _run(
        e, {k: (p, _sp(5, structured=s, max_tokens=200)) for k, s in specs.items()}
    )
    import re

    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", tok.decode(toks["regex"]))
    assert tok.decode(toks["choice"]) in ("yes", "no", "maybe")
    if reasons["obj"] == "stop":
        assert isinstance(json.loads(tok.decode(toks["obj"])), dict)
    else:  # a free object may not close within max_tokens: then "length", never "stop"
        assert reasons["obj"] == "length" and tok.decode(toks["obj"]).startswith("{")


def test_schema_cut_by_max_tokens_finishes_with_length(loaded, tok):
    toks, reasons = _run(_engine(loaded, tok), {"r": (_prompt(tok), _sp(2, max_tokens=5))})
    assert reasons["r"] == "length" and len(toks["r"]) == 5
    with pytest.raises(ValueError):
        json.loads(tok.decode(toks["r"]))


def test_prefill_handoff_replays_the_first_token(loaded, tok):
    """Prefill samples token one (max_tokens=1), decode gets it as an emitted output and
    rebuilds the matcher by replay: the tokens equal one uninterrupted run."""
    p = _prompt(tok)
    want, _ = _run(_engine(loaded, tok), {"r": (p, _sp(11))})
    first, _ = _run(_engine(loaded, tok), {"r": (p, _sp(11, max_tokens=1))})
    assert first["r"] == want["r"][:1]
    rest, reasons = _run(
        _engine(loaded, tok), {"r": (p, _sp(11))}, r={"output_token_ids": first["r"]}
    )
    assert first["r"] + rest["r"] == want["r"] and reasons["r"] == "stop"
    jsonschema.validate(json.loads(tok.decode(want["r"])), SCHEMA)


@pytest.mark.parametrize("sent", [3, 9])
def test_failover_resume_replays_sent_tokens(loaded, tok, sent):
    p = _prompt(tok)
    want, _ = _run(_engine(loaded, tok), {"r": (p, _sp(4))})
    got = want["r"][:sent]
    # prefill / recompute path: the sent tokens come as output_token_ids
    rest, _ = _run(_engine(loaded, tok), {"r": (p, _sp(4))}, r={"output_token_ids": got})
    assert got + rest["r"] == want["r"]
    # decode's pushed-KV path: prompt + sent tokens as the prompt, params.resumed(sent)
    sp = _sp(4).resumed(sent)
    assert sp.structured.resumed_tokens == sent and sp.max_tokens == 64 - sent
    rest, _ = _run(_engine(loaded, tok), {"r": (p + got, sp)})
    assert got + rest["r"] == want["r"]
    # without the replay the matcher would start at the schema's root: the output differs
    blind = sp.model_copy(update={"structured": SPEC})
    other, _ = _run(_engine(loaded, tok), {"r": (p + got, blind)})
    assert got + other["r"] != want["r"]


def test_prefix_cache_hit_gives_the_same_structured_output(loaded, tok):
    e = _engine(loaded, tok)
    p = _prompt(tok, "A long enough prompt to fill a few blocks of the prefix cache, please.")
    first, _ = _run(e, {"a": (p, _sp(8))})
    hits = e.scheduler.prefix_hit_tokens
    second, _ = _run(e, {"b": (p, _sp(8))})
    assert e.scheduler.prefix_hit_tokens - hits >= 16  # the prompt's full blocks were reused
    assert first["a"] == second["b"]


class _Script:
    """Proposes the reference continuation of each request (``refs[request_id]``), with the
    draft at index ``bad_at`` replaced by ``bad`` (a token the grammar refuses there)."""

    def __init__(self, refs: dict[str, list[int]], k: int, bad_at: int | None = None, bad=0):
        self.refs, self.k, self.bad_at, self.bad = refs, k, bad_at, bad

    def propose(self, seq) -> list[int]:
        ref = self.refs[seq.request_id]
        done = seq.num_output_tokens
        d = list(ref[done : done + self.k])
        if self.bad_at is not None and self.bad_at < len(d):
            d[self.bad_at] = self.bad
        return d


def test_constrained_greedy_requests_speculate_within_the_grammar(loaded, tok):
    """Drafts are cut at the first token the grammar refuses and verified under the grammar's
    mask at each position: the output equals the plain run's, and only the valid prefix of
    each proposal counts as drafted."""
    p = _prompt(tok)
    greedy = _sp(None, temperature=0.0)
    ref, _ = _run(_engine(loaded, tok), {"r": (p, greedy)})
    # a token the grammar never allows after '{"': a second '{'
    brace = tok.encode("{")[-1]
    for bad_at, per_step in ((None, 3), (1, 1)):
        e = LLMEngine(
            loaded,
            EngineConfig(**CFG, num_speculative_tokens=3),
            tokenizer=tok,
            proposer=_Script(ref, 3, bad_at, brace),
        )
        toks, reasons = _run(e, {"r": (p, greedy)})
        assert toks["r"] == ref["r"] and reasons["r"] == "stop"
        jsonschema.validate(json.loads(tok.decode(toks["r"])), SCHEMA)
        st = e.stats()
        assert st.spec_draft_tokens > 0 and st.spec_accepted_tokens == st.spec_draft_tokens
        # each verify step emits its drafts + 1: with the cut, at most 2 tokens per step
        assert st.spec_draft_tokens <= per_step * (len(ref["r"]) - 1)
        if bad_at == 1:
            assert st.spec_draft_tokens <= (len(ref["r"]) - 1) // 2 + 1


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_constrained_sampled_requests_speculate_and_stay_in_the_grammar(loaded, tok, seed):
    """Sampled structured requests with drafts (rejection sampling under the grammar's mask):
    every output is valid, the drafts were verified (some accepted, some refused), and the
    matcher never refused a token."""
    p = _prompt(tok)
    ref, _ = _run(_engine(loaded, tok), {"r": (p, _sp(None, temperature=0.0))})
    e = LLMEngine(
        loaded,
        EngineConfig(**CFG, num_speculative_tokens=3),
        tokenizer=tok,
        proposer=_Script(ref, 3),
    )
    e.add_request("r", p, _sp(seed, temperature=1.0))
    seq = e.seqs["r"]
    with torch.inference_mode():
        while e.has_unfinished_requests():
            e.step()
    st = e.stats()
    assert st.spec_draft_tokens > 0
    assert seq.constraint.rejected == 0
    out = seq.token_ids[seq.num_prompt_tokens :]
    if seq.finish_reason == "stop":
        jsonschema.validate(json.loads(tok.decode(out)), SCHEMA)


def test_speculation_on_free_requests_beside_constrained_ones(loaded, tok):
    e = _engine(loaded, tok, num_speculative_tokens=3)
    p = _prompt(tok)
    greedy = _sp(None, temperature=0.0)
    toks, _ = _run(
        e, {"r": (p, greedy), "f": (p * 3, SamplingParams(max_tokens=24, temperature=0.0))}
    )
    jsonschema.validate(json.loads(tok.decode(toks["r"])), SCHEMA)
    ref, _ = _run(_engine(loaded, tok), {"r": (p, greedy)})
    assert toks["r"] == ref["r"]
    assert e.stats().spec_draft_tokens > 0  # n-gram drafts for the free request at least


def test_logit_bias_steers_greedy(loaded, tok):
    p = _prompt(tok)
    sp = SamplingParams(max_tokens=3, temperature=0.0, logit_bias={500: 100.0}, ignore_eos=True)
    toks, _ = _run(_engine(loaded, tok), {"r": (p, sp)})
    assert toks["r"] == [500, 500, 500]


def test_grammar_cache_compiles_once_and_evicts_lru(tok):
    cache = GrammarCache(tokenizer_info(tok, 2240, [2]), GrammarLimits(cache_entries=2))
    a, b, c = (StructuredSpec(kind="regex", spec=s) for s in ("a+", "b+", "c+"))
    first = cache.get(a)
    assert cache.get(a) is first and (cache.hits, cache.misses) == (1, 1)
    # resumed_tokens is not part of the key
    assert cache.get(a.model_copy(update={"resumed_tokens": 3})) is first
    cache.get(b)
    cache.get(c)  # evicts a (least recently used)
    assert len(cache) == 2
    cache.get(a)
    assert cache.misses == 4


def test_grammar_limits_and_bad_specs_name_the_problem(tok):
    info = tokenizer_info(tok, 2240, [2])
    small = GrammarCache(info, GrammarLimits(max_spec_bytes=100))
    big = StructuredSpec(kind="json_schema", spec=json.dumps({"enum": ["x" * 200]}))
    with pytest.raises(GrammarError, match="limit is 100"):
        small.get(big)
    slow = GrammarCache(info, GrammarLimits(compile_timeout_s=0.05))
    real_compile = slow._compile
    slow._compile = lambda spec: (time.sleep(0.5), real_compile(spec))[1]  # a slow grammar
    with pytest.raises(GrammarError, match="took longer than 0.05 s"):
        slow.get(SPEC)
    cache = GrammarCache(info)
    with pytest.raises(GrammarError, match="not valid JSON"):
        cache.get(StructuredSpec(kind="json_schema", spec="{nope"))
    with pytest.raises(GrammarError, match="invalid regex"):
        cache.get(StructuredSpec(kind="regex", spec="(unclosed"))
    with pytest.raises(GrammarError, match="choice"):
        cache.get(StructuredSpec(kind="choice", spec="[]"))


def test_engine_refuses_a_bad_constraint_at_submit(loaded, tok):
    e = _engine(loaded, tok)
    with pytest.raises(ValueError, match="invalid regex"):
        e.add_request("r", _prompt(tok), _sp(1, structured=StructuredSpec(kind="regex", spec="(")))
    assert "r" not in e.seqs


def test_length_bounded_strings_refuse_raw_control_characters(tok):
    """xgrammar 0.2.8 writes maxLength strings without JSON's control-character ban; the
    grammar is patched (`structured._JSON_CHARS`), or this model emits invalid JSON."""
    import xgrammar as xgr

    cache = GrammarCache(tokenizer_info(tok, 2240, [2]))
    spec = StructuredSpec(kind="json_schema", spec=json.dumps({"type": "string", "maxLength": 4}))
    assert not xgr.GrammarMatcher(cache.get(spec)).accept_string('"\x1e')
    assert xgr.GrammarMatcher(cache.get(spec)).accept_string('"ab"')


def _walk(cache: GrammarCache, spec: StructuredSpec, tok, text: str) -> tuple[bool, bool]:
    """(every token of ``text`` accepted, the grammar can end there)."""
    from shared.engine.structured import Constraint

    c = Constraint(cache.get(spec))
    ok = all(c.accept(t) for t in tok.encode(text))
    return ok, ok and c.matcher.is_terminated() or ok and c.matcher.accept_token(2)


def test_a_thinking_block_before_the_constrained_answer(tok):
    """`StructuredSpec.think` (the gateway's reasoning parser on): the answer's grammar holds
    after an optional ``<think>`` block, or after the block the template opened; the block ends
    at its first ``</think>`` (text with tag-like pieces in it is reasoning), and a bad answer
    after it is refused. Without it, a thinking block is not valid JSON."""
    cache = GrammarCache(tokenizer_info(tok, 2240, [2]))
    answer = '{"ok": true, "n": 3, "color": "red", "tag": "ab"}'
    opt = SPEC.model_copy(update={"think": "optional"})
    opened = SPEC.model_copy(update={"think": "open"})
    body = "plan: a < b, </ and </thin are not the end"
    assert _walk(cache, opt, tok, answer) == (True, True)
    assert _walk(cache, opt, tok, f"<think>{body}</think>\n\n{answer}") == (True, True)
    assert not _walk(cache, opt, tok, f"<think>{body}</think>not json")[0]
    assert not _walk(cache, opt, tok, f"<think>a</think>{answer}</think>")[0]
    assert _walk(cache, opened, tok, f"{body}</think>\n{answer}") == (True, True)
    assert _walk(cache, opened, tok, answer) == (True, False)  # still inside the block
    assert not _walk(cache, SPEC, tok, f"<think>{body}</think>{answer}")[0]
    assert cache.get(opt) is not cache.get(SPEC)  # the block is part of the cache key
