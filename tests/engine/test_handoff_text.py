"""Prefill -> decode hand-off text: the streamed text equals ``tokenizer.decode(all ids)``.

The prefill stage runs a request to its first token (``max_tokens=1``), so the engine ends it
there and flushes what the detokenizer held back. When the first token is the lead byte of a
multi-byte character that flush is a U+FFFD; decode completes the character later, so the
client saw an extra leading U+FFFD. Prefill now publishes `RequestOutput.handoff_text`.
"""

from __future__ import annotations

from shared.engine.engine import LLMEngine
from shared.engine.params import EngineConfig
from shared.model.loader import load_model
from shared.protocol.sampling import SamplingParams
from tests.engine.conftest import prompts
from tests.engine.handoff import hand_over

CFG = dict(kv_cache_bytes=1 << 20, block_size=4, max_num_batched_tokens=64, max_num_seqs=8)
N = 6


class ByteTok:
    """Ids decode to fixed bytes (UTF-8 with replacement), like a byte-level BPE."""

    def __init__(self, pieces: dict[int, bytes]):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        raw = b"".join(self.pieces.get(i, bytes([97 + i % 26])) for i in ids)
        return raw.decode("utf-8", errors="replace")


def _run(eng: LLMEngine) -> list:
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    return outs


def _disaggregated(model, tok, prompt, sp) -> tuple[str, str]:
    """(text prefill publishes when decode continues, text decode streams after it)."""
    a = LLMEngine(model, EngineConfig(**CFG), tokenizer=tok)
    a.add_request("r", prompt, sp.model_copy(update={"max_tokens": 1}), hold_kv=True)
    [first] = _run(a)
    b = LLMEngine(model, EngineConfig(**CFG), tokenizer=tok)
    hand_over(a, b, "r", prompt, first.new_token_ids[0], sp)
    return first.handoff_text, "".join(o.text_delta for o in _run(b))


def test_first_token_mid_character_has_no_extra_replacement_char(qwen_ckpt):
    _, path = qwen_ckpt
    model = load_model(path)
    [p] = prompts(21, [11])
    sp = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    ids = LLMEngine(model, EngineConfig(**CFG)).generate([p], sp)[0]
    assert ids[0] != ids[1]  # the byte pieces below need two different ids
    tok = ByteTok({ids[0]: b"\xe4", ids[1]: b"\xb8\xad"})  # "中" split over the first two
    want = tok.decode(ids)
    assert want.startswith("中") and "\ufffd" not in want
    # one engine: the deltas add up to decode(all ids)
    eng = LLMEngine(model, EngineConfig(**CFG), tokenizer=tok)
    eng.add_request("one", p, sp)
    assert "".join(o.text_delta for o in _run(eng)) == want
    # prefill -> decode: the first chunk shows nothing yet, decode emits the whole character
    shown, rest = _disaggregated(model, tok, p, sp)
    assert (shown, shown + rest) == ("", want)
    # a request that really ends at its first token still gets the flushed byte
    eng.add_request("short", p, sp.model_copy(update={"max_tokens": 1}))
    [o] = _run(eng)
    assert (o.text_delta, o.held_text) == ("\ufffd", "\ufffd") == (tok.decode(ids[:1]),) * 2


def test_stop_string_hold_is_not_sent_twice(qwen_ckpt):
    _, path = qwen_ckpt
    model = load_model(path)
    [p] = prompts(22, [9])
    sp = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, stop=["never-seen"])
    tok = ByteTok({})
    ids = LLMEngine(model, EngineConfig(**CFG)).generate([p], sp)[0]
    want = tok.decode(ids)
    # the first token's text is held back (it could start a stop string) and flushed at the
    # prefill stage's end; decode holds the same text and emits it with what follows
    shown, rest = _disaggregated(model, tok, p, sp)
    assert (shown, shown + rest) == ("", want)
