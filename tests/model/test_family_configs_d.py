"""GPT-NeoX, StableLM and Cohere: config parsing (transformers' defaults and its own reading of
the 4.x and 5.x keys, one clear line for what Strata cannot serve) and Strata against
transformers 5.x on random tiny checkpoints saved with ``save_pretrained``: logits, 32 greedy
tokens, batches of prompts of different lengths, chunked prefill in float64, bf16, two
tensor-parallel ranks (every case in one spawn), the acceptance checkpoints."""

from __future__ import annotations

import pytest
import torch

from shared.model.archs import LLAVA_TEXT_TYPES, SUPPORTED
from shared.model.config import config_from_dict
from shared.model.errors import CheckpointError
from shared.model.parallel import check_shardable
from shared.model.validate import validate_checkpoint
from tests.model.oracle import (
    assert_acceptance_checkpoint,
    assert_batch_matches,
    assert_chunked_fp64,
    assert_greedy_identical,
    assert_logits_match,
    assert_low_precision_close,
    assert_tp_matches_unsharded,
    build_hf,
    pair_fixture,
)
from tests.model.paged_driver import PagedDriver
from tests.model.test_family_configs import _checkpoint
from tests.model.test_text_models import _prompt

transformers = pytest.importorskip("transformers")

NEW = {
    "gpt_neox": "GPTNeoXForCausalLM",
    "stablelm": "StableLmForCausalLM",
    "cohere": "CohereForCausalLM",
}
HF_CONFIG = {"gpt_neox": "GPTNeoXConfig", "stablelm": "StableLmConfig", "cohere": "CohereConfig"}


def _cfg(model_type: str, **kw) -> dict:
    return {"architectures": [NEW[model_type]], "model_type": model_type, **kw}


def _hf_reading(model_type: str, raw: dict) -> dict:
    """What transformers reads from ``raw`` (the oracle for the config tests)."""
    hf = getattr(transformers, HF_CONFIG[model_type]).from_dict(dict(raw))
    rope = hf.rope_parameters
    heads = hf.num_attention_heads
    return dict(
        hidden_size=hf.hidden_size,
        num_layers=hf.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        intermediate_size=hf.intermediate_size,
        vocab_size=hf.vocab_size,
        rms_norm_eps=hf.layer_norm_eps,
        max_position_embeddings=hf.max_position_embeddings,
        hidden_act=hf.hidden_act,
        tie_word_embeddings=hf.tie_word_embeddings,
        rope_theta=float(rope["rope_theta"]),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", 1.0)),
        logit_scale=getattr(hf, "logit_scale", 1.0),
        **_hf_flags(model_type, hf),
    )


def _hf_flags(model_type: str, hf) -> dict:
    """Biases, q/k norm and residual layout as transformers' modules take them from ``hf``."""
    if model_type == "gpt_neox":
        b = hf.attention_bias
        flags = (b, b, True, False, hf.use_parallel_residual)
    elif model_type == "cohere":
        b = hf.attention_bias
        flags = (b, b, False, hf.use_qk_norm, True)
    else:
        flags = (hf.use_qkv_bias, False, False, hf.qk_layernorm, hf.use_parallel_residual)
    keys = ("attention_bias", "o_proj_bias", "mlp_bias", "qk_norm", "parallel_residual")
    return dict(zip(keys, flags, strict=True))


def _ours(c) -> dict:
    return dict(
        hidden_size=c.hidden_size,
        num_layers=c.num_layers,
        num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        intermediate_size=c.intermediate_size,
        vocab_size=c.vocab_size,
        rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        hidden_act=c.hidden_act,
        tie_word_embeddings=c.tie_word_embeddings,
        rope_theta=c.rope_theta,
        partial_rotary_factor=c.partial_rotary_factor,
        logit_scale=c.logit_scale,
        attention_bias=c.attention_bias,
        o_proj_bias=c.o_proj_bias,
        mlp_bias=c.mlp_bias,
        qk_norm=c.qk_norm,
        parallel_residual=c.parallel_residual,
    )


# -- config parsing ----------------------------------------------------------------------------

RAW = [
    ("gpt_neox", {}),  # every default (GPT-NeoX-20B's shape)
    # Pythia as transformers 4.x wrote it: rotary_pct, rotary_emb_base, use_parallel_residual
    (
        "gpt_neox",
        dict(
            hidden_size=512,
            num_attention_heads=8,
            intermediate_size=2048,
            num_hidden_layers=6,
            rotary_pct=0.25,
            rotary_emb_base=10000,
            layer_norm_eps=1e-5,
            vocab_size=50304,
            use_parallel_residual=True,
            tie_word_embeddings=False,
        ),
    ),
    # a later 4.x file also holds rope_theta (5.x reads rotary_emb_base); sequential residual
    (
        "gpt_neox",
        dict(rotary_pct=0.5, rotary_emb_base=5000, rope_theta=5000, use_parallel_residual=False),
    ),
    # rope_theta alone: transformers 5.x ignores it (base 10000)
    ("gpt_neox", dict(rope_theta=7000.0, attention_bias=False, hidden_act="gelu_new")),
    # 5.x: rope_parameters (its partial_rotary_factor wins over rotary_pct)
    (
        "gpt_neox",
        dict(
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 3e4,
                "partial_rotary_factor": 1.0,
            },
            rotary_pct=0.5,
            layer_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
    ),
    ("stablelm", {}),  # every default: 32 KV heads, a quarter rotated, sequential
    # StableLM-2 1.6B as 4.x wrote it: top-level rope_theta / partial_rotary_factor, qkv bias
    (
        "stablelm",
        dict(
            hidden_size=2048,
            num_attention_heads=32,
            num_key_value_heads=32,
            intermediate_size=5632,
            num_hidden_layers=24,
            vocab_size=100352,
            rope_theta=10000,
            partial_rotary_factor=0.25,
            use_qkv_bias=True,
            layer_norm_eps=1e-5,
        ),
    ),
    # StableLM-2 12B's layout: parallel residual, per-head q/k norms, GQA
    (
        "stablelm",
        dict(
            num_key_value_heads=8,
            use_parallel_residual=True,
            qk_layernorm=True,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.5,
            },
        ),
    ),
    ("cohere", {}),  # every default: base 5e5, tied, logit_scale 0.0625, every head its own K/V
    # Command-R as 4.x wrote it: top-level rope_theta, no qk norm
    (
        "cohere",
        dict(
            hidden_size=8192,
            num_attention_heads=64,
            num_key_value_heads=64,
            intermediate_size=22528,
            num_hidden_layers=40,
            vocab_size=256000,
            rope_theta=8e6,
            logit_scale=0.0625,
            layer_norm_eps=1e-5,
            use_qk_norm=False,
        ),
    ),
    # Command-R+'s layout (qk norm, GQA) in 5.x keys, a head_dim of its own, attention bias
    (
        "cohere",
        dict(
            hidden_size=96,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            use_qk_norm=True,
            attention_bias=True,
            logit_scale=0.8333,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 75e6},
        ),
    ),
]


@pytest.mark.parametrize("model_type,raw", RAW)
def test_reads_config_json_as_transformers_does(model_type, raw):
    c = config_from_dict(_cfg(model_type, **raw))
    assert _ours(c) == _hf_reading(model_type, raw)
    assert c.rope_scaling is None and c.sliding_window is None


def test_gpt_neox_rope_scaling_linear_and_refused():
    scaling = {"type": "linear", "factor": 2.0}
    c = config_from_dict(_cfg("gpt_neox", rope_scaling=scaling, rotary_pct=0.5))
    assert c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert (c.rope_theta, c.partial_rotary_factor) == (1e4, 0.5)
    with pytest.raises(CheckpointError, match="unsupported rope_type 'dynamic'"):
        config_from_dict(_cfg("gpt_neox", rope_scaling={"type": "dynamic", "factor": 2.0}))


REFUSED = [
    ("cohere", dict(num_attention_heads=8, num_key_value_heads=3), "num_key_value_heads 3 does"),
    ("cohere", dict(logit_scale=None), "logit_scale null is not supported"),
    ("stablelm", dict(hidden_size=100, num_attention_heads=8), "hidden_size 100 is not a multiple"),
    ("stablelm", dict(num_attention_heads=8, num_key_value_heads=3), "num_key_value_heads 3 does"),
    ("stablelm", dict(partial_rotary_factor=1.5), "partial_rotary_factor 1.5 gives 120 rotary"),
    ("gpt_neox", dict(hidden_size=100, num_attention_heads=8), "hidden_size 100 is not a multiple"),
    ("gpt_neox", dict(hidden_size=64, num_attention_heads=4, head_dim=32), "head_dim 32 other"),
    ("gpt_neox", dict(hidden_size=96, num_attention_heads=4, rotary_pct=0.125), "gives 3 rotary"),
    ("gpt_neox", dict(rotary_pct=0.0), "rotary_pct 0.0 gives 0 rotary dims"),
]


@pytest.mark.parametrize("model_type,kw,msg", REFUSED)
def test_what_strata_cannot_serve_is_refused_in_one_line(tmp_path, model_type, kw, msg):
    cfg = _cfg(model_type, **kw)
    with pytest.raises(CheckpointError) as e:
        validate_checkpoint(_checkpoint(tmp_path, cfg))
    assert "\n" not in str(e.value) and msg in str(e.value), str(e.value)
    with pytest.raises(CheckpointError, match=msg.split(" (")[0].replace("(", r"\(")):
        config_from_dict(cfg)


@pytest.mark.parametrize("model_type", list(NEW))
def test_validate_accepts_them_and_llava_refuses_them(tmp_path, model_type):
    assert NEW[model_type] in SUPPORTED and model_type not in LLAVA_TEXT_TYPES
    info = validate_checkpoint(_checkpoint(tmp_path, _cfg(model_type, max_position_embeddings=64)))
    assert info.architecture == NEW[model_type] and not info.multimodal
    llava = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava"}
    bad = llava | {"text_config": {"model_type": model_type}}
    with pytest.raises(CheckpointError, match=f"unsupported LLaVA text model_type '{model_type}'"):
        validate_checkpoint(_checkpoint(tmp_path / "llava", bad))


def test_tensor_parallel_checks():
    c = config_from_dict(_cfg("gpt_neox", hidden_size=64, num_attention_heads=4))
    check_shardable(c, 2)
    with pytest.raises(CheckpointError, match=r"3 must divide num_heads \(4\)"):
        check_shardable(c, 3)


# -- against transformers ----------------------------------------------------------------------

CASES = {
    # parallel residual (two norms), a quarter of the head rotated (4 of 16 dims), biases, untied
    "neox_parallel": ("GPTNeoX", dict(rotary_pct=0.25)),
    # sequential residual, no attention bias, half the head rotated, tied head
    "neox_sequential": (
        "GPTNeoX",
        dict(
            use_parallel_residual=False,
            attention_bias=False,
            rotary_pct=0.5,
            tie_word_embeddings=True,
        ),
    ),
    # sequential, per-head q/k LayerNorms, q/k/v bias, GQA 4:2, a quarter rotated, untied
    "stablelm_qkln": (
        "StableLm",
        dict(num_key_value_heads=2, qk_layernorm=True, use_qkv_bias=True),
    ),
    # parallel on one norm, half the head rotated, MHA, tied head
    "stablelm_parallel": (
        "StableLm",
        dict(
            num_key_value_heads=4,
            use_parallel_residual=True,
            partial_rotary_factor=0.5,
            tie_word_embeddings=True,
        ),
    ),
    # per-head q/k norms, attention bias, GQA 4:2, untied, logit_scale 0.5
    "cohere_qknorm": (
        "Cohere",
        dict(
            num_key_value_heads=2,
            use_qk_norm=True,
            attention_bias=True,
            tie_word_embeddings=False,
            logit_scale=0.5,
        ),
    ),
    # no qk norm, MHA, tied (Cohere's default), logit_scale 0.25
    "cohere_tied": ("Cohere", dict(num_key_value_heads=4, logit_scale=0.25)),
}


def _build(name, path):
    cls, kw = CASES[name]
    return build_hf(cls, path, **kw)


pair = pair_fixture(_build, CASES)


def test_config_read_from_the_checkpoint(pair):
    hf, ours, name = pair
    c, m = ours.config, ours.model
    model_type = hf.config.model_type
    assert _ours(c) == _hf_reading(model_type, hf.config.to_dict())
    assert (m.lm_head.weight is m.model.embed_tokens.weight) == c.tie_word_embeddings
    layer = m.model.layers[0]
    a = layer.self_attn
    if model_type == "cohere":  # one bias-free norm, whole-head RoPE, per-head q/k norms
        assert layer.post_attention_layernorm is None and layer.input_layernorm.bias is None
        assert m.rotary_dim() == c.head_dim and (a.q_norm is not None) == c.qk_norm
        return
    assert a.rotary_dim == int(c.head_dim * c.partial_rotary_factor)
    if model_type == "gpt_neox":
        assert (a.dense.bias is not None) == hf.config.attention_bias
    else:  # StableLM: no post-attention norm in the parallel layout, q/k norms per head
        assert (layer.post_attention_layernorm is None) == c.parallel_residual
        assert (a.q_layernorm is not None) == c.qk_norm


def test_the_fused_qkv_is_split_head_by_head(pair):
    """``query_key_value`` holds each head's q, k and v rows together: q_proj gets every head's
    q rows in order (not the first third of the fused rows)."""
    hf, ours, name = pair
    if not name.startswith("neox"):
        pytest.skip("GPT-NeoX's layout")
    fused = hf.gpt_neox.layers[1].attention.query_key_value.weight
    d = ours.config.head_dim
    per_head = fused.view(ours.config.num_heads, 3, d, -1)
    a = ours.model.model.layers[1].self_attn
    for i, proj in enumerate((a.q_proj, a.k_proj, a.v_proj)):
        assert torch.equal(proj.weight, per_head[:, i].reshape(-1, fused.shape[1]))


def test_cohere_pairs_are_reordered_into_llama_rope(pair):
    """Cohere rotates interleaved pairs ``(2i, 2i + 1)``: each head's q/k rows (biases, q/k
    norm weights) sit in `pair_order` (pair ``i`` at ``i`` and ``i + head_dim / 2``), v as
    stored."""
    from shared.model.models.rope_pairs import pair_order

    hf, ours, name = pair
    if not name.startswith("cohere"):
        pytest.skip("Cohere's layout")
    c, d = ours.config, ours.config.head_dim
    order = pair_order(d, d)
    assert order[: d // 2].tolist() == list(range(0, d, 2))
    theirs, mine = hf.model.layers[1].self_attn, ours.model.model.layers[1].self_attn
    for proj in ("q_proj", "k_proj"):
        w = getattr(theirs, proj).weight
        want = w.view(-1, d, w.shape[1])[:, order].reshape(w.shape)
        assert torch.equal(getattr(mine, proj).weight, want)
    assert torch.equal(mine.v_proj.weight, theirs.v_proj.weight)
    if c.qk_norm:
        assert torch.equal(mine.q_norm.weight, theirs.q_norm.weight[:, order])


@pytest.mark.parametrize("block_size", [4, 16])
def test_logits_match(pair, block_size):
    hf, ours, _ = pair
    assert_logits_match(hf, ours.model, block_size)


@pytest.mark.parametrize("block_size,chunk", [(4, 3), (16, 7)])
def test_chunked_prefill_exact_in_fp64(pair, block_size, chunk):
    """Chunks over cached context and block boundaries change nothing, in float64: against
    Strata's own one-step prefill to 1e-9, and transformers' float64 logits (to 1e-9; Cohere's
    norms and RoPE run in float32 in transformers even in a float64 model: 1e-5)."""
    hf, ours, name = pair
    tol = 1e-5 if name.startswith("cohere") else 1e-9
    head = lambda m, h: m.lm_head(h) * m.config.logit_scale  # noqa: E731 - compute_logits' head
    assert_chunked_fp64(hf, ours.path, block_size, chunk, tol, head)


def test_greedy_32_tokens_identical(pair):
    hf, ours, _ = pair
    assert_greedy_identical(hf, ours.model)


def test_a_batch_of_prompts_of_different_lengths(pair):
    """Three prompts (5, 11 and 16 tokens) prefilled in one batch, then decoded together for 32
    greedy tokens: each prompt's logits and tokens are transformers' for that prompt alone."""
    hf, ours, _ = pair
    assert_batch_matches(hf, ours.model)


def test_the_layers_run_op_by_op_and_count_it(pair, monkeypatch):
    """No one-call native layer (`layer.c`: RMSNorm, SiLU gating): each layer says why, and on
    CPU float32 the forward counts a ``decoder_layer`` fallback (GPT-NeoX and StableLM also one
    ``qk_norm_rope`` per layer: RoPE on part of the head runs in torch; Cohere's whole-head RoPE
    runs on the fused kernel)."""
    from prometheus_client import REGISTRY

    from shared.model import cpu_kernels
    from shared.model.models import llama

    _, ours, name = pair
    for layer in ours.model.model.layers:
        assert layer.native() is None and "runs op by op" in layer.native_reason
    if not cpu_kernels.available():
        pytest.skip("no native kernels on this machine")
    monkeypatch.setattr(llama, "NATIVE_LAYER", True)

    def count(op):
        labels = {"op": op, "reason": "unsupported"}
        return REGISTRY.get_sample_value("strata_kernel_fallback_total", labels) or 0.0

    before = (count("decoder_layer"), count("qk_norm_rope"), cpu_kernels.layer_calls)
    drv = PagedDriver(ours.model, block_size=4)
    drv.prefill(drv.new_seq(), _prompt(9))
    assert count("decoder_layer") == before[0] + 1 and cpu_kernels.layer_calls == before[2]
    assert count("qk_norm_rope") == before[1] + (0 if name.startswith("cohere") else 2)


def test_bf16_close_to_fp32(pair):
    hf, ours, _ = pair
    assert_low_precision_close(hf, ours.path, torch.bfloat16, 0.1)


# -- tensor parallelism: every case over two gloo ranks in one spawn ----------------------------


def test_two_tensor_parallel_ranks_match_unsharded(tmp_path):
    """Heads and MLP columns over two gloo ranks, one spawn for every case: GPT-NeoX's q/k/v
    rows (split head by head at load) with their biases, ``dense`` row-parallel (bias once), the
    ungated MLP split by its two projections; StableLM's gated MLP and its per-head q/k norms,
    Cohere's q/k norm rows (each rank keeps its heads'); partial RoPE per rank, both residual
    layouts, Cohere's logit_scale."""
    for name in CASES:
        _build(name, tmp_path / name)
    assert_tp_matches_unsharded([tmp_path / name for name in CASES], tmp_path)


# -- the acceptance checkpoints ----------------------------------------------------------------


@pytest.mark.parametrize("kind", list(NEW))
def test_the_acceptance_checkpoints_load_and_match(kind, tmp_path):
    assert_acceptance_checkpoint(kind, tmp_path / kind, NEW[kind])
