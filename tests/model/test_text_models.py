"""Strata's Llama/Qwen2/Qwen3/Phi-3/Gemma-2/Gemma-3/Granite/OLMo-2 against transformers on random
tiny checkpoints."""

import pytest
import torch

from shared.model.loader import load_model
from tests.model.paged_driver import PagedDriver

transformers = pytest.importorskip("transformers")

VOCAB = 160
CASES = {
    # Qwen3: q/k norm, GQA 4:2, head_dim 32 != hidden/heads, untied
    "qwen3": dict(
        cls="Qwen3",
        kw=dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=False,
            rope_theta=1e6,
        ),
    ),
    # Qwen2: qkv bias, MQA-ish 4:1, tied embeddings
    "qwen2": dict(
        cls="Qwen2", kw=dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)
    ),
    # Phi-3: q/k/v and gate/up stored fused (qkv_proj, gate_up_proj), split by the loader
    "phi3": dict(
        cls="Phi3",
        kw=dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # Gemma-2: (1 + w) norms (perturbed from 0), sandwich norms, sqrt(hidden) embedding scale,
    # query_pre_attn_scalar, soft-capped scores and logits (caps low enough to bite), tied
    "gemma2": dict(
        cls="Gemma2",
        kw=dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=8.0,
        ),
    ),
    # Gemma-3: (1 + w) per-head q/k norms, a sliding layer on its own RoPE base and a full one
    # with linear scaling, query_pre_attn_scalar, a final logit cap; attn_logit_softcapping set
    # to show it is ignored, as transformers' Gemma-3 attention ignores it
    "gemma3": dict(
        cls="Gemma3",
        config="Gemma3TextConfig",
        kw=dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=0.5,  # would bite hard: scores after q/k norm reach ~1-3
            final_logit_softcapping=8.0,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            },
        ),
        perturb_norms=True,
    ),
    # Granite: all four multipliers off 1 (attention scale 0.09, not 16 ** -0.5), attention and
    # MLP bias (the folded residual multiplier scales them too), tied embeddings
    "granite": dict(
        cls="Granite",
        kw=dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            embedding_multiplier=6.0,
            residual_multiplier=0.3,
            attention_multiplier=0.09,
            logits_scaling=3.0,
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=True,
        ),
        perturb_norms=True,
    ),
    # OLMo-2: post-norms only, q/k norm over all heads (perturbed so k_norm != q_norm), GQA 4:2
    "olmo2": dict(
        cls="Olmo2", kw=dict(num_attention_heads=4, num_key_value_heads=2), perturb_norms=True
    ),
    # Llama 3 style: llama3 rope scaling, attention/mlp bias, MHA, head_dim 8
    "llama3": dict(
        cls="Llama",
        kw=dict(
            num_attention_heads=8,
            num_key_value_heads=8,
            attention_bias=True,
            mlp_bias=True,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
            rope_theta=500000.0,
        ),
    ),
}


def _build(name, path):
    case = CASES[name]
    cfg_cls = getattr(transformers, case.get("config", case["cls"] + "Config"))
    model_cls = getattr(transformers, case["cls"] + "ForCausalLM")
    kw = dict(case["kw"])
    if "rope_theta" in kw or "rope_scaling" in kw:  # 5.x spells rope settings rope_parameters
        rope = dict(kw.pop("rope_scaling", None) or {"rope_type": "default"})
        rope["rope_theta"] = kw.pop("rope_theta", 10000.0)
        kw["rope_parameters"] = rope
    cfg = cfg_cls(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        initializer_range=0.5,
        max_position_embeddings=256,
        **kw,
    )
    torch.manual_seed(0)
    hf = model_cls(cfg).eval()
    if name == "gemma2":  # transformers starts Gemma's norm weights at 0 (scale 1 + 0)
        with torch.no_grad():
            for n, p in hf.named_parameters():
                if "norm" in n:
                    p.normal_(0.0, 0.3)
    elif case.get("perturb_norms"):  # off their start (1, Gemma's 0): a misplaced norm shows
        with torch.no_grad():
            for n, p in hf.named_parameters():
                if "norm" in n:
                    p.add_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = _build(request.param, path)
    return hf, load_model(path), request.param


def hf_greedy(hf, ids, n):
    """Greedy decoding with transformers' own KV cache (no generate() defaults involved)."""
    out, past, inp = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            res = hf(inp, past_key_values=past, use_cache=True)
            past = res.past_key_values
            out.append(int(res.logits[0, -1].argmax()))
            inp = torch.tensor([[out[-1]]])
    return out


def _prompt(n, seed=1):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_config_flags(pair):
    _, ours, name = pair
    c = ours.config
    assert c.qk_norm == (name in ("qwen3", "gemma3", "olmo2"))
    assert c.attention_bias == (name in ("qwen2", "llama3", "granite"))
    assert c.tie_word_embeddings == (name in ("qwen2", "gemma2", "gemma3", "granite"))
    rope = {"llama3": "llama3", "gemma3": "linear"}.get(name)
    assert (c.rope_scaling or {}).get("rope_type") == rope
    if name == "gemma3":  # layer 0 sliding: the local RoPE; no attention cap (see CASES)
        assert c.rope_local == (10000.0, None) and c.sliding_layers == (0,)
        assert c.attn_logit_softcapping is None and c.final_logit_softcapping == 8.0
    if name == "granite":
        assert (c.embedding_multiplier, c.residual_multiplier) == (6.0, 0.3)
        assert (c.attention_multiplier, c.logits_scaling) == (0.09, 3.0)
    assert ours.model.lm_head.weight is not None and isinstance(ours.model.lm_head, torch.nn.Linear)


def test_the_decoder_layer_path_that_runs(pair, monkeypatch):
    """Each decode step runs one native call per layer (`layer.c`) for the Llama-layer families,
    Granite included (its residual multiplier folded into o_proj / down_proj at load); Gemma and
    OLMo-2 layers (sandwich / post norms) say why they run op by op and make no such call."""
    from shared.model import cpu_kernels
    from shared.model.models import llama

    _, ours, name = pair
    if not cpu_kernels.available():
        pytest.skip("no native kernels on this machine")
    monkeypatch.setattr(llama, "NATIVE_LAYER", True)
    drv = PagedDriver(ours.model, block_size=4)
    seq = drv.new_seq()
    drv.prefill(seq, _prompt(9))
    before = cpu_kernels.layer_calls
    for tok in (5, 6, 7):
        drv.step([(seq, [tok])])
    native = name not in ("gemma2", "gemma3", "olmo2")
    assert cpu_kernels.layer_calls - before == (3 * ours.model.num_layers if native else 0)
    for layer in ours.model.model.layers:
        assert (layer.native() is None) == (not native)
        assert (layer.native_reason is None) == native


@pytest.mark.parametrize("block_size", [4, 16])
def test_logits_match(pair, block_size):
    hf, ours, _ = pair
    ids = _prompt(41)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    drv = PagedDriver(ours.model, block_size=block_size)
    got = drv.prefill(drv.new_seq(), ids)
    assert got.dtype == torch.float32
    assert (got - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("block_size,chunk", [(4, 1), (4, 3), (16, 7), (16, 16)])
def test_chunked_prefill_exact_in_fp64(pair, block_size, chunk):
    """Chunking and block boundaries change nothing: checked in float64, where rounding noise
    cannot hide an off-by-one in the causal offset or the block table walk."""
    hf, ours, _ = pair
    ids = _prompt(41)
    hf64 = type(hf)(hf.config).double().eval()
    hf64.load_state_dict(hf.state_dict())
    with torch.no_grad():
        ref = hf64(torch.tensor([ids])).logits[0]
    m64 = load_model(ours.path, dtype=torch.float64).model
    drv = PagedDriver(m64, block_size=block_size)
    hidden = torch.cat(
        [
            drv.step([(seq, ids[s : s + chunk])])[0]
            for seq in [drv.new_seq()]
            for s in range(0, len(ids), chunk)
        ]
    )
    got = m64.lm_head(hidden) / m64.config.logits_scaling  # compute_logits' (Granite), in fp64
    if cap := m64.config.final_logit_softcapping:  # compute_logits' cap, kept in float64
        got = torch.tanh(got / cap) * cap
    # Gemma-2's eager attention takes its softmax in float32 even in a float64 model, so a
    # one-ulp float32 difference of a score (a gemv's rounding vs a gemm's) shows at ~1e-6
    tol = 1e-5 if m64.config.attn_logit_softcapping else 1e-9
    assert (got - ref).abs().max().item() < tol


@pytest.mark.parametrize("block_size,chunk", [(4, 3), (16, 7)])
def test_chunked_prefill_fp32(pair, block_size, chunk):
    """In float32 the chunked path differs from transformers only by rounding: the bound is
    the size of transformers' own fp32 error against float64 on these models (~1.2e-4 with
    std-0.5 weights and logits up to ~16)."""
    hf, ours, _ = pair
    ids = _prompt(41)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    drv = PagedDriver(ours.model, block_size=block_size)
    got = drv.prefill(drv.new_seq(), ids, chunk=chunk)
    assert (got - ref).abs().max().item() < 5e-4


def test_greedy_32_tokens_identical(pair):
    hf, ours, _ = pair
    ids = _prompt(9, seed=3)
    ref = hf_greedy(hf, ids, 32)
    assert PagedDriver(ours.model, block_size=4).greedy(ids, 32) == ref
    assert PagedDriver(ours.model, block_size=16).greedy(ids, 32, chunk=4) == ref


def test_mixed_batch_matches_single_sequences(pair):
    """One step holding a fresh prefill, a chunk over cached context and two decodes."""
    _, ours, _ = pair
    drv = PagedDriver(ours.model, block_size=4)
    a, b, c, d = (drv.new_seq() for _ in range(4))
    pa, pb, pc, pd = _prompt(10, 1), _prompt(13, 2), _prompt(6, 3), _prompt(5, 4)
    drv.prefill(b, pb[:8])
    drv.prefill(c, pc)
    drv.prefill(d, pd)
    calls = []
    hidden, logits = drv.step(
        [(a, pa), (b, pb[8:]), (c, [7]), (d, [9])], layer_callback=calls.append
    )
    assert calls == list(range(ours.model.num_layers))
    for k, (toks, row) in enumerate([(pa, 0), (pb, 1), (pc + [7], 2), (pd + [9], 3)]):
        solo = PagedDriver(ours.model, block_size=16)
        ref = solo.prefill(solo.new_seq(), toks)[-1]
        assert (logits[row] - ref).abs().max().item() < 1e-4, k
    # pure decode batch (the batched fast path) for three sequences at once
    _, logits2 = drv.step([(b, [1]), (c, [2]), (d, [3])])
    for toks, row in [(pb + [1], 0), (pc + [7, 2], 1), (pd + [9, 3], 2)]:
        solo = PagedDriver(ours.model, block_size=16)
        assert (logits2[row] - solo.prefill(solo.new_seq(), toks)[-1]).abs().max() < 1e-4
    # uniform fresh prefill batch (one batched SDPA call)
    e, f = drv.new_seq(), drv.new_seq()
    _, logits3 = drv.step([(e, pa), (f, pa[::-1])])
    solo = PagedDriver(ours.model, block_size=16)
    assert (logits3[1] - solo.prefill(solo.new_seq(), pa[::-1])[-1]).abs().max() < 1e-4
    # decodes of equal context length (the one-call batched decode path)
    _, logits4 = drv.step([(e, [4]), (f, [5])])
    for toks, row in [(pa + [4], 0), (pa[::-1] + [5], 1)]:
        solo = PagedDriver(ours.model, block_size=16)
        assert (logits4[row] - solo.prefill(solo.new_seq(), toks)[-1]).abs().max() < 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_fp32(pair, dtype):
    hf, ours, _ = pair
    low = load_model(ours.path, dtype=dtype)
    assert low.model.dtype == dtype and low.fingerprint != ours.fingerprint
    ids = _prompt(20)
    drv = PagedDriver(low.model, block_size=4)
    got = drv.prefill(drv.new_seq(), ids, chunk=6)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert drv.cache.k.dtype == dtype
    # random weights with std 0.5 give large logits; compare relative to their scale
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 0.1
