"""Ministral, Seed-OSS, GLM, GLM-4, ERNIE 4.5 and Helium: config parsing (each family's
transformers defaults, the 4.x and 5.x spellings, one clear line for what Strata cannot serve)
and Strata against transformers 5.x on random tiny checkpoints saved with ``save_pretrained``:
logits, 32 greedy tokens, a batch of prompts of different lengths, chunked prefill in float64,
two tensor-parallel ranks, Ministral's sliding window, and the decoder-layer path that runs
(GLM, ERNIE 4.5 and Helium's interleaved RoPE reordered at load takes the one-call native
layer; GLM-4 runs op by op)."""

from __future__ import annotations

import pytest
import torch

from shared.model import cpu_kernels
from shared.model.archs import LLAVA_TEXT_TYPES, SUPPORTED, sliding_window_of
from shared.model.config import config_from_dict
from shared.model.errors import CheckpointError
from shared.model.loader import load_model
from shared.model.models.rope_pairs import pair_order
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
    "ministral": "MinistralForCausalLM",
    "seed_oss": "SeedOssForCausalLM",
    "glm": "GlmForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "ernie4_5": "Ernie4_5ForCausalLM",
    "helium": "HeliumForCausalLM",
}
WINDOW = 48  # Ministral's sliding window in the oracle cases


def _cfg(model_type: str, **kw) -> dict:
    return {"architectures": [NEW[model_type]], "model_type": model_type, **kw}


# -- config parsing ----------------------------------------------------------------------------


def test_ministral_defaults_and_windows():
    c = config_from_dict(_cfg("ministral"))
    assert (c.num_kv_heads, c.head_dim, c.intermediate_size) == (8, 128, 14336)
    assert c.rms_norm_eps == 1e-6 and (c.rope_theta, c.rope_scaling) == (1e4, None)
    # every layer windowed by default (4096 of 131072 positions); no bias whatever the keys say
    assert c.sliding_window == 4096 and c.max_model_len == 4096
    c = config_from_dict(_cfg("ministral", attention_bias=True, sliding_window=None))
    assert not (c.attention_bias or c.o_proj_bias or c.mlp_bias) and c.sliding_window is None
    full = ["full_attention"] * 2
    assert sliding_window_of(_cfg("ministral", num_hidden_layers=2, layer_types=full)) is None
    mixed = ["sliding_attention", "full_attention"]
    kw = dict(num_hidden_layers=2, layer_types=mixed, sliding_window=64)
    assert sliding_window_of(_cfg("ministral", **kw)) == 64
    check_shardable(config_from_dict(_cfg("ministral")), 2)


def test_seed_oss_defaults_and_bias_keys():
    c = config_from_dict(_cfg("seed_oss"))
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (80, 8, 128)
    assert c.attention_bias and not c.o_proj_bias and not c.mlp_bias
    assert c.max_position_embeddings == 524288 and c.sliding_window is None
    c = config_from_dict(
        _cfg(
            "seed_oss", attention_bias=False, attention_out_bias=True, mlp_bias=True, head_dim=None
        )
    )
    assert not c.attention_bias and c.o_proj_bias and c.mlp_bias and c.head_dim == 4096 // 80


def test_glm_defaults_partial_rotary_and_refusals(tmp_path):
    for mt in ("glm", "glm4"):
        c = config_from_dict(_cfg(mt))
        assert (c.head_dim, c.num_kv_heads, c.partial_rotary_factor) == (128, 2, 0.5)
        assert c.attention_bias and not c.o_proj_bias and not c.mlp_bias
        assert c.rms_norm_eps == 1.5625e-7 and c.intermediate_size == 13696
        assert c.sliding_window is None and not c.tie_word_embeddings
    # 4.x: top-level partial_rotary_factor, rope_theta + rope_scaling; 5.x: rope_parameters
    four = dict(partial_rotary_factor=0.25, rope_theta=5e4)
    four["rope_scaling"] = {"type": "linear", "factor": 2.0}
    c = config_from_dict(_cfg("glm4", **four))
    assert (c.partial_rotary_factor, c.rope_theta) == (0.25, 5e4)
    assert c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    rope = {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 1.0}
    c = config_from_dict(_cfg("glm", rope_parameters=rope, attention_bias=False))
    assert (c.partial_rotary_factor, c.rope_theta, c.attention_bias) == (1.0, 1e6, False)
    # a rotary part Strata cannot pair up: one line naming the key, at validate and at load
    bad = _cfg("glm", head_dim=32, partial_rotary_factor=0.3)  # 9.6: 9 dims
    with pytest.raises(CheckpointError) as e:
        validate_checkpoint(_checkpoint(tmp_path, bad))
    msg = str(e.value)
    assert "\n" not in msg
    assert "partial_rotary_factor 0.3 gives 9 rotary dims of the 32-dim head" in msg
    with pytest.raises(CheckpointError, match="partial_rotary_factor 0.3 gives 9"):
        config_from_dict(bad)
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
    with pytest.raises(CheckpointError, match="unsupported rope_type 'yarn'"):
        config_from_dict(_cfg("glm4", rope_parameters=yarn))


def test_ernie_and_helium_defaults_and_refusals(tmp_path):
    c = config_from_dict(_cfg("ernie4_5"))
    assert c.tie_word_embeddings and (c.rope_theta, c.rms_norm_eps) == (5e5, 1e-5)
    assert not (c.attention_bias or c.o_proj_bias or c.mlp_bias) and c.head_dim == 128
    c = config_from_dict(_cfg("ernie4_5", use_bias=True, tie_word_embeddings=False))
    assert c.attention_bias and c.o_proj_bias and c.mlp_bias and not c.tie_word_embeddings
    with pytest.raises(CheckpointError, match="partial_rotary_factor 0.5 is not supported"):
        config_from_dict(_cfg("ernie4_5", partial_rotary_factor=0.5))
    c = config_from_dict(_cfg("helium"))
    assert (c.rope_theta, c.rms_norm_eps, c.num_kv_heads, c.head_dim) == (1e5, 1e-8, 20, 128)
    assert not c.attention_bias and not c.o_proj_bias and c.max_position_embeddings == 4096
    c = config_from_dict(_cfg("helium", attention_bias=True, mlp_bias=True))
    assert c.attention_bias and not c.o_proj_bias and c.mlp_bias
    bad = _cfg("helium", hidden_size=64, num_attention_heads=4, head_dim=32)
    with pytest.raises(CheckpointError) as e:
        validate_checkpoint(_checkpoint(tmp_path, bad))
    assert "\n" not in str(e.value)
    assert "num_attention_heads * head_dim (4 x 32) other than hidden_size (64)" in str(e.value)


@pytest.mark.parametrize("model_type", list(NEW))
def test_validate_accepts_them_and_llava_refuses_them(tmp_path, model_type):
    assert NEW[model_type] in SUPPORTED and model_type not in LLAVA_TEXT_TYPES
    info = validate_checkpoint(_checkpoint(tmp_path, _cfg(model_type, max_position_embeddings=64)))
    assert info.architecture == NEW[model_type] and not info.multimodal
    llava = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava"}
    bad = llava | {"text_config": {"model_type": model_type}}
    with pytest.raises(CheckpointError, match=f"unsupported LLaVA text model_type '{model_type}'"):
        validate_checkpoint(_checkpoint(tmp_path / "llava", bad))


def test_pair_order():
    """Pair i of the rotated dims at (i, i + head_dim / 2), the passed-through dims in the rest
    of both halves: every dim once."""
    assert pair_order(8, 8).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    assert pair_order(8, 4).tolist() == [0, 2, 4, 5, 1, 3, 6, 7]


# -- against transformers ----------------------------------------------------------------------

CASES = {
    # Mistral's layer, every layer windowed (48: past every prompt below but the long one)
    "ministral": ("Ministral", dict(sliding_window=WINDOW)),
    # q/k/v bias, o_proj bias of its own, MLP bias, MHA
    "seed_oss": (
        "SeedOss",
        dict(num_key_value_heads=4, attention_out_bias=True, mlp_bias=True),
    ),
    # half of each head rotated in interleaved pairs, q/k/v bias, fused gate_up_proj
    "glm": ("Glm", dict()),
    # GLM-4's post-norms, a quarter of each head rotated (5.x rope_parameters), tied
    "glm4": (
        "Glm4",
        dict(
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.25,
            },
            tie_word_embeddings=True,
        ),
    ),
    # the whole head rotated in pairs, use_bias on every projection, tied (its default)
    "ernie4_5": ("Ernie4_5", dict(use_bias=True)),
    # the whole head in pairs, q/k/v and MLP bias, MQA
    "helium": ("Helium", dict(num_key_value_heads=1, attention_bias=True, mlp_bias=True)),
}


def _build(name, path):
    cls, kw = CASES[name]
    kw = {"num_key_value_heads": 2, "head_dim": 16, "pad_token_id": 0, **kw}
    return build_hf(cls, path, **kw)


pair = pair_fixture(_build, CASES)


def test_config_read_from_the_checkpoint(pair):
    hf, ours, name = pair
    c = ours.config
    assert c.partial_rotary_factor == {"glm": 0.5, "glm4": 0.25}.get(name, 1.0)
    assert c.attention_bias == (name != "ministral")
    assert c.o_proj_bias == (name in ("seed_oss", "ernie4_5"))
    assert c.mlp_bias == (name in ("seed_oss", "ernie4_5", "helium"))
    assert c.sliding_window == (WINDOW if name == "ministral" else None)
    assert c.tie_word_embeddings == (name in ("glm4", "ernie4_5"))
    if c.tie_word_embeddings:
        assert ours.model.lm_head.weight is ours.model.model.embed_tokens.weight


@pytest.mark.parametrize("block_size", [4, 16])
def test_logits_match(pair, block_size):
    hf, ours, _ = pair
    assert_logits_match(hf, ours.model, block_size)


@pytest.mark.parametrize("block_size,chunk", [(4, 3)])
def test_chunked_prefill_exact_in_fp64(pair, block_size, chunk):
    """Chunks over cached context and block boundaries change nothing, in float64 (ERNIE 4.5:
    transformers rotates q / k in float32 even in a float64 model, hence 1e-4 there)."""
    hf, ours, name = pair
    assert_chunked_fp64(hf, ours.path, block_size, chunk, 1e-4 if name == "ernie4_5" else 1e-9)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_half_precision_close_to_transformers(pair, dtype):
    """In bf16 the logits are as close to float32's as transformers' own in that dtype
    (these std-0.5 weights move bf16 logits by up to ~10%)."""
    hf, ours, _ = pair
    assert_as_close_as_transformers(hf, ours.path, dtype)


def test_greedy_32_tokens_identical(pair):
    hf, ours, _ = pair
    assert_greedy_identical(hf, ours.model)


def test_a_batch_of_prompts_of_different_lengths(pair):
    """Three prompts (5, 11 and 16 tokens) prefilled in one batch, then decoded together for 32
    greedy tokens: each prompt's logits and tokens are transformers' for that prompt alone (16 +
    32 tokens fill Ministral's window exactly)."""
    hf, ours, _ = pair
    assert_batch_matches(hf, ours.model)


def test_the_decoder_layer_path(pair, monkeypatch):
    """Every family but GLM-4 runs each layer as one native call on CPU float32 (interleaved
    RoPE reordered at load is Llama's RoPE); GLM-4's post-norms run op by op and say so."""
    from shared.model.models import llama

    _, ours, name = pair
    layers = ours.model.model.layers
    if name == "glm4":
        assert all(layer.native() is None for layer in layers)
        assert "runs op by op" in layers[0].native_reason
    if not cpu_kernels.available():
        pytest.skip("no native kernels on this machine")
    monkeypatch.setattr(llama, "NATIVE_LAYER", True)
    drv = PagedDriver(ours.model, block_size=4)
    seq = drv.new_seq()
    drv.prefill(seq, _prompt(9))
    before = cpu_kernels.layer_calls
    for tok in (5, 6, 7):  # decodes (head_dim 16: the native prefill kernel takes 32s)
        drv.step([(seq, [tok])])
    native = cpu_kernels.layer_calls - before
    assert native == (0 if name == "glm4" else 3 * len(layers)), native
    assert all((layer.native() is None) == (name == "glm4") for layer in layers)


def test_two_tensor_parallel_ranks_match_unsharded(tmp_path):
    """Heads and MLP columns over two gloo ranks: GLM-4's reordered q/k rows with their biases
    (the order is within a head), its partial RoPE and post-norms per rank."""
    _build("glm4", tmp_path / "ck")
    assert_tp_matches_unsharded([tmp_path / "ck"], tmp_path)


# -- Ministral's sliding window ----------------------------------------------------------------


def test_a_ministral_prompt_longer_than_the_window(tmp_path):
    """The served context is the window; at 80 tokens transformers' windowed logits differ from
    full attention's past it (why the context is capped there)."""
    hf = _build("ministral", tmp_path / "w")
    assert_window_caps(hf, load_model(tmp_path / "w"), WINDOW)


@pytest.mark.parametrize("kind", list(NEW))
def test_the_acceptance_checkpoints_load_and_match(kind, tmp_path):
    assert_acceptance_checkpoint(kind, tmp_path / kind, NEW[kind])
