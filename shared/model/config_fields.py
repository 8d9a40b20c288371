"""The `ModelConfig` fields only some families have, read from a parsed ``config.json`` the way
transformers reads them (torch-free): the experts of Qwen3-MoE and Mixtral, Gemma-2's
soft-capping and attention scale."""

from __future__ import annotations

from typing import Any

from shared.model.archs import TEXT_FAMILIES
from shared.model.errors import CheckpointError


def gemma2_fields(cfg: dict, source: str) -> dict[str, Any]:
    """Gemma-2's soft-capping and attention scale (other models: none)."""
    if cfg.get("model_type") != "gemma2":
        return {}
    if cfg.get("use_bidirectional_attention"):
        raise CheckpointError(f"{source}: use_bidirectional_attention is not supported")
    caps = {
        k: cfg.get(k, d)
        for k, d in (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0))
    }
    return dict(
        **{k: None if v is None else float(v) for k, v in caps.items()},
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
    )


def moe_fields(cfg: dict) -> dict[str, Any]:
    """Expert settings as transformers reads them (dense models: all zero). Qwen3-MoE: a layer
    ``i`` is sparse unless listed in ``mlp_only_layers`` and when ``(i + 1) %
    decoder_sparse_step == 0``; Mixtral: every layer, top-k always renormalised."""
    model_type = cfg.get("model_type")
    if model_type not in ("qwen3_moe", "mixtral"):
        return {}
    n_layers = int(cfg.get("num_hidden_layers", 32))
    experts = int(
        cfg.get(
            "num_experts", cfg.get("num_local_experts", 128 if model_type == "qwen3_moe" else 8)
        )
    )
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
    return dict(
        num_experts=experts,
        num_experts_per_tok=int(cfg.get("num_experts_per_tok", 8)),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size", 768)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        moe_layers=sparse,
    )
