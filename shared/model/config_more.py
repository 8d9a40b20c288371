"""The `ModelConfig` fields of EXAONE-4, HunYuan-V1-Dense, Arcee and Nemotron, read from a parsed
``config.json`` as transformers 5.x reads them (torch-free: `validate_checkpoint` runs
`check_more` before any torch import):

* EXAONE-4 (``exaone4``): no bias anywhere (``attention_bias`` is ignored), per-head q/k
  RMSNorms before RoPE, norms on the attention and MLP outputs (OLMo-2's layer); the layers
  ``layer_types`` marks ``sliding_attention`` (default: all but every
  ``sliding_window_pattern``-th, 4) attend within ``sliding_window`` (default 4096), and while a
  window is set the other (full-attention) layers apply no RoPE (`ModelConfig.nope_layers`);
* HunYuan-V1-Dense (``hunyuan_v1_dense``): ``attention_bias`` on q/k/v/o, per-head q/k
  RMSNorms (``query_layernorm`` / ``key_layernorm``) applied after RoPE; its ``dynamic`` RoPE
  with an ``alpha`` is NTK-alpha scaling, a fixed base ``rope_theta * alpha ** (d / (d - 2))``
  (`hunyuan_rope`), and without one the plain base (dynamic NTK changes nothing up to
  ``max_position_embeddings``, past which Strata serves no sequence);
* Arcee (``arcee``): Llama's attention (``attention_bias`` on q/k/v/o) with an ungated MLP
  (``up_proj`` / ``down_proj``, ``mlp_bias``) on ``relu2``; YaRN RoPE allowed (AFM-4.5B's);
* Nemotron (``nemotron``): LayerNorm1p (``(1 + w)`` LayerNorm with bias, ``norm_eps``),
  ``attention_bias`` on q/k/v/o, the ungated ``relu2`` MLP with ``mlp_bias``, RoPE on
  ``partial_rotary_factor`` of each head (default half; read by
  `shared.model.config_fields.rope_fields`).

The shape keys a config.json lacks take the family's transformers defaults (``_SHAPES``).
`check_more` refuses, in one line naming the key, what these classes cannot serve.
"""

from __future__ import annotations

from typing import Any

from shared.model.config_shape import decoder_fields, shape_over_defaults
from shared.model.errors import CheckpointError

# transformers 5.x's defaults: vocab, hidden, intermediate, layers, heads, KV heads (None: as
# many as heads)
_SHAPES: dict[str, tuple[int, int, int, int, int, int | None]] = {
    "exaone4": (102400, 4096, 16384, 32, 32, 32),
    "hunyuan_v1_dense": (290943, 4096, 11008, 32, 32, None),
    "arcee": (32000, 2560, 18432, 32, 32, None),
    "nemotron": (256000, 6144, 24576, 32, 48, None),
}
MORE_TYPES = tuple(_SHAPES)
_EXAONE_WINDOW, _EXAONE_PATTERN = 4096, 4  # transformers' Exaone4Config defaults
# rope types besides default / linear / llama3 (HunYuan: `hunyuan_rope`; Arcee: YaRN)
_ROPE_EXTRA = {"hunyuan_v1_dense": ("dynamic",), "arcee": ("yarn",)}


def _shape(cfg: dict) -> dict[str, Any]:
    """The shape keys of ``cfg`` with the family's defaults for the missing ones, plus
    ``head_dim`` (the key, else ``hidden_size // heads``)."""
    d = shape_over_defaults(cfg, _SHAPES[cfg["model_type"]])
    heads = int(d["num_attention_heads"])
    d["num_key_value_heads"] = int(d["num_key_value_heads"] or heads)
    d["head_dim"] = int(cfg.get("head_dim") or int(d["hidden_size"]) // heads)
    return d


def exaone4_window(cfg: dict) -> int | None:
    """EXAONE-4's ``sliding_window`` (default 4096; null: none)."""
    w = cfg.get("sliding_window", _EXAONE_WINDOW)
    return None if w is None else int(w)


def exaone4_sliding(cfg: dict, i: int) -> bool:
    """Whether EXAONE-4's layer ``i`` slides when ``layer_types`` is absent: all but every
    ``sliding_window_pattern``-th (default 4) while a window is set (`check_more` has refused a
    pattern that is not a positive integer)."""
    if exaone4_window(cfg) is None:
        return False
    return bool((i + 1) % int(cfg.get("sliding_window_pattern", _EXAONE_PATTERN)))


def hunyuan_rope(params: dict, cfg: dict) -> dict:
    """HunYuan's rope parameters (``rope_theta`` included) as the plain RoPE transformers
    computes: ``dynamic`` with ``alpha`` is NTK-alpha, base ``rope_theta * alpha ** (d / (d -
    2))`` over the ``d``-dim head; ``dynamic`` without it is the plain base up to
    ``max_position_embeddings`` (Strata's longest context). Other types are returned as they
    are."""
    kind = params.get("rope_type", params.get("type"))
    if kind != "dynamic":
        return params
    theta, alpha = float(params["rope_theta"]), params.get("alpha")
    if alpha:
        d = _shape(cfg)["head_dim"]
        theta = theta * float(alpha) ** (d / (d - 2))
    return {"rope_type": "default", "rope_theta": theta}


def _biases(cfg: dict) -> tuple[bool, bool, bool]:
    """``(q/k/v bias, o_proj bias, MLP bias)`` as each family's modules take them."""
    mt = cfg["model_type"]
    if mt == "exaone4":
        return False, False, False
    bias = bool(cfg.get("attention_bias", False))
    return bias, bias, mt != "hunyuan_v1_dense" and bool(cfg.get("mlp_bias", False))


def more_fields(cfg: dict) -> dict[str, Any]:
    """Shapes, biases, norms and EXAONE-4's NoPE layers of a family in `MORE_TYPES` (other
    models: none), applied over the Llama-family reading of `shared.model.config._text_fields`
    (which has run `check_more` through `shared.model.validate.check_decoder`)."""
    mt = cfg.get("model_type")
    if mt not in MORE_TYPES:
        return {}
    d = _shape(cfg)
    # q/k norm before RoPE: EXAONE-4's (HunYuan's come after it: its own attention)
    out = decoder_fields(d, *_biases(cfg), qk_norm=mt == "exaone4")
    if mt == "nemotron":
        out["rms_norm_eps"] = float(cfg.get("norm_eps", 1e-5))
    if mt == "exaone4" and exaone4_window(cfg) is not None:  # full layers then take no RoPE
        from shared.model.archs import layer_types_of

        types = layer_types_of(cfg)
        out["nope_layers"] = tuple(i for i, t in enumerate(types) if t == "full_attention")
    return out


def check_more(cfg: dict, source: str) -> None:
    """Refuse, in one line naming the key: KV heads that do not divide the heads; Arcee's
    ``hidden_size`` not a multiple of the heads (transformers refuses it too); EXAONE-4's
    ``layer_types`` of the wrong length, or with sliding layers and a null ``sliding_window``,
    or (without ``layer_types``) a ``sliding_window_pattern`` that is not a positive integer
    (transformers 5 cannot build either); Nemotron's rotary part of the head not a positive
    even size; YaRN (Arcee) without ``factor``; a RoPE type the family's class does not compute
    (`_ROPE_EXTRA`)."""
    mt = cfg.get("model_type")
    if mt not in MORE_TYPES:
        return
    d = _shape(cfg)
    heads, kv, hidden = int(d["num_attention_heads"]), d["num_key_value_heads"], d["hidden_size"]
    if heads % kv:
        raise CheckpointError(
            f"{source}: num_key_value_heads {kv} does not divide num_attention_heads {heads}; "
            "fix config.json"
        )
    if mt == "arcee" and int(hidden) % heads:
        raise CheckpointError(
            f"{source}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}; "
            "fix config.json"
        )
    if mt == "exaone4":
        _check_exaone4(cfg, source, int(d["num_hidden_layers"]))
    if mt == "nemotron":
        from shared.model.config_fields import partial_rotary_of

        partial = partial_rotary_of(cfg)
        rot = int(d["head_dim"] * partial)
        if not 0.0 < partial <= 1.0 or rot < 2 or rot % 2:
            raise CheckpointError(
                f"{source}: partial_rotary_factor {partial} gives {rot} rotary dims of the "
                f"{d['head_dim']}-dim head; Strata rotates an even number of them, at least 2"
            )
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type")) if isinstance(params, dict) else None
    if mt == "arcee" and kind == "yarn" and params.get("factor") is None:
        raise CheckpointError(f"{source}: YaRN rope parameters without 'factor'; fix config.json")
    served = ("default", "linear", "llama3") + _ROPE_EXTRA.get(mt, ())
    if kind is not None and kind not in served:
        raise CheckpointError(
            f"{source}: unsupported rope_type {kind!r} (Strata serves {', '.join(served)} for {mt})"
        )


def _check_exaone4(cfg: dict, source: str, n: int) -> None:
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != n:
            raise CheckpointError(
                f"{source}: layer_types has {len(types)} entries for {n} layers; fix config.json"
            )
        if "sliding_attention" in types and exaone4_window(cfg) is None:
            raise CheckpointError(
                f"{source}: layer_types marks sliding layers but sliding_window is null; set "
                "the window or mark every layer full_attention"
            )
        return
    pattern = cfg.get("sliding_window_pattern", _EXAONE_PATTERN)
    ok = isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0
    if exaone4_window(cfg) is not None and not ok:
        raise CheckpointError(
            f"{source}: sliding_window_pattern {pattern!r} without layer_types is not supported "
            "(transformers 5 reads a positive integer there); list layer_types instead"
        )
