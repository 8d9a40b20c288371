"""Config parsing of Qwen2-MoE, Granite, OLMo-2 and Gemma-3 (`config_from_dict`, torch-free
`validate_checkpoint`): each family's transformers defaults when a key is missing, the 4.x and
5.x spellings, and one clear line for what Strata cannot serve."""

from __future__ import annotations

import json

import pytest

from shared.model.archs import LLAVA_TEXT_TYPES, SUPPORTED, sliding_window_of
from shared.model.config import config_from_dict
from shared.model.errors import CheckpointError
from shared.model.parallel import check_shardable
from shared.model.validate import validate_checkpoint
from tests.infra.fake_apps import write_fake_checkpoint

NEW = {
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "granite": "GraniteForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}


def _cfg(model_type: str, **kw) -> dict:
    return {"architectures": [NEW[model_type]], "model_type": model_type, **kw}


def test_qwen2_moe_defaults_and_keys():
    c = config_from_dict(_cfg("qwen2_moe", num_hidden_layers=4))
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (60, 4, 1408)
    assert c.shared_expert_intermediate_size == 5632 and c.intermediate_size == 5632
    assert c.moe_layers == (0, 1, 2, 3) and not c.norm_topk_prob and not c.qk_norm
    assert c.attention_bias and not c.o_proj_bias  # qkv bias by default, never on o_proj
    c = config_from_dict(
        _cfg(
            "qwen2_moe",
            num_hidden_layers=6,
            num_local_experts=8,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
            qkv_bias=False,
            norm_topk_prob=True,
            shared_expert_intermediate_size=64,
        )
    )
    assert c.num_experts == 8 and c.moe_layers == (1, 5) and c.norm_topk_prob
    assert not c.attention_bias and c.shared_expert_intermediate_size == 64
    with pytest.raises(CheckpointError, match="num_experts_per_tok 9 exceeds the 8 experts"):
        config_from_dict(_cfg("qwen2_moe", num_experts=8, num_experts_per_tok=9))


def test_granite_defaults_and_multipliers():
    c = config_from_dict(_cfg("granite"))
    assert (c.embedding_multiplier, c.residual_multiplier, c.logits_scaling) == (1.0, 1.0, 1.0)
    assert c.attention_multiplier == 1.0  # transformers' default scale is 1, not head_dim^-1/2
    assert c.max_position_embeddings == 2048 and not c.tie_word_embeddings
    c = config_from_dict(
        _cfg(
            "granite",
            embedding_multiplier=12,
            residual_multiplier=0.22,
            attention_multiplier=0.0078125,
            logits_scaling=16,
            attention_bias=True,
        )
    )
    assert (c.embedding_multiplier, c.residual_multiplier) == (12.0, 0.22)
    assert (c.attention_multiplier, c.logits_scaling) == (0.0078125, 16.0)
    assert c.attention_bias and c.o_proj_bias
    assert config_from_dict({"model_type": "llama"}).attention_multiplier is None


def test_olmo2_defaults_and_no_tensor_parallelism():
    c = config_from_dict(_cfg("olmo2", attention_bias=True))
    assert c.qk_norm and c.rms_norm_eps == 1e-5 and c.attention_bias and c.o_proj_bias
    assert c.sliding_window is None
    check_shardable(c, 1)
    with pytest.raises(CheckpointError, match="does not shard OLMo-2: its q/k norm spans"):
        check_shardable(c, 2)


def test_gemma3_defaults():
    c = config_from_dict(_cfg("gemma3_text", num_hidden_layers=8))
    assert c.head_dim == 256 and c.tie_word_embeddings and c.qk_norm
    assert c.hidden_act == "gelu_pytorch_tanh" and c.query_pre_attn_scalar == 256
    assert c.attn_logit_softcapping is None and c.final_logit_softcapping is None
    assert (c.rope_theta, c.rope_scaling, c.rope_local) == (1e6, None, (1e4, None))
    assert c.sliding_layers == (0, 1, 2, 3, 4, 6, 7)  # every 6th layer full
    assert c.sliding_window == 4096 and c.max_model_len == 4096


def test_gemma3_4x_keys():
    """4.x: rope_theta + rope_scaling (the global layers'), rope_local_base_freq,
    sliding_window_pattern; an attention cap in config.json is not applied (transformers'
    Gemma-3 attention ignores it)."""
    c = config_from_dict(
        _cfg(
            "gemma3_text",
            num_hidden_layers=4,
            rope_theta=1e6,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
            rope_local_base_freq=2e4,
            sliding_window_pattern=2,
            sliding_window=512,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        )
    )
    assert c.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert c.rope_local == (2e4, None) and c.sliding_layers == (0, 2)
    assert c.attn_logit_softcapping is None and c.final_logit_softcapping == 30.0
    assert c.max_model_len == 512


def test_gemma3_5x_rope_parameters_and_refusals():
    rope = {
        "full_attention": {"rope_type": "default", "rope_theta": 5e5},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
    }
    types = ["full_attention", "sliding_attention"]
    c = config_from_dict(_cfg("gemma3_text", rope_parameters=rope, layer_types=types))
    assert (c.rope_theta, c.rope_scaling) == (5e5, None)
    assert c.rope_local == (1e4, {"rope_type": "linear", "factor": 2.0})
    assert c.sliding_layers == (1,)
    full = ["full_attention"] * 2
    assert config_from_dict(_cfg("gemma3_text", layer_types=full)).sliding_window is None
    bad = dict(rope, sliding_attention={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(CheckpointError, match="unsupported rope_type 'yarn'"):
        config_from_dict(_cfg("gemma3_text", rope_parameters=bad))
    with pytest.raises(CheckpointError, match="use_bidirectional_attention is not supported"):
        config_from_dict(_cfg("gemma3_text", use_bidirectional_attention=True))


@pytest.mark.parametrize(
    "cfg,window",
    [
        ({"model_type": "qwen2_moe", "sliding_window": 64}, None),  # use_sliding_window off
        (  # default layer_types: every other layer below max_window_layers
            {"model_type": "qwen2_moe", "use_sliding_window": True, "sliding_window": 64},
            64,
        ),
        (
            {
                "model_type": "qwen2_moe",
                "use_sliding_window": True,
                "sliding_window": 64,
                "max_window_layers": 0,
            },
            None,
        ),
        ({"model_type": "granite", "sliding_window": 64}, None),
        ({"model_type": "olmo2", "sliding_window": 64}, None),
        ({"model_type": "gemma3_text", "sliding_window": 64}, 64),
    ],
)
def test_sliding_window_of_the_new_families(cfg, window):
    assert sliding_window_of(cfg) == window


def _checkpoint(tmp_path, cfg: dict):
    d = tmp_path / "m"
    write_fake_checkpoint(d)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("model_type", list(NEW))
def test_validate_accepts_them(tmp_path, model_type):
    assert NEW[model_type] in SUPPORTED
    info = validate_checkpoint(_checkpoint(tmp_path, _cfg(model_type, max_position_embeddings=64)))
    assert info.architecture == NEW[model_type] and not info.multimodal


def test_unknown_architectures_are_refused_naming_the_new_ones(tmp_path):
    d = _checkpoint(tmp_path, {"architectures": ["Gemma3ForConditionalGeneration"]})
    with pytest.raises(CheckpointError) as e:
        validate_checkpoint(d)
    msg = str(e.value)
    assert "\n" not in msg and "unsupported architecture 'Gemma3ForConditionalGeneration'" in msg
    assert all(arch in msg for arch in NEW.values())


@pytest.mark.parametrize("model_type", ["granite", "olmo2", "gemma3_text"])
def test_a_llava_around_a_family_with_its_own_layers_is_refused(tmp_path, model_type):
    """LLaVA's language model is the Llama-family class; these have layers of their own."""
    llava = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava"}
    bad = llava | {"text_config": {"model_type": model_type}}
    with pytest.raises(CheckpointError, match=f"unsupported LLaVA text model_type '{model_type}'"):
        validate_checkpoint(_checkpoint(tmp_path, bad))
    assert "qwen2_moe" in LLAVA_TEXT_TYPES  # Qwen2-MoE is the Llama-family class with experts
