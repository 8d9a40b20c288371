"""OpenAI's gpt-oss (``gpt_oss``, ``GptOssForCausalLM``) config fields, torch-free, as
transformers 5.x reads them: the shapes (its defaults where config.json lacks a key), YaRN RoPE
(the default when neither ``rope_parameters`` nor ``rope_scaling`` is given), the biased
attention, and the router (`SinkRouting`: a softmax over the top-k of a biased router's logits,
experts with biases gated by the clamped SwiGLU). `check_gpt_oss` refuses, in one line each,
what Strata cannot serve: an MXFP4 (or any other) ``quantization_config``, a top-k above the
experts, a RoPE type other than default / linear / llama3 / YaRN, an odd head dim."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.model.config_fields import rope_fields
from shared.model.deepseek_config import rope_scales
from shared.model.errors import CheckpointError

GPT_OSS = "gpt_oss"

# transformers 5.x's GptOssConfig defaults
_DEFAULTS: dict[str, Any] = dict(
    vocab_size=201088,
    hidden_size=2880,
    intermediate_size=2880,
    num_hidden_layers=36,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    num_local_experts=128,
    num_experts_per_tok=4,
    swiglu_alpha=1.702,
    swiglu_limit=7.0,
    attention_bias=True,
    max_position_embeddings=131072,
)
# the RoPE GptOssConfig sets when config.json gives none (rope_theta: 150000, `archs`)
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


@dataclass(frozen=True)
class SinkRouting:
    """GPT-OSS's router for `shared.model.moe.SparseMoE` (``ModelConfig.routing``): the
    ``num_experts_per_tok`` largest logits of ``mlp.router`` (a linear with a bias), softmaxed
    among themselves (`moe.route_topk_softmax`); every expert's gate/up and down projections have
    a bias and its gating is `moe.clamped_swiglu` with ``swiglu = (alpha, limit)``. No
    correction bias, no shared experts (the fields `SparseMoE` reads of DeepSeek's `Routing`)."""

    swiglu: tuple[float, float]
    scoring: str = "topk_softmax"
    router_bias: bool = True
    expert_bias: bool = True
    correction_bias: bool = False
    shared_width: int = 0


def _get(cfg: dict, key: str) -> Any:
    value = cfg.get(key)
    return _DEFAULTS[key] if value is None else value


def _experts(cfg: dict) -> int:
    return int(cfg.get("num_local_experts", cfg.get("num_experts", _DEFAULTS["num_local_experts"])))


def _with_rope(cfg: dict) -> dict:
    """``cfg`` with GptOssConfig's default YaRN where it sets no RoPE of its own."""
    if cfg.get("rope_parameters") is None and cfg.get("rope_scaling") is None:
        return {**cfg, "rope_parameters": dict(DEFAULT_ROPE)}  # theta: `rope_fields`' default
    return cfg


def check_gpt_oss(cfg: dict, source: str) -> None:
    """One `CheckpointError` line for a gpt-oss config Strata cannot serve (see the module
    doc); other model types: nothing."""
    if cfg.get("model_type") != GPT_OSS:
        return
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise CheckpointError(
            f"{source}: quantized gpt-oss (quantization_config quant_method {method!r}) is not "
            "supported; Strata serves unquantized (bf16 / float32) gpt-oss weights"
        )
    experts, top_k = _experts(cfg), int(_get(cfg, "num_experts_per_tok"))
    if top_k > experts:
        raise CheckpointError(
            f"{source}: num_experts_per_tok {top_k} exceeds the {experts} experts per layer; "
            "fix config.json"
        )
    params = _with_rope(cfg)
    params = params.get("rope_parameters") or params.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type")) if isinstance(params, dict) else None
    if kind not in (None, "default", "linear", "llama3", "yarn"):
        raise CheckpointError(f"{source}: unsupported rope_type {kind!r}")
    if kind == "yarn" and params.get("factor") is None:
        raise CheckpointError(f"{source}: YaRN rope parameters without 'factor'; fix config.json")
    head_dim = int(_get(cfg, "head_dim"))
    if head_dim < 2 or head_dim % 2:
        raise CheckpointError(
            f"{source}: head_dim {head_dim} must be even and at least 2 (RoPE rotates pairs)"
        )


def attention_factor(scaling: dict | None, head_dim: int) -> float:
    """What YaRN multiplies RoPE's cos and sin by (1 for the other RoPEs), as transformers."""
    return rope_scales(scaling, head_dim)[1]


def gpt_oss_fields(cfg: dict, source: str) -> dict[str, Any]:
    """The `ModelConfig` fields of a gpt-oss config over the Llama-family reading (other
    models: none). Every layer is a sparse MoE layer of ``num_local_experts`` experts of width
    ``intermediate_size``; ``attention_bias`` (default on) biases q/k/v and o_proj."""
    if cfg.get("model_type") != GPT_OSS:
        return {}
    g = lambda k: _get(cfg, k)  # noqa: E731
    rope = rope_fields(_with_rope(cfg), source)
    scaling = rope["rope_scaling"]
    if scaling and scaling.get("rope_type") == "yarn":  # as transformers: the position limit
        limit = int(g("max_position_embeddings"))
        scaling = {"original_max_position_embeddings": limit, **scaling}
    layers, width = int(g("num_hidden_layers")), int(g("intermediate_size"))
    heads = int(g("num_attention_heads"))
    bias = bool(g("attention_bias"))
    return dict(
        vocab_size=int(g("vocab_size")),
        hidden_size=int(g("hidden_size")),
        intermediate_size=width,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(g("num_key_value_heads")),
        head_dim=int(g("head_dim")),
        rope_theta=rope["rope_theta"],
        rope_scaling=scaling,
        attention_bias=bias,
        o_proj_bias=bias,
        mlp_bias=False,
        qk_norm=False,
        num_experts=_experts(cfg),
        num_experts_per_tok=int(g("num_experts_per_tok")),
        moe_intermediate_size=width,
        norm_topk_prob=False,
        moe_layers=tuple(range(layers)),
        routing=SinkRouting(swiglu=(float(g("swiglu_alpha")), float(g("swiglu_limit")))),
    )
