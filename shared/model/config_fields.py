"""The `ModelConfig` fields read per family from a parsed ``config.json`` the way transformers
reads them (torch-free): RoPE (one for every layer, or Gemma-3 / OLMo-3's global and local
pair; SmolLM3's NoPE layers), the experts of Qwen3-MoE, Qwen2-MoE and Mixtral, Gemma-2 /
Gemma-3's soft-capping and attention scale, Granite's multipliers, Phi / StarCoder2's
LayerNorm eps, biases and q/k LayerNorm, and Phi's ``partial_rotary_factor``
(`check_phi_rotary` refuses one that cannot rotate)."""

from __future__ import annotations

from typing import Any

from shared.model.archs import TEXT_FAMILIES, layer_types_of, rope_layers_of
from shared.model.config_more import hunyuan_rope
from shared.model.errors import CheckpointError

_ROPE_TYPES = ("llama3", "linear")  # besides "default"
_LOCAL_ROPE = ("gemma3_text", "olmo3")  # sliding layers on a RoPE of their own
_YARN = ("deepseek_v3", "deepseek_v2")  # also YaRN (`models/deepseek.py` computes it)
_PARTIAL = ("phi", "glm", "glm4")  # RoPE on part of each head (`partial_rotary_of`, default half)
_PARTIAL += ("gpt_neox", "stablelm")  # theirs a quarter by default (GPT-NeoX: rotary_pct)
_PARTIAL += ("nemotron",)  # half by default
_YARN += ("arcee",)  # AFM-4.5B's (`models/arcee.py`)
_YARN += ("gpt_oss",)  # its default RoPE (`models/gpt_oss.py`)


def _one_rope(params: dict, source: str, yarn: bool = False) -> tuple[float, dict | None]:
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
    if scaling["rope_type"] not in _ROPE_TYPES + ("yarn",) * yarn:
        raise CheckpointError(f"{source}: unsupported rope_type {scaling['rope_type']!r}")
    return theta, scaling


def rope_fields(cfg: dict, source: str) -> dict[str, Any]:
    """``rope_theta`` / ``rope_scaling`` from the 4.x layout (``rope_theta``, ``rope_scaling``)
    or 5.x's ``rope_parameters``; Gemma-3 and OLMo-3 also ``rope_local`` and ``sliding_layers``
    (the sliding layers' RoPE: 5.x ``rope_parameters`` keyed by layer type; 4.x Gemma-3's
    ``rope_local_base_freq``, default 10000, OLMo-3's ``rope_theta`` without the scaling);
    SmolLM3 ``nope_layers`` (the 0s of ``no_rope_layers``). ``partial_rotary_factor`` other
    than 1 and rope types but linear / llama3 are refused."""
    model_type = cfg.get("model_type", "llama")
    theta = float(cfg.get("rope_theta", TEXT_FAMILIES[model_type][1].get("rope_theta", 1e4)))
    if model_type == "gpt_neox":  # rotary_emb_base (5.x ignores a top-level rope_theta)
        theta = float(cfg.get("rotary_emb_base", 1e4))
    params = cfg.get("rope_parameters")
    typed = model_type in _LOCAL_ROPE
    if typed and isinstance(params, dict) and "full_attention" in params:
        full, local = dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
    elif isinstance(params, dict):
        full, local = dict(params), {}
    else:
        full, local = dict(cfg.get("rope_scaling") or {}), {}
    full.setdefault("rope_theta", theta)
    if model_type == "hunyuan_v1_dense":  # its dynamic (NTK-alpha) RoPE as a fixed base
        full = hunyuan_rope(full, cfg)
    gemma3 = model_type == "gemma3_text"
    local.setdefault("rope_theta", cfg.get("rope_local_base_freq", 1e4) if gemma3 else None)
    if local["rope_theta"] is None:  # OLMo-3's sliding layers: the global base, unscaled
        local["rope_theta"] = full["rope_theta"]
    if "partial_rotary_factor" in cfg:
        full.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    if model_type in _PARTIAL:  # RoPE on part of each head (`check_phi_rotary`), default half
        full["partial_rotary_factor"] = 1.0
    theta, scaling = _one_rope(full, source, yarn=model_type in _YARN)
    out: dict[str, Any] = dict(rope_theta=theta, rope_scaling=scaling)
    if model_type in _PARTIAL:
        out["partial_rotary_factor"] = partial_rotary_of(cfg)
    if typed:
        out["rope_local"] = _one_rope(local, source)
        types = layer_types_of(cfg)
        out["sliding_layers"] = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if model_type == "smollm3":
        rope, n = rope_layers_of(cfg), int(cfg.get("num_hidden_layers", 36))
        if len(rope) < n:
            raise CheckpointError(
                f"{source}: no_rope_layers has {len(rope)} entries for {n} layers; fix config.json"
            )
        out["nope_layers"] = tuple(i for i in range(n) if not rope[i])
    return out


def partial_rotary_of(cfg: dict) -> float:
    """Phi's ``partial_rotary_factor`` as transformers reads it: ``rope_parameters``' (5.x),
    else the top-level key (4.x), else 0.5."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params.get("partial_rotary_factor") is not None:
        return float(params["partial_rotary_factor"])
    mt = cfg.get("model_type")
    if mt == "gpt_neox":  # GPT-NeoX's key is rotary_pct; it and StableLM default to a quarter
        return float(cfg.get("rotary_pct", 0.25))
    return float(cfg.get("partial_rotary_factor", 0.25 if mt == "stablelm" else 0.5))


def check_phi_rotary(cfg: dict, source: str) -> None:
    """Refuse a Phi config whose rotary part of the head (``int(head_dim *
    partial_rotary_factor)`` dims, as transformers cuts it) is not a positive even size (RoPE
    rotates dims in pairs); one line naming the field."""
    heads = int(cfg.get("num_attention_heads", 32))
    head_dim = int(cfg.get("head_dim") or int(cfg.get("hidden_size", 4096)) // heads)
    partial = partial_rotary_of(cfg)
    rot = int(head_dim * partial)
    if not 0.0 < partial <= 1.0 or rot < 2 or rot % 2:
        raise CheckpointError(
            f"{source}: partial_rotary_factor {partial} gives {rot} rotary dims of the "
            f"{head_dim}-dim head; Strata rotates an even number of them, at least 2"
        )


def layernorm_fields(cfg: dict) -> dict[str, Any]:
    """Phi / StarCoder2 (LayerNorm families; other models: none), over the Llama-family
    reading: the norm eps (``layer_norm_eps`` / ``norm_epsilon``), biases (Phi: on every
    projection; StarCoder2: ``use_bias``, default on), Phi's ``qk_layernorm`` (as ``qk_norm``),
    StarCoder2's default of 2 KV heads."""
    model_type = cfg.get("model_type")
    if model_type not in ("phi", "starcoder2"):
        return {}
    phi = model_type == "phi"
    bias = phi or bool(cfg.get("use_bias", True))
    out: dict[str, Any] = dict(
        rms_norm_eps=float(cfg.get("layer_norm_eps" if phi else "norm_epsilon", 1e-5)),
        attention_bias=bias,
        o_proj_bias=bias,
        mlp_bias=bias,
        qk_norm=phi and bool(cfg.get("qk_layernorm", False)),
    )
    if not phi and not cfg.get("num_key_value_heads"):
        out["num_kv_heads"] = 2
    return out


def gemma_fields(cfg: dict, source: str) -> dict[str, Any]:
    """Gemma-2 / Gemma-3's soft-capping and attention scale; other models (Gemma 1 included:
    no cap, scale ``head_dim ** -0.5``): none. Gemma-3 takes no attention cap: transformers
    5.x's Gemma-3 attention never applies ``attn_logit_softcapping``."""
    model_type = cfg.get("model_type")
    if model_type not in ("gemma", "gemma2", "gemma3_text"):
        return {}
    if cfg.get("use_bidirectional_attention"):
        raise CheckpointError(f"{source}: use_bidirectional_attention is not supported")
    if model_type == "gemma":
        return {}
    gemma2 = model_type == "gemma2"
    attn = cfg.get("attn_logit_softcapping", 50.0) if gemma2 else None
    final = cfg.get("final_logit_softcapping", 30.0 if gemma2 else None)
    return dict(
        attn_logit_softcapping=None if attn is None else float(attn),
        final_logit_softcapping=None if final is None else float(final),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
    )


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
