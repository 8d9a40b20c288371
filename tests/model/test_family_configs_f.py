"""EXAONE-4, HunYuan-V1-Dense, Arcee and Nemotron: config parsing (each family's transformers
defaults, the 4.x and 5.x spellings, one clear line for what Strata cannot serve) and Strata
against transformers 5.x on random tiny checkpoints saved with ``save_pretrained``: logits, 32
greedy tokens, a batch of prompts of different lengths, chunked prefill in float64, bf16, two
tensor-parallel ranks, EXAONE-4's sliding window and RoPE-less full layers."""

from __future__ import annotations

import pytest
import torch

from shared.model import cpu_kernels
from shared.model.archs import LLAVA_TEXT_TYPES, SUPPORTED, layer_types_of, sliding_window_of
from shared.model.config import config_from_dict
from shared.model.errors import CheckpointError
from shared.model.loader import load_model
from shared.model.parallel import check_shardable
from shared.model.validate import validate_checkpoint
from tests.model.oracle import (
    assert_acceptance_checkpoint,
    assert_as_close_as_transformers,
    assert_batch_matches,
    assert_chunked_fp64,
    assert_greedy_identical,
    assert_logits_match,
    assert_tp_matches_unsharded,
    assert_window_caps,
    build_hf,
    pair_fixture,
)
from tests.model.paged_driver import PagedDriver
from tests.model.test_family_configs import _checkpoint
from tests.model.test_text_models import _prompt

transformers = pytest.importorskip("transformers")

NEW = {
    "exaone4": "Exaone4ForCausalLM",
    "hunyuan_v1_dense": "HunYuanDenseV1ForCausalLM",
    "arcee": "ArceeForCausalLM",
    "nemotron": "NemotronForCausalLM",
}
WINDOW = 48  # EXAONE-4's sliding window in the oracle cases


def _cfg(model_type: str, **kw) -> dict:
    return {"architectures": [NEW[model_type]], "model_type": model_type, **kw}


def _refused(tmp_path, cfg: dict, text: str) -> None:
    """One line holding ``text``, from the torch-free check and from the config reader."""
    with pytest.raises(CheckpointError) as e:
        validate_checkpoint(_checkpoint(tmp_path, cfg))
    assert "\n" not in str(e.value) and text in str(e.value), str(e.value)
    with pytest.raises(CheckpointError, match=text.replace("(", r"\(").replace(")", r"\)")):
        config_from_dict(cfg)


# -- config parsing ----------------------------------------------------------------------------


def test_exaone4_defaults_layers_and_nope():
    c = config_from_dict(_cfg("exaone4", attention_bias=True))
    assert (c.vocab_size, c.hidden_size, c.intermediate_size) == (102400, 4096, 16384)
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (32, 32, 32, 128)
    assert c.rms_norm_eps == 1e-5 and c.qk_norm and not c.tie_word_embeddings
    assert not (c.attention_bias or c.o_proj_bias or c.mlp_bias)  # no bias whatever it says
    # 3 sliding layers in 4 (window 4096), the 4th full and without RoPE
    assert c.sliding_window == 4096 and c.max_model_len == 2048
    assert c.nope_layers == tuple(range(3, 32, 4))
    types = layer_types_of(_cfg("exaone4", num_hidden_layers=6, sliding_window_pattern=3))
    assert types == ["sliding_attention", "sliding_attention", "full_attention"] * 2
    # no window: every layer full and rotated
    full = ["full_attention"] * 2
    c = config_from_dict(_cfg("exaone4", num_hidden_layers=2, sliding_window=None))
    assert c.sliding_window is None and c.nope_layers == ()
    c = config_from_dict(
        _cfg("exaone4", num_hidden_layers=2, sliding_window=None, layer_types=full)
    )
    assert c.sliding_window is None and c.nope_layers == ()
    # a window with every layer full: none slides (no cap) and none is rotated, as transformers
    c = config_from_dict(_cfg("exaone4", num_hidden_layers=2, sliding_window=64, layer_types=full))
    assert c.sliding_window is None and c.nope_layers == (0, 1)
    # 4.x rope_theta + rope_scaling; 5.x rope_parameters
    llama3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
    llama3["original_max_position_embeddings"] = 8192
    c = config_from_dict(
        _cfg("exaone4", rope_theta=1e6, rope_scaling={"rope_type": "llama3", **llama3})
    )
    assert c.rope_theta == 1e6 and c.rope_scaling["rope_type"] == "llama3"
    params = {"rope_type": "llama3", "rope_theta": 5e5, **llama3}
    c = config_from_dict(_cfg("exaone4", rope_parameters=params, head_dim=64))
    assert (c.rope_theta, c.rope_scaling["factor"], c.head_dim) == (5e5, 8.0, 64)


def test_exaone4_refusals(tmp_path):
    """What transformers 5 cannot build either: a string sliding_window_pattern without
    layer_types, sliding layers without a window; layer_types of the wrong length."""
    _refused(
        tmp_path / "a",
        _cfg("exaone4", num_hidden_layers=4, sliding_window_pattern="LLLG"),
        "sliding_window_pattern 'LLLG' without layer_types is not supported",
    )
    _refused(
        tmp_path / "b",
        _cfg("exaone4", num_hidden_layers=4, sliding_window_pattern=None),
        "sliding_window_pattern None without layer_types is not supported",
    )
    types = ["sliding_attention", "full_attention"]
    _refused(
        tmp_path / "c",
        _cfg("exaone4", num_hidden_layers=2, sliding_window=None, layer_types=types),
        "layer_types marks sliding layers but sliding_window is null",
    )
    _refused(
        tmp_path / "d",
        _cfg("exaone4", num_hidden_layers=3, layer_types=types),
        "layer_types has 2 entries for 3 layers",
    )


def test_hunyuan_defaults_and_dynamic_rope(tmp_path):
    c = config_from_dict(_cfg("hunyuan_v1_dense", mlp_bias=True))
    assert (c.vocab_size, c.intermediate_size, c.num_kv_heads, c.head_dim) == (
        290943,
        11008,
        32,
        128,
    )
    assert c.rms_norm_eps == 1e-5 and c.max_position_embeddings == 2048
    assert not (c.attention_bias or c.o_proj_bias or c.mlp_bias)  # its MLP never has a bias
    assert (c.rope_theta, c.rope_scaling, c.sliding_window) == (1e4, None, None)
    c = config_from_dict(_cfg("hunyuan_v1_dense", attention_bias=True, num_key_value_heads=8))
    assert c.attention_bias and c.o_proj_bias and c.num_kv_heads == 8
    # NTK-alpha: a fixed base, theta * alpha ** (d / (d - 2)); 4.x rope_scaling and 5.x keys
    four = dict(rope_theta=1e4, head_dim=128)
    four["rope_scaling"] = {"type": "dynamic", "alpha": 1000.0, "factor": 1.0, "mscale": 1.0}
    c = config_from_dict(_cfg("hunyuan_v1_dense", **four))
    assert c.rope_scaling is None and c.rope_theta == pytest.approx(1e4 * 1000 ** (128 / 126))
    five = {"rope_type": "dynamic", "alpha": 50.0, "rope_theta": 1e4}
    c = config_from_dict(_cfg("hunyuan_v1_dense", rope_parameters=five, head_dim=64))
    assert c.rope_scaling is None and c.rope_theta == 1e4 * 50.0 ** (64 / 62)
    # dynamic NTK without alpha: the plain base within max_position_embeddings
    plain = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 5e4}
    c = config_from_dict(_cfg("hunyuan_v1_dense", rope_parameters=plain))
    assert (c.rope_theta, c.rope_scaling) == (5e4, None)
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
    _refused(tmp_path, _cfg("hunyuan_v1_dense", rope_parameters=yarn), "unsupported rope_type")


def test_arcee_defaults_yarn_and_refusals(tmp_path):
    c = config_from_dict(_cfg("arcee"))
    assert (c.hidden_size, c.intermediate_size, c.num_kv_heads, c.head_dim) == (2560, 18432, 32, 80)
    assert c.hidden_act == "relu2" and c.max_position_embeddings == 4096
    assert not (c.attention_bias or c.o_proj_bias or c.mlp_bias) and not c.tie_word_embeddings
    c = config_from_dict(_cfg("arcee", attention_bias=True, mlp_bias=True))
    assert c.attention_bias and c.o_proj_bias and c.mlp_bias
    # AFM-4.5B's YaRN, 4.x and 5.x spellings
    yarn = dict(factor=20.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0)
    c = config_from_dict(_cfg("arcee", rope_theta=1e4, rope_scaling={"type": "yarn", **yarn}))
    assert c.rope_scaling["rope_type"] == "yarn" and c.rope_scaling["factor"] == 20.0
    c = config_from_dict(
        _cfg("arcee", rope_parameters={"rope_type": "yarn", "rope_theta": 1e5, **yarn})
    )
    assert c.rope_theta == 1e5 and c.rope_scaling["original_max_position_embeddings"] == 4096
    no_factor = {"rope_type": "yarn", "rope_theta": 1e4}
    _refused(
        tmp_path / "a",
        _cfg("arcee", rope_parameters=no_factor),
        "YaRN rope parameters without 'factor'",
    )
    bad = _cfg("arcee", hidden_size=100, num_attention_heads=8)
    _refused(tmp_path / "b", bad, "hidden_size 100 is not a multiple of num_attention_heads 8")
    _refused(
        tmp_path / "c",
        _cfg("arcee", num_attention_heads=8, num_key_value_heads=3),
        "num_key_value_heads 3 does not divide num_attention_heads 8",
    )


def test_nemotron_defaults_partial_rotary_and_refusals(tmp_path):
    c = config_from_dict(_cfg("nemotron", rms_norm_eps=0.5))
    assert (c.vocab_size, c.hidden_size, c.num_heads, c.head_dim) == (256000, 6144, 48, 128)
    assert c.rms_norm_eps == 1e-5  # norm_eps: Nemotron's key (rms_norm_eps is not)
    assert c.partial_rotary_factor == 0.5 and c.hidden_act == "relu2" and c.num_kv_heads == 48
    assert not (c.attention_bias or c.mlp_bias) and c.max_position_embeddings == 4096
    # 4.x top-level partial_rotary_factor and rope_theta; 5.x rope_parameters
    c = config_from_dict(
        _cfg("nemotron", partial_rotary_factor=0.25, rope_theta=5e4, norm_eps=1e-6)
    )
    assert (c.partial_rotary_factor, c.rope_theta, c.rms_norm_eps) == (0.25, 5e4, 1e-6)
    params = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0}
    c = config_from_dict(
        _cfg("nemotron", rope_parameters=params, attention_bias=True, mlp_bias=True)
    )
    assert c.partial_rotary_factor == 1.0 and c.attention_bias and c.o_proj_bias and c.mlp_bias
    bad = _cfg("nemotron", hidden_size=128, num_attention_heads=4, partial_rotary_factor=0.3)
    _refused(tmp_path, bad, "partial_rotary_factor 0.3 gives 9 rotary dims of the 32-dim head")


@pytest.mark.parametrize("model_type", list(NEW))
def test_validate_accepts_them_and_llava_refuses_them(tmp_path, model_type):
    assert NEW[model_type] in SUPPORTED and model_type not in LLAVA_TEXT_TYPES
    info = validate_checkpoint(_checkpoint(tmp_path, _cfg(model_type, max_position_embeddings=64)))
    assert info.architecture == NEW[model_type] and not info.multimodal
    llava = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava"}
    bad = llava | {"text_config": {"model_type": model_type}}
    with pytest.raises(CheckpointError, match=f"unsupported LLaVA text model_type '{model_type}'"):
        validate_checkpoint(_checkpoint(tmp_path / "llava", bad))
    check_shardable(config_from_dict(_cfg(model_type, num_key_value_heads=8)), 2)


def test_exaone4_window_note_at_validate(tmp_path):
    """The light check says the context is capped at EXAONE-4's window."""
    cfg = _cfg("exaone4", num_hidden_layers=4, sliding_window=64, max_position_embeddings=256)
    info = validate_checkpoint(_checkpoint(tmp_path, cfg))
    assert info.context_note and "serving a context of 64 tokens" in info.context_note
    assert sliding_window_of(cfg) == 64


# -- against transformers ----------------------------------------------------------------------

CASES = {
    # a sliding layer (window 48) rotated, a full layer without RoPE; per-head q/k norms
    "exaone4": (
        "Exaone4",
        dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    ),
    # no window: both layers full and rotated; MQA, tied
    "exaone4_full": (
        "Exaone4",
        dict(
            num_key_value_heads=1,
            sliding_window=None,
            layer_types=["full_attention"] * 2,
            tie_word_embeddings=True,
        ),
    ),
    # q/k norms after RoPE, q/k/v/o bias, NTK-alpha RoPE (5.x rope_parameters)
    "hunyuan": (
        "HunYuanDenseV1",
        dict(
            attention_bias=True,
            rope_parameters={
                "rope_type": "dynamic",
                "alpha": 1000.0,
                "factor": 1.0,
                "rope_theta": 1e4,
            },
        ),
    ),
    # dynamic NTK without alpha (the plain base here), no bias, MHA
    "hunyuan_dynamic": (
        "HunYuanDenseV1",
        dict(
            num_key_value_heads=4,
            rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
        ),
    ),
    # ungated relu2 MLP with biases, q/k/v/o bias, YaRN (original context 64 of 256)
    "arcee": (
        "Arcee",
        dict(
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 1e4,
            },
        ),
    ),
    # LayerNorm1p, half of each head rotated, biases, GQA 4:2
    "nemotron": ("Nemotron", dict(attention_bias=True, mlp_bias=True)),
    # a quarter of each head rotated (4.x key), no bias, tied
    "nemotron_tied": (
        "Nemotron",
        dict(partial_rotary_factor=0.25, tie_word_embeddings=True, num_key_value_heads=4),
    ),
}


def _build(name, path):
    cls, kw = CASES[name]
    kw = {"num_key_value_heads": 2, "head_dim": 16, "pad_token_id": 0, **kw}
    return build_hf(cls, path, **kw)


pair = pair_fixture(_build, CASES)


def test_config_read_from_the_checkpoint(pair):
    hf, ours, name = pair
    c = ours.config
    assert c.architecture == type(hf).__name__
    assert c.sliding_window == (WINDOW if name == "exaone4" else None)
    assert c.nope_layers == ((1,) if name == "exaone4" else ())
    assert c.attention_bias == c.o_proj_bias == (name in ("hunyuan", "arcee", "nemotron"))
    assert c.mlp_bias == (name in ("arcee", "nemotron"))
    assert c.partial_rotary_factor == {"nemotron": 0.5, "nemotron_tied": 0.25}.get(name, 1.0)
    if name == "hunyuan":
        assert c.rope_theta == 1e4 * 1000.0 ** (16 / 14) and c.rope_scaling is None
    if c.tie_word_embeddings:
        assert ours.model.lm_head.weight is ours.model.model.embed_tokens.weight


@pytest.mark.parametrize("block_size", [4, 16])
def test_logits_match(pair, block_size):
    hf, ours, _ = pair
    assert_logits_match(hf, ours.model, block_size)


def test_chunked_prefill_exact_in_fp64(pair):
    """Chunks of 3 over cached context and 4-token block boundaries change nothing, in
    float64."""
    hf, ours, _ = pair
    assert_chunked_fp64(hf, ours.path, 4, 3)


def test_greedy_32_tokens_identical(pair):
    hf, ours, _ = pair
    assert_greedy_identical(hf, ours.model)


def test_a_batch_of_prompts_of_different_lengths(pair):
    """Three prompts (5, 11 and 16 tokens) prefilled in one batch, then decoded together for 32
    greedy tokens: each prompt's logits and tokens are transformers' for that prompt alone (16 +
    32 tokens fill EXAONE-4's window exactly)."""
    hf, ours, _ = pair
    assert_batch_matches(hf, ours.model)


def test_half_precision_close_to_transformers(pair):
    """In bf16 the logits are as close to float32's as transformers' own in that dtype."""
    hf, ours, _ = pair
    assert_as_close_as_transformers(hf, ours.path, torch.bfloat16)


def test_the_layers_run_op_by_op(pair, monkeypatch):
    """No one-call native layer (`layer.c`: pre-norms, norm before RoPE, SiLU gating): each
    layer says why and the forward counts it; EXAONE-4 still normalises and rotates q / k in
    the fused kernel, HunYuan rotates there and norms after."""
    from prometheus_client import REGISTRY

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

    before = (count("decoder_layer"), cpu_kernels.layer_calls)
    drv = PagedDriver(ours.model, block_size=4)
    drv.prefill(drv.new_seq(), _prompt(9))
    assert count("decoder_layer") == before[0] + 1 and cpu_kernels.layer_calls == before[1]


TP_CASES = ("exaone4", "hunyuan", "arcee", "nemotron")


def test_two_tensor_parallel_ranks_match_unsharded(tmp_path):
    """Heads and MLP columns over two gloo ranks, for each family (one spawn for the four keeps
    the file's time): per-head q/k norms (EXAONE-4 before RoPE, HunYuan after), the NoPE layer,
    the ungated MLP (``up_proj`` rows, ``down_proj`` columns), Nemotron's partial RoPE, biases
    added once."""
    for name in TP_CASES:
        _build(name, tmp_path / name)
    assert_tp_matches_unsharded([tmp_path / name for name in TP_CASES], tmp_path)


# -- EXAONE-4's sliding window and NoPE layers -------------------------------------------------


def test_an_exaone4_prompt_longer_than_the_window(tmp_path):
    """The served context is the window; at 80 tokens transformers' windowed logits differ from
    full attention's past it (why the context is capped there)."""
    hf = _build("exaone4", tmp_path / "w")
    assert_window_caps(hf, load_model(tmp_path / "w"), WINDOW)


def test_exaone4_full_layer_takes_no_rope(tmp_path):
    """Rotating EXAONE-4's full-attention layer (as a model without NoPE layers would) moves the
    logits far from transformers': the NoPE layer is what matches."""
    hf = _build("exaone4", tmp_path / "n")
    ours = load_model(tmp_path / "n")
    ids = _prompt(20)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    object.__setattr__(ours.model.config, "nope_layers", ())
    drv = PagedDriver(ours.model, block_size=4)
    assert (drv.prefill(drv.new_seq(), ids) - ref).abs().max().item() > 1e-2


@pytest.mark.parametrize("kind", list(NEW))
def test_the_acceptance_checkpoints_load_and_match(kind, tmp_path):
    assert_acceptance_checkpoint(kind, tmp_path / kind, NEW[kind])
