import torch

from shared.engine.engine import LLMEngine
from shared.engine.params import EngineConfig, SamplingParams
from shared.model.loader import load_model
from tests.engine.conftest import prompts

CFG = dict(kv_cache_bytes=1 << 20, block_size=4, max_num_batched_tokens=64, max_num_seqs=8)
SP = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _prefill(a: LLMEngine, rid, prompt):
    a.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=1), hold_kv=True)
    outs = []
    while a.has_unfinished_requests():
        outs += a.step()
    [o] = outs
    assert o.finished and o.finish_reason == "length"
    blocks, n = a.request_blocks(rid)
    assert n == len(prompt)
    kv = a.read_kv(blocks)  # [L, 2, nb, bs, kvh, hd]
    L, _, nb, bs, h, d = kv.shape
    flat = kv.reshape(L, 2, nb * bs, h, d)[:, :, :n]
    return o.new_token_ids[0], flat, kv


def _decode(b: LLMEngine, rid):
    toks = []
    while b.has_unfinished_requests():
        toks += sum((o.new_token_ids for o in b.step() if o.request_id == rid), [])
    return toks


def test_prefill_on_a_decode_on_b_equals_single_engine(qwen_ckpt):
    _, path = qwen_ckpt
    model = load_model(path)
    [p] = prompts(9, [14])
    want = LLMEngine(model, EngineConfig(**CFG)).generate([p], SP)[0]
    a = LLMEngine(model, EngineConfig(**CFG))
    b = LLMEngine(model, EngineConfig(**CFG))
    first, flat, kv = _prefill(a, "r", p)
    assert first == want[0]
    held = a.bm.num_free_blocks
    a.release("r")
    assert a.bm.num_free_blocks == held + 4  # 14 tokens in 4 blocks
    # whole-request variant
    b.add_prefilled_request("r", p, first, SP, flat)
    assert [first] + _decode(b, "r") == want
    # layer-wise variant with a prefix hit on B (its 3 full blocks are cached now)
    base = b.bm.num_free_blocks
    slots = b.reserve_prefilled("r2", len(p), p)
    assert slots.shape == (14,) and b.reserved["r2"].num_cached == 12
    for layer in range(flat.shape[0]):
        b.write_prefilled_layer("r2", layer, flat[layer, 0], flat[layer, 1])
    b.commit_prefilled("r2", p, first, SP)
    assert [first] + _decode(b, "r2") == want
    assert b.bm.num_free_blocks == base
    # cancel frees a partial reservation
    b.reserve_prefilled("r3", 30)
    b.write_prefilled_layer("r3", 0, torch.zeros(30, 2, 16), torch.zeros(30, 2, 16))
    b.cancel_prefilled("r3")
    assert b.bm.num_free_blocks == base


def test_pool_hooks_match_insert_and_evicted(qwen_ckpt):
    _, path = qwen_ckpt
    model = load_model(path)
    [p] = prompts(10, [17])
    a = LLMEngine(model, EngineConfig(**CFG))
    _, _, kv = _prefill(a, "x", p)
    hashes = a.block_hashes_for(p)
    assert len(hashes) == 4 and a.match_prefix(p) == 16
    ev = a.drain_kv_events()
    assert [e.kind for e in ev] == ["stored"] and ev[0].hashes == hashes
    # B loads the pool blocks and gets a prefix hit equal to single-engine output
    cfg = {**CFG, "kv_cache_bytes": 40 * 2048}  # 40 blocks
    b = LLMEngine(model, EngineConfig(**cfg, collect_evicted_kv=True))
    assert b.match_prefix(p) == 0
    assert b.insert_cached_blocks(hashes, kv[:, :, :4]) == 4
    assert b.match_prefix(p) == 16
    b.add_request("y", p, SP)
    outs = []
    while b.has_unfinished_requests():
        outs += b.step()
    assert outs[0].num_cached_tokens == 16
    want = LLMEngine(model, EngineConfig(**CFG)).generate([p], SP)[0]
    assert sum((o.new_token_ids for o in outs), []) == want
    # fill B so the cached blocks get evicted; their bytes come out intact
    b.generate(prompts(11, [159]), SamplingParams(temperature=0, max_tokens=1))
    ev = dict(b.drain_evicted_kv())
    assert len(ev) == 6  # 4 inserted + 2 more full blocks of request y
    assert hashes[0] in ev
    assert torch.equal(ev[hashes[0]], kv[:, :, 0])


class CharTok:
    """Each id decodes to one letter; enough for IncrementalDetokenizer."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_stop_strings_trimmed_and_text_deltas(qwen_ckpt):
    _, path = qwen_ckpt
    model = load_model(path)
    [p] = prompts(12, [9])
    free = LLMEngine(model, EngineConfig(**CFG)).generate([p], SP)[0]
    text = CharTok().decode(free)
    stop = text[4:6]
    cut = text.find(stop)
    eng = LLMEngine(model, EngineConfig(**CFG), tokenizer=CharTok())
    sp = SP.model_copy(update={"stop": [stop, "never-there"]})
    eng.add_request("s", p, sp)
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert "".join(o.text_delta for o in outs) == text[:cut]
    assert outs[-1].finish_reason == "stop" and outs[-1].finished
    got = sum((o.new_token_ids for o in outs), [])
    assert got == free[: cut + len(stop)]
    eng.add_request("plain", p, SP)
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert "".join(o.text_delta for o in outs) == text and len(outs) == 10


def test_abort_frees_blocks_and_reports(qwen_ckpt):
    _, path = qwen_ckpt
    eng = LLMEngine(load_model(path), EngineConfig(**CFG))
    eng.add_request("a", prompts(13, [20])[0], SP)
    eng.step()
    assert eng.bm.num_free_blocks < eng.bm.num_blocks
    eng.abort_request("a")
    assert eng.bm.num_free_blocks == eng.bm.num_blocks
    [o] = eng.step()
    assert o.finished and o.finish_reason == "abort" and not eng.has_unfinished_requests()
