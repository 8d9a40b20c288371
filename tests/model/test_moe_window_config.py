"""Config parsing of the MoE and sliding-window settings (`config_from_dict`, torch-free
`validate_checkpoint`): expert counts under both spellings, which layers are sparse, the top-k
normalisation, the served context capped at the window, and one clear line for what Strata
cannot serve."""

from __future__ import annotations

import json

import pytest

from shared.model.archs import MIN_WINDOW_LEN, SUPPORTED, sliding_window_of
from shared.model.config import config_from_dict
from shared.model.errors import CheckpointError
from shared.model.validate import validate_checkpoint
from tests.infra.fake_apps import write_fake_checkpoint

QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "num_hidden_layers": 6,
    "num_experts": 16,  # transformers 4.x spelling (5.x writes num_local_experts)
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 40,
    "norm_topk_prob": True,
    "decoder_sparse_step": 2,
    "mlp_only_layers": [3],
}


def test_qwen3_moe_fields():
    c = config_from_dict(QWEN3_MOE)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (16, 4, 40)
    assert c.norm_topk_prob and c.qk_norm
    assert c.moe_layers == (1, 5)  # (i + 1) % 2 == 0, minus mlp_only_layers
    five = {k: v for k, v in QWEN3_MOE.items() if k != "num_experts"}
    five |= {"num_local_experts": 8, "norm_topk_prob": False, "decoder_sparse_step": 1}
    c = config_from_dict(five)
    assert c.num_experts == 8 and not c.norm_topk_prob
    assert c.moe_layers == (0, 1, 2, 4, 5)


def test_mixtral_fields_and_defaults():
    c = config_from_dict(
        {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_hidden_layers": 3}
    )
    assert (c.num_experts, c.num_experts_per_tok) == (8, 2)
    assert c.norm_topk_prob  # Mixtral always renormalises the top-k weights
    assert c.moe_layers == (0, 1, 2) and c.moe_intermediate_size == c.intermediate_size
    assert not (c.attention_bias or c.o_proj_bias or c.qk_norm)


def test_dense_models_have_no_experts():
    c = config_from_dict({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"})
    assert (c.num_experts, c.moe_layers) == (0, ())


def test_top_k_above_the_expert_count_is_one_line():
    bad = QWEN3_MOE | {"num_experts_per_tok": 17}
    with pytest.raises(CheckpointError, match="num_experts_per_tok 17 exceeds the 16 experts"):
        config_from_dict(bad)


WINDOWS = {
    # (config, window some layer applies)
    "mistral": ({"model_type": "mistral", "sliding_window": 4096}, 4096),
    "mistral null": ({"model_type": "mistral", "sliding_window": None}, None),
    "mixtral": ({"model_type": "mixtral", "sliding_window": 512}, 512),
    "qwen2 off": ({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": False}, None),
    "qwen2 on, every layer full": (
        {
            "model_type": "qwen2",
            "use_sliding_window": True,
            "sliding_window": 64,
            "num_hidden_layers": 4,
            "max_window_layers": 4,
        },
        None,
    ),
    "qwen3 on, top layers windowed": (
        {
            "model_type": "qwen3",
            "use_sliding_window": True,
            "sliding_window": 64,
            "num_hidden_layers": 4,
            "max_window_layers": 2,
        },
        64,
    ),
    "qwen2 layer_types": (
        {
            "model_type": "qwen2",
            "use_sliding_window": True,
            "sliding_window": 64,
            "max_window_layers": 28,
            "layer_types": ["full_attention", "sliding_attention"],
        },
        64,
    ),
    "qwen3_moe on": (
        {"model_type": "qwen3_moe", "use_sliding_window": True, "sliding_window": 96},
        96,
    ),
    "phi3": ({"model_type": "phi3", "sliding_window": 2047}, 2047),
    "gemma2 every other layer": ({"model_type": "gemma2", "sliding_window": 64}, 64),
    "gemma2 all full": (
        {"model_type": "gemma2", "sliding_window": 64, "layer_types": ["full_attention"] * 2},
        None,
    ),
    "llama has none": ({"model_type": "llama", "sliding_window": 64}, None),
}


@pytest.mark.parametrize("name", list(WINDOWS))
def test_sliding_window_fields(name):
    cfg, window = WINDOWS[name]
    assert sliding_window_of(cfg) == window
    c = config_from_dict(cfg | {"max_position_embeddings": 8192})
    assert c.sliding_window == window
    assert c.max_model_len == min(8192, window or 8192)


def test_a_window_above_the_position_limit_changes_nothing():
    c = config_from_dict(
        {"model_type": "mistral", "sliding_window": 4096, "max_position_embeddings": 2048}
    )
    assert c.max_model_len == 2048


def _checkpoint(tmp_path, cfg: dict):
    d = tmp_path / "m"
    write_fake_checkpoint(d)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_validate_notes_the_capped_context_in_one_line(tmp_path):
    d = _checkpoint(
        tmp_path,
        {
            "architectures": ["MistralForCausalLM"],
            "model_type": "mistral",
            "sliding_window": 256,
            "max_position_embeddings": 4096,
        },
    )
    note = validate_checkpoint(d).context_note
    assert note is not None and "\n" not in note
    assert "sliding_window 256 < max_position_embeddings 4096: serving a context of 256" in note
    (d / "config.json").write_text(json.dumps({"model_type": "mistral", "sliding_window": None}))
    assert validate_checkpoint(d).context_note is None


def test_a_window_too_short_to_serve_is_refused(tmp_path):
    w = MIN_WINDOW_LEN - 1
    d = _checkpoint(tmp_path, {"model_type": "mixtral", "sliding_window": w})
    with pytest.raises(CheckpointError, match=f"sliding_window {w} is under {MIN_WINDOW_LEN}") as e:
        validate_checkpoint(d)
    assert "\n" not in str(e.value)


def test_moe_architectures_pass_validate_and_others_are_refused_naming_them(tmp_path):
    assert {"Qwen3MoeForCausalLM", "MixtralForCausalLM"} <= set(SUPPORTED)
    d = _checkpoint(tmp_path, QWEN3_MOE)
    assert validate_checkpoint(d).architecture == "Qwen3MoeForCausalLM"
    (d / "config.json").write_text(json.dumps(QWEN3_MOE | {"num_experts_per_tok": 99}))
    with pytest.raises(CheckpointError, match="num_experts_per_tok 99 exceeds"):
        validate_checkpoint(d)
    (d / "config.json").write_text(json.dumps({"architectures": ["JambaForCausalLM"]}))
    with pytest.raises(CheckpointError, match=r"Qwen3MoeForCausalLM, MixtralForCausalLM"):
        validate_checkpoint(d)


def test_phi3_rope_it_cannot_apply_is_one_line():
    base = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3"}
    partial = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}
    with pytest.raises(CheckpointError, match="partial_rotary_factor 0.75 is not supported"):
        config_from_dict(base | {"rope_parameters": partial})
    longrope = {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}
    with pytest.raises(CheckpointError, match="unsupported rope_type 'longrope'"):
        config_from_dict(base | {"rope_scaling": longrope})
    c = config_from_dict(base | {"rope_parameters": partial | {"partial_rotary_factor": 1.0}})
    assert c.rope_scaling is None and c.intermediate_size == 8192


def test_gemma2_fields_and_defaults():
    c = config_from_dict({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"})
    assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (50.0, 30.0)
    assert c.query_pre_attn_scalar == 256 and c.head_dim == 256 and c.tie_word_embeddings
    assert c.hidden_act == "gelu_pytorch_tanh" and c.max_model_len == 4096  # window 4096 < 8192
    off = {"model_type": "gemma2", "attn_logit_softcapping": None, "sliding_window": None}
    c = config_from_dict(off | {"hidden_activation": "gelu", "tie_word_embeddings": False})
    assert c.attn_logit_softcapping is None and c.max_model_len == 8192
    assert c.hidden_act == "gelu" and not c.tie_word_embeddings
    with pytest.raises(CheckpointError, match="use_bidirectional_attention is not supported"):
        config_from_dict({"model_type": "gemma2", "use_bidirectional_attention": True})


def test_a_llava_around_gemma2_is_refused_in_one_line(tmp_path):
    """LLaVA's language model is the Llama-family class; Gemma-2's layers are not."""
    llava = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava"}
    bad = llava | {"text_config": {"model_type": "gemma2"}}
    with pytest.raises(CheckpointError, match="unsupported LLaVA text model_type 'gemma2'"):
        validate_checkpoint(_checkpoint(tmp_path, bad))
    with pytest.raises(CheckpointError, match="unsupported LLaVA text model_type 'gemma2'"):
        config_from_dict(bad)
    moe = llava | {"text_config": {"model_type": "qwen3_moe", "num_experts": 4}}
    assert config_from_dict(moe).num_experts == 4
