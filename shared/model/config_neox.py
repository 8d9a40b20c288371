"""The `ModelConfig` fields of GPT-NeoX, StableLM and Cohere, read from a parsed ``config.json``
as transformers 5.x reads them (torch-free: `validate_checkpoint` runs `check_neox` before any
torch import):

* GPT-NeoX (``gpt_neox``): every head its own K/V (no GQA), ``head_dim = hidden_size /
  num_attention_heads``; ``attention_bias`` (default on) on ``query_key_value`` and ``dense``,
  the MLP always biased; ``use_parallel_residual`` (default on); ``layer_norm_eps``; RoPE on
  ``rotary_pct`` of each head (default a quarter; 5.x: ``rope_parameters``'
  ``partial_rotary_factor``) with base ``rotary_emb_base`` (5.x: ``rope_parameters``; a
  top-level ``rope_theta`` is ignored, as transformers 5.x does);
* StableLM (``stablelm``): ``head_dim = hidden_size / num_attention_heads``, 32 KV heads by
  default, q/k/v bias ``use_qkv_bias`` (none on o_proj nor the MLP), per-head q/k LayerNorms
  ``qk_layernorm``, ``use_parallel_residual`` (default off), RoPE on ``partial_rotary_factor``
  of each head (default a quarter);
* Cohere (``cohere``): ``attention_bias`` on q/k/v/o, ``use_qk_norm``, ``logit_scale`` (default
  0.0625), attention and MLP always in parallel.

RoPE (theta, scaling, the rotated fraction) is `shared.model.config_fields.rope_fields`'s.
`check_neox` refuses, in one line naming the key, what these classes cannot serve.
"""

from __future__ import annotations

from typing import Any

from shared.model.config_fields import partial_rotary_of
from shared.model.config_shape import decoder_fields, shape_over_defaults
from shared.model.errors import CheckpointError

# transformers 5.x's defaults: vocab, hidden, intermediate, layers, heads, KV heads (None: as
# many as heads)
_SHAPES: dict[str, tuple[int, int, int, int, int, int | None]] = {
    "gpt_neox": (50432, 6144, 24576, 44, 64, None),
    "stablelm": (50304, 2560, 6912, 32, 32, 32),
    "cohere": (256000, 8192, 22528, 40, 64, None),
}
NEOX_TYPES = tuple(_SHAPES)


def _shape(cfg: dict) -> dict[str, Any]:
    """The shape keys of ``cfg`` with the family's defaults for the missing ones, plus
    ``head_dim`` (Cohere: the key, else ``hidden_size // heads``; the others always that)."""
    mt = cfg["model_type"]
    d = shape_over_defaults(cfg, _SHAPES[mt])
    heads, hidden = int(d["num_attention_heads"]), int(d["hidden_size"])
    kv = d["num_key_value_heads"] if mt != "gpt_neox" else None
    d["num_key_value_heads"] = int(kv or heads)
    own = cfg.get("head_dim") if mt == "cohere" else None
    d["head_dim"] = int(own or hidden // heads)
    return d


def neox_fields(cfg: dict) -> dict[str, Any]:
    """Shapes, biases, norms and the residual layout of a family in `NEOX_TYPES` (other models:
    none), applied over the Llama-family reading of `shared.model.config._text_fields` (which
    has run `check_neox` through `shared.model.validate.check_decoder`)."""
    mt = cfg.get("model_type")
    if mt not in NEOX_TYPES:
        return {}
    d = _shape(cfg)
    if mt == "gpt_neox":
        bias = bool(cfg.get("attention_bias", True))
        qkv, o, mlp, qk_norm = bias, bias, True, False
        parallel = bool(cfg.get("use_parallel_residual", True))
    elif mt == "stablelm":
        qkv, o, mlp = bool(cfg.get("use_qkv_bias", False)), False, False
        qk_norm = bool(cfg.get("qk_layernorm", False))
        parallel = bool(cfg.get("use_parallel_residual", False))
    else:
        qkv = o = bool(cfg.get("attention_bias", False))
        mlp, qk_norm, parallel = False, bool(cfg.get("use_qk_norm", False)), True
    eps = float(cfg.get("layer_norm_eps", 1e-5))
    out = decoder_fields(
        d, qkv, o, mlp, rms_norm_eps=eps, qk_norm=qk_norm, parallel_residual=parallel
    )
    if mt == "cohere":
        out["logit_scale"] = float(cfg.get("logit_scale", 0.0625))
    return out


def check_neox(cfg: dict, source: str) -> None:
    """Refuse, in one line naming the key: GPT-NeoX / StableLM heads that do not split
    ``hidden_size`` evenly (or a ``head_dim`` other than that split) or whose rotary part
    (``int(head_dim * partial_rotary_factor)`` dims) is not a positive even size; KV heads that
    do not divide the heads (StableLM, Cohere); Cohere's ``logit_scale`` null."""
    mt = cfg.get("model_type")
    if mt not in NEOX_TYPES:
        return
    d = _shape(cfg)
    heads, kv, hidden = int(d["num_attention_heads"]), d["num_key_value_heads"], d["hidden_size"]
    if mt != "cohere":
        if hidden % heads:
            raise CheckpointError(
                f"{source}: hidden_size {hidden} is not a multiple of num_attention_heads "
                f"{heads}; fix config.json"
            )
        if cfg.get("head_dim") not in (None, d["head_dim"]):
            raise CheckpointError(
                f"{source}: head_dim {cfg['head_dim']} other than hidden_size / "
                f"num_attention_heads ({d['head_dim']}) is not supported"
            )
        partial = partial_rotary_of(cfg)
        rot = int(d["head_dim"] * partial)
        if not 0.0 < partial <= 1.0 or rot < 2 or rot % 2:
            key = "rotary_pct" if mt == "gpt_neox" else "partial_rotary_factor"
            raise CheckpointError(
                f"{source}: {key} {partial} gives {rot} rotary dims of the {d['head_dim']}-dim "
                "head; Strata rotates an even number of them, at least 2"
            )
    if heads % kv:
        raise CheckpointError(
            f"{source}: num_key_value_heads {kv} does not divide num_attention_heads {heads}; "
            "fix config.json"
        )
    if mt == "cohere" and "logit_scale" in cfg and cfg["logit_scale"] is None:
        raise CheckpointError(
            f"{source}: logit_scale null is not supported (transformers multiplies the logits "
            "by it); set a number"
        )
