"""The `ModelConfig` fields of the mixture-of-experts families built on a dense family's layer,
read from a parsed ``config.json`` as transformers 5.x reads them (torch-free: `validate_checkpoint`
runs `check_moe_families` before any torch import):

* OLMoE (``olmoe``): Llama's pre-norm layer, q/k RMSNorm over the whole q and k projections
  (OLMo-2's), q/k/v/o bias ``attention_bias``, softmax top-k (``norm_topk_prob``) in every layer;
* GraniteMoE (``granitemoe``) and GraniteMoeShared (``granitemoeshared``): Granite's four
  multipliers, top-k of the router logits then a softmax over those k (`MoeRouting`
  ``topk_softmax_float32``), experts stored fused (``input_linear`` / ``output_linear``);
  GraniteMoeShared adds a gated MLP every token runs (``shared_intermediate_size``, 0: none);
* PhiMoE (``phimoe``): LayerNorms, q/k/v/o bias ``attention_bias``, LM head bias
  ``lm_head_bias``, the sparsemixer top-2 router (`MoeRouting` ``sparsemixer``, its threshold
  ``router_jitter_noise``), a window over every layer (``sliding_window``, default none);
* ERNIE 4.5 MoE (``ernie4_5_moe``): ERNIE 4.5's layer (interleaved RoPE, ``use_bias``), dense
  layers outside ``moe_layer_start_index .. moe_layer_end_index`` (every ``moe_layer_interval``-th
  inside), float32 softmax router choosing on the scores plus ``e_score_correction_bias``, the
  chosen scores renormalised (sum clamped at ``moe_norm_min``), ungated shared experts.

Missing keys take each family's transformers defaults (``_DEFAULTS``); `check_moe_families`
refuses, in one line, what these classes (or transformers) cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.model.config_fields import rope_fields
from shared.model.errors import CheckpointError

# transformers 5.x's defaults: vocab, hidden, intermediate, layers, heads, KV heads (None: heads),
# experts, top-k
_DEFAULTS: dict[str, tuple[int, int, int, int, int, int | None, int, int]] = {
    "olmoe": (50304, 2048, 2048, 16, 16, None, 64, 8),
    "granitemoe": (32000, 4096, 11008, 32, 32, None, 8, 2),
    "granitemoeshared": (32000, 4096, 11008, 32, 32, None, 8, 2),
    "phimoe": (32064, 4096, 6400, 32, 32, 8, 16, 2),
    "ernie4_5_moe": (103424, 2560, 12288, 28, 20, 4, 64, 6),
}
MOE_FAMILY_TYPES = tuple(_DEFAULTS)
_GRANITE = ("granitemoe", "granitemoeshared")
# the config keys of the expert count and top-k, each family's first (the others: aliases
# transformers' attribute_map accepts)
_EXPERTS = {"olmoe": ("num_experts", "num_local_experts"), "ernie4_5_moe": ("moe_num_experts",)}
_EXPERTS["ernie4_5_moe"] += ("num_experts",)
_TOP_K = {"ernie4_5_moe": ("moe_k", "num_experts_per_tok")}


@dataclass(frozen=True)
class MoeRouting:
    """A router for `shared.model.moe.SparseMoE` (``ModelConfig.routing``; the attribute names of
    DeepSeek's `Routing`, which `SparseMoE` reads). ``scoring``: ``"topk_softmax_float32"`` (Granite:
    the top-k router logits, then a softmax over those k), ``"sparsemixer"`` (PhiMoE, top-2;
    ``jitter_eps`` its threshold) or ``"softmax"`` (ERNIE: `moe.route_grouped` on float32
    logits with the correction bias, the sum clamped at ``norm_min``); ``shared_width``: the
    ungated shared experts' MLP width (``mlp.shared_experts``; 0: none)."""

    scoring: str
    group_score: str | None = None
    n_group: int = 1
    topk_group: int = 1
    correction_bias: bool = False
    scaling: float = 1.0
    shared_width: int = 0
    jitter_eps: float = 0.0
    norm_min: float | None = None


def _first(cfg: dict, keys: tuple[str, ...], default: Any) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def _shape(cfg: dict) -> dict[str, Any]:
    mt = cfg["model_type"]
    vocab, hidden, inter, layers, heads, kv, experts, top_k = _DEFAULTS[mt]
    heads = int(cfg.get("num_attention_heads", heads))
    hidden = int(cfg.get("hidden_size", hidden))
    return dict(
        vocab=int(cfg.get("vocab_size", vocab)),
        hidden=hidden,
        inter=int(cfg.get("intermediate_size", inter)),
        layers=int(cfg.get("num_hidden_layers", layers)),
        heads=heads,
        kv=int(cfg.get("num_key_value_heads") or kv or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        experts=int(_first(cfg, _EXPERTS.get(mt, ("num_local_experts",)), experts)),
        top_k=int(_first(cfg, _TOP_K.get(mt, ("num_experts_per_tok",)), top_k)),
    )


def _ernie_moe_layers(cfg: dict, layers: int) -> tuple[int, ...]:
    """ERNIE 4.5 MoE's sparse layers: ``(i + 1) % moe_layer_interval == 0`` within
    ``moe_layer_start_index .. moe_layer_end_index`` (-1: the last layer)."""
    start = int(cfg.get("moe_layer_start_index", 1))
    end = int(cfg.get("moe_layer_end_index", -1))
    end = layers - 1 if end == -1 else end
    every = int(cfg.get("moe_layer_interval", 1))
    return tuple(i for i in range(layers) if (i + 1) % every == 0 and start <= i <= end)


def moe_family_fields(cfg: dict, source: str) -> dict[str, Any]:
    """The `ModelConfig` fields of a family in `MOE_FAMILY_TYPES` over the Llama-family reading
    (other models: none; `check_moe_families` has run through `validate.check_decoder`)."""
    mt = cfg.get("model_type")
    if mt not in MOE_FAMILY_TYPES:
        return {}
    s = _shape(cfg)
    out: dict[str, Any] = dict(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=s["inter"],
        num_layers=s["layers"],
        num_heads=s["heads"],
        num_kv_heads=s["kv"],
        head_dim=s["head_dim"],
        num_experts=s["experts"],
        num_experts_per_tok=s["top_k"],
        moe_intermediate_size=s["inter"],
        moe_layers=tuple(range(s["layers"])),
        mlp_bias=False,
        qk_norm=False,
    )
    if mt == "ernie4_5_moe":
        bias = bool(cfg.get("use_bias", False))
        width = int(cfg.get("moe_intermediate_size", 1536))
        shared = int(cfg.get("moe_num_shared_experts", 2) or 0)
        norm_min = float(cfg.get("moe_norm_min", 1e-12))
        return out | dict(
            attention_bias=bias,
            o_proj_bias=bias,
            mlp_bias=bias,
            moe_intermediate_size=width,
            moe_layers=_ernie_moe_layers(cfg, s["layers"]),
            lm_head_bias=bias,  # unlike dense ERNIE 4.5's, its LM head takes use_bias
            norm_topk_prob=True,
            routing=MoeRouting(
                "softmax", correction_bias=True, shared_width=width * shared, norm_min=norm_min
            ),
        )
    bias = bool(cfg.get("attention_bias", False))  # q/k/v and o_proj in all four
    out |= dict(attention_bias=bias, o_proj_bias=bias)
    if mt == "olmoe":
        return out | dict(qk_norm=True, norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
    if mt == "phimoe":
        jitter = float(cfg.get("router_jitter_noise", 0.01))
        return out | dict(
            routing=MoeRouting("sparsemixer", jitter_eps=jitter),
            lm_head_bias=bool(cfg.get("lm_head_bias", False)),
        )
    keys = ("embedding_multiplier", "residual_multiplier", "attention_multiplier")
    shared = int(cfg.get("shared_intermediate_size", 0)) if mt == "granitemoeshared" else 0
    return (
        out
        | {k: float(cfg.get(k, 1.0)) for k in (*keys, "logits_scaling")}
        | dict(routing=MoeRouting("topk_softmax_float32", shared_width=shared))
    )


def check_moe_families(cfg: dict, source: str) -> None:
    """One `CheckpointError` line for a config of these families Strata cannot serve: a top-k
    above the expert count (or under 1), OLMoE's ``clip_qkv`` or a ``head_dim`` other than
    ``hidden_size / heads`` (transformers sizes its q/k norms by that split), PhiMoE's top-k
    other than 2 (its sparsemixer picks exactly two) or a RoPE other than the default
    (transformers' PhiMoE runs ``longrope`` with a per-batch mscale, and no other scaling); for
    every family, `config_fields.rope_fields`' refusals (a rope type but default / linear /
    llama3, a ``partial_rotary_factor``), here before any torch import."""
    mt = cfg.get("model_type")
    if mt not in MOE_FAMILY_TYPES:
        return
    s = _shape(cfg)
    if not 1 <= s["top_k"] <= s["experts"]:
        raise CheckpointError(
            f"{source}: num_experts_per_tok {s['top_k']} must be between 1 and the "
            f"{s['experts']} experts per layer; fix config.json"
        )
    if mt == "olmoe":
        if cfg.get("clip_qkv") is not None:
            raise CheckpointError(
                f"{source}: OLMoE clip_qkv {cfg['clip_qkv']} is not supported "
                "(q/k/v clipping); serve a checkpoint with clip_qkv null"
            )
        if s["head_dim"] * s["heads"] != s["hidden"]:
            raise CheckpointError(
                f"{source}: OLMoE head_dim {s['head_dim']} x {s['heads']} heads is not "
                f"hidden_size {s['hidden']} (its q/k norms span hidden_size)"
            )
    if mt == "phimoe":
        if s["top_k"] != 2:
            raise CheckpointError(
                f"{source}: PhiMoE num_experts_per_tok {s['top_k']} is not supported "
                "(its sparsemixer router picks exactly 2 experts)"
            )
        params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        kind = params.get("rope_type", params.get("type")) if isinstance(params, dict) else None
        if kind not in (None, "default"):
            raise CheckpointError(
                f"{source}: PhiMoE rope_type {kind!r} is not supported (the default RoPE only)"
            )
    rope_fields(cfg, source)  # rope types but default / linear / llama3, a partial rotary factor
