"""The `ModelConfig` fields read per family from a parsed ``config.json`` the way transformers
reads them (torch-free): RoPE (one for every layer, or Gemma-3's global and local pair), the
experts of Qwen3-MoE, Qwen2-MoE and Mixtral, Gemma-2 / Gemma-3's soft-capping and attention
scale, Granite's multipliers."""

from __future__ import annotations

from typing import Any

from shared.model.archs import TEXT_FAMILIES, layer_types_of
from shared.model.errors import CheckpointError

_ROPE_TYPES = ("llama3", "linear")  # besides "default"


def _one_rope(params: dict, source: str) -> tuple[float, dict | None]:
    """``(theta, scaling or None for the default RoPE)`` of one set of rope parameters."""
    theta = float(params["rope_theta"])
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    partial = float(scaling.pop("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise CheckpointError(
            f"{source}: partial_rotary_factor {partial} is not supported (RoPE on the whole head)"
        )
    if scaling.get("rope_type", "default") == "default":
        return theta, None
    if scaling["rope_type"] not in _ROPE_TYPES:
        raise CheckpointError(f"{source}: unsupported rope_type {scaling['rope_type']!r}")
    return theta, scaling


def rope_fields(cfg: dict, source: str) -> dict[str, Any]:
    """``rope_theta`` / ``rope_scaling`` from the 4.x layout (``rope_theta``, ``rope_scaling``)
    or 5.x's ``rope_parameters``; Gemma-3 also ``rope_local`` (its sliding layers' RoPE: 5.x
    ``rope_parameters`` keyed by layer type, 4.x ``rope_local_base_freq``, default 10000).
    ``partial_rotary_factor`` other than 1 and rope types but linear / llama3 are refused."""
    model_type = cfg.get("model_type", "llama")
    theta = float(cfg.get("rope_theta", TEXT_FAMILIES[model_type][1].get("rope_theta", 1e4)))
    params = cfg.get("rope_parameters")
    if model_type == "gemma3_text" and isinstance(params, dict) and "full_attention" in params:
        full, local = dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
    elif isinstance(params, dict):
        full, local = dict(params), {}
    else:
        full, local = dict(cfg.get("rope_scaling") or {}), {}
    full.setdefault("rope_theta", theta)
    if "partial_rotary_factor" in cfg:
        full.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    theta, scaling = _one_rope(full, source)
    out: dict[str, Any] = dict(rope_theta=theta, rope_scaling=scaling)
    if model_type == "gemma3_text":
        local.setdefault("rope_theta", cfg.get("rope_local_base_freq", 1e4))
        out["rope_local"] = _one_rope(local, source)
    return out


def gemma_fields(cfg: dict, source: str) -> dict[str, Any]:
    """Gemma-2 / Gemma-3's soft-capping and attention scale, and Gemma-3's sliding layers (the
    ones on the local RoPE); other models: none. Gemma-3 takes no attention cap: transformers
    5.x's Gemma-3 attention never applies ``attn_logit_softcapping``."""
    model_type = cfg.get("model_type")
    if model_type not in ("gemma2", "gemma3_text"):
        return {}
    if cfg.get("use_bidirectional_attention"):
        raise CheckpointError(f"{source}: use_bidirectional_attention is not supported")
    gemma2 = model_type == "gemma2"
    attn = cfg.get("attn_logit_softcapping", 50.0) if gemma2 else None
    final = cfg.get("final_logit_softcapping", 30.0 if gemma2 else None)
    out = dict(
        attn_logit_softcapping=None if attn is None else float(attn),
        final_logit_softcapping=None if final is None else float(final),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
    )
    if not gemma2:
        types = layer_types_of(cfg)
        out["sliding_layers"] = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return out


def granite_fields(cfg: dict) -> dict[str, Any]:
    """Granite's scalars (transformers' defaults 1.0; other models: none). The attention scale
    is ``attention_multiplier`` itself, not ``head_dim ** -0.5``."""
    if cfg.get("model_type") != "granite":
        return {}
    keys = ("embedding_multiplier", "residual_multiplier", "attention_multiplier")
    return {k: float(cfg.get(k, 1.0)) for k in (*keys, "logits_scaling")}


def moe_fields(cfg: dict) -> dict[str, Any]:
    """Expert settings as transformers reads them (dense models: all zero). Qwen3-MoE /
    Qwen2-MoE: a layer ``i`` is sparse unless listed in ``mlp_only_layers`` and when ``(i + 1) %
    decoder_sparse_step == 0``; Qwen2-MoE adds a shared expert to each sparse layer; Mixtral:
    every layer, top-k always renormalised."""
    model_type = cfg.get("model_type")
    if model_type not in ("qwen3_moe", "qwen2_moe", "mixtral"):
        return {}
    n_layers = int(cfg.get("num_hidden_layers", 24 if model_type == "qwen2_moe" else 32))
    default = {"qwen3_moe": 128, "qwen2_moe": 60, "mixtral": 8}[model_type]
    experts = int(cfg.get("num_experts", cfg.get("num_local_experts", default)))
    if model_type == "mixtral":
        return dict(
            num_experts=experts,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok", 2)),
            moe_intermediate_size=int(
                cfg.get("intermediate_size", TEXT_FAMILIES[model_type][1]["intermediate_size"])
            ),
            norm_topk_prob=True,
            moe_layers=tuple(range(n_layers)),
        )
    step = int(cfg.get("decoder_sparse_step", 1))
    dense = {int(i) for i in cfg.get("mlp_only_layers") or ()}
    sparse = tuple(
        i for i in range(n_layers) if i not in dense and experts > 0 and (i + 1) % step == 0
    )
    qwen2 = model_type == "qwen2_moe"
    out = dict(
        num_experts=experts,
        num_experts_per_tok=int(cfg.get("num_experts_per_tok", 4 if qwen2 else 8)),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size", 1408 if qwen2 else 768)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        moe_layers=sparse,
    )
    if qwen2:
        out["shared_expert_intermediate_size"] = int(
            cfg.get("shared_expert_intermediate_size", 5632)
        )
    return out
