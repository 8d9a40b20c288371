"""DeepSeek-V3 / DeepSeek-V2 (``deepseek_v3`` / ``deepseek_v2``) config fields, torch-free: the
multi-head latent attention's shapes (`LatentAttention`), the router (`Routing`) and the
`ModelConfig` fields that differ from the Llama-family reading, as transformers 5.x reads them;
`check_deepseek` refuses, in one line each, what Strata (or transformers) cannot run."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from shared.model.config_fields import rope_fields
from shared.model.errors import CheckpointError

DEEPSEEK_TYPES = ("deepseek_v3", "deepseek_v2")

# transformers' defaults where they differ between the two (DeepseekV3Config / DeepseekV2Config)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": dict(
        vocab_size=129280,
        hidden_size=7168,
        num_hidden_layers=61,
        num_attention_heads=128,
        moe_intermediate_size=2048,
        n_shared_experts=1,
        n_routed_experts=256,
        routed_scaling_factor=2.5,
        n_group=8,
        topk_group=4,
        num_experts_per_tok=8,
        first_k_dense_replace=3,
        norm_topk_prob=True,
    ),
    "deepseek_v2": dict(
        vocab_size=102400,
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        moe_intermediate_size=1407,
        n_shared_experts=2,
        n_routed_experts=64,
        routed_scaling_factor=1.0,
        n_group=None,
        topk_group=None,
        num_experts_per_tok=None,
        first_k_dense_replace=0,
        norm_topk_prob=False,
    ),
}
_MLA_DEFAULTS = dict(
    kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128
)
_V2_TOPK = ("greedy", "group_limited_greedy")


@dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention (MLA) shapes. ``rope``: how the rotary part is laid out and
    rotated: ``"interleave"`` (V3 with ``rope_interleave``: pairs (x0, x1), (x2, x3)...),
    ``"half"`` (V3 without: rotate_half), ``"complex"`` (V2: interleaved pairs as complex
    numbers, in float32). ``scale``: the softmax scale, ``qk_head_dim ** -0.5`` times YaRN's
    ``mscale(factor, mscale_all_dim) ** 2``; ``attention_factor``: what YaRN multiplies cos and
    sin by (1 for other RoPEs)."""

    q_lora_rank: int | None  # None: one q_proj; else q_a_proj, q_a_layernorm, q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope: str
    scale: float
    attention_factor: float

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class Routing:
    """A DeepSeek router for `shared.model.moe.SparseMoE` (``ModelConfig.routing``; None there:
    softmax top-k, as Qwen-MoE / Mixtral). ``scoring``: ``"sigmoid"`` (V3) or ``"softmax"``
    (V2) of float32 router logits; ``group_score``: how a group of ``num_experts / n_group``
    experts is scored to keep the best ``topk_group`` groups, ``"top2_sum"`` (V3), ``"max"``
    (V2's group_limited_greedy) or None (V2's greedy: no group limit); ``correction_bias``: V3's
    ``e_score_correction_bias`` added to the scores for choosing (not for weighting);
    ``scaling``: ``routed_scaling_factor``; ``shared_width``: the ungated shared experts' MLP
    width (``moe_intermediate_size * n_shared_experts``, ``mlp.shared_experts``; 0: none)."""

    scoring: str
    group_score: str | None
    n_group: int
    topk_group: int
    correction_bias: bool
    scaling: float
    shared_width: int


def _get(cfg: dict, key: str) -> Any:
    mt = cfg.get("model_type", "deepseek_v3")
    if key in cfg:
        return cfg[key]
    return _DEFAULTS[mt][key] if key in _DEFAULTS[mt] else _MLA_DEFAULTS[key]


def _experts(cfg: dict) -> int:
    alias = "num_local_experts" if cfg.get("model_type") == "deepseek_v3" else "num_experts"
    return int(cfg.get("n_routed_experts", cfg.get(alias, _get(cfg, "n_routed_experts"))))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 * mscale * ln(factor) + 1`` (1 for ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_scales(scaling: dict | None, qk_head_dim: int) -> tuple[float, float]:
    """``(softmax scale, cos/sin attention factor)`` for the rope parameters ``scaling`` (None:
    the default RoPE), as transformers computes them for DeepSeek."""
    scale, factor = qk_head_dim**-0.5, 1.0
    if not scaling:
        return scale, factor
    if scaling.get("mscale_all_dim"):
        m = yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
        scale = scale * m * m
    if scaling["rope_type"] == "yarn":
        factor = scaling.get("attention_factor")
        if factor is None:
            f, ms, msa = (
                float(scaling["factor"]),
                scaling.get("mscale"),
                scaling.get("mscale_all_dim"),
            )
            if ms and msa:
                factor = yarn_mscale(f, float(ms)) / yarn_mscale(f, float(msa))
            else:
                factor = yarn_mscale(f)
    return scale, float(factor)


def check_deepseek(cfg: dict, source: str) -> None:
    """One `CheckpointError` line for a DeepSeek config Strata cannot serve: an odd
    ``qk_rope_head_dim``, a RoPE type other than default / linear / llama3 / YaRN, YaRN without
    ``factor``, V2's ``topk_method`` other than greedy /
    group_limited_greedy, a MoE layer without ``num_experts_per_tok``, a top-k above the
    experts, or groups that do not split the experts (or hold too few of them)."""
    mt = cfg.get("model_type")
    rope = int(_get(cfg, "qk_rope_head_dim"))
    if rope < 2 or rope % 2:
        raise CheckpointError(
            f"{source}: qk_rope_head_dim {rope} must be even and at least 2 (RoPE rotates pairs)"
        )
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type")) if isinstance(params, dict) else None
    if kind not in (None, "default", "linear", "llama3", "yarn"):
        raise CheckpointError(f"{source}: unsupported rope_type {kind!r}")
    if kind == "yarn" and params.get("factor") is None:
        raise CheckpointError(f"{source}: YaRN rope parameters without 'factor'; fix config.json")
    layers = int(_get(cfg, "num_hidden_layers"))
    if int(_get(cfg, "first_k_dense_replace")) >= layers:
        return  # every layer dense: no router
    experts, top_k = _experts(cfg), _get(cfg, "num_experts_per_tok")
    method = str(cfg.get("topk_method") or "greedy") if mt == "deepseek_v2" else "noaux_tc"
    if mt == "deepseek_v2" and method not in _V2_TOPK:
        raise CheckpointError(
            f"{source}: DeepSeek-V2 topk_method {method!r} is not supported (greedy or "
            "group_limited_greedy, as transformers runs them)"
        )
    if top_k is None:
        raise CheckpointError(f"{source}: num_experts_per_tok is not set; fix config.json")
    if int(top_k) > experts:
        raise CheckpointError(
            f"{source}: num_experts_per_tok {top_k} exceeds the {experts} experts per layer; "
            "fix config.json"
        )
    if method == "greedy":
        return
    groups, keep = _get(cfg, "n_group"), _get(cfg, "topk_group")
    if groups is None or keep is None or int(groups) < 1 or experts % int(groups):
        raise CheckpointError(
            f"{source}: n_group {groups} must divide the {experts} routed experts; fix config.json"
        )
    per, groups, keep = experts // int(groups), int(groups), int(keep)
    least = 2 if mt == "deepseek_v3" else 1  # V3 scores a group by its best two experts
    if per < least or not 1 <= keep <= groups or int(top_k) > keep * per:
        raise CheckpointError(
            f"{source}: routing {top_k} of {experts} experts in the best {keep} of {groups} "
            f"groups of {per} cannot be done; fix n_group / topk_group / num_experts_per_tok"
        )


def deepseek_fields(cfg: dict, source: str) -> dict[str, Any]:
    """The `ModelConfig` fields of a DeepSeek config over the Llama-family reading (other
    models: none). The RoPE is `config_fields.rope_fields`' (YaRN allowed; its
    ``original_max_position_embeddings`` defaults to ``max_position_embeddings``, as
    transformers does). The KV cache holds the latent: one KV head (``num_kv_heads`` 1, replicated
    on every tensor-parallel rank) of ``head_dim = kv_lora_rank + qk_rope_head_dim``, the normed
    latent and the rotated rope key, used as both K and V (docs/MODEL.md)."""
    mt = cfg.get("model_type")
    if mt not in DEEPSEEK_TYPES:
        return {}
    v3 = mt == "deepseek_v3"  # (`check_deepseek` ran in `validate.check_decoder`)
    g = lambda k: _get(cfg, k)  # noqa: E731
    q_lora = g("q_lora_rank")
    rope_scaling = rope_fields(cfg, source)["rope_scaling"]
    nope, rope, v = int(g("qk_nope_head_dim")), int(g("qk_rope_head_dim")), int(g("v_head_dim"))
    if rope_scaling and rope_scaling.get("rope_type") == "yarn":
        limit = cfg.get("max_position_embeddings", 4096 if v3 else 2048)
        rope_scaling = {"original_max_position_embeddings": limit, **rope_scaling}
    scale, att = rope_scales(rope_scaling, nope + rope)
    interleave = bool(cfg.get("rope_interleave", True)) if v3 else None
    mla = LatentAttention(
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(g("kv_lora_rank")),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=v,
        rope={True: "interleave", False: "half", None: "complex"}[interleave],
        scale=scale,
        attention_factor=att,
    )
    heads, layers = int(g("num_attention_heads")), int(g("num_hidden_layers"))
    experts, first = _experts(cfg), int(g("first_k_dense_replace"))
    method = str(cfg.get("topk_method") or "greedy")
    moe = tuple(range(first, layers)) if experts > 0 else ()
    width = int(g("moe_intermediate_size"))
    bias = bool(cfg.get("attention_bias", False))
    out: dict[str, Any] = dict(
        vocab_size=int(g("vocab_size")),
        hidden_size=int(g("hidden_size")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=1,  # the cached latent: one KV head that every query head attends to
        head_dim=mla.kv_lora_rank + rope,
        rope_scaling=rope_scaling,
        attention_bias=bias,  # q_a_proj and kv_a_proj_with_mqa
        o_proj_bias=bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)) and not v3,  # V3's MLPs never have one
        qk_norm=False,
        mla=mla,
    )
    if not moe:
        return out
    grouped = v3 or method == "group_limited_greedy"
    out.update(
        num_experts=experts,
        num_experts_per_tok=int(g("num_experts_per_tok")),
        moe_intermediate_size=width,
        # V2 (transformers 5.x) never renormalises the top-k weights, whatever norm_topk_prob says
        norm_topk_prob=bool(g("norm_topk_prob")) and v3,
        moe_layers=moe,
        routing=Routing(
            scoring="sigmoid" if v3 else "softmax",
            group_score=("top2_sum" if v3 else "max") if grouped else None,
            n_group=int(g("n_group")) if grouped else 1,
            topk_group=int(g("topk_group")) if grouped else 1,
            correction_bias=v3,
            scaling=float(g("routed_scaling_factor")),
            shared_width=width * int(g("n_shared_experts") or 0),
        ),
    )
    return out
