"""The `ModelConfig` fields of the dense families close to Llama, read from a parsed
``config.json`` as transformers 5.x reads them (torch-free: `validate_checkpoint` runs
`check_dense` before any torch import):

* Ministral (``ministral``): Mistral's layer, no bias on any projection (it ignores
  ``attention_bias``), 8 KV heads by default; the window is `shared.model.archs`'s business;
* Seed-OSS (``seed_oss``): q/k/v bias ``attention_bias`` (default on), o_proj bias
  ``attention_out_bias`` (default off), ``mlp_bias``;
* GLM / GLM-4 (``glm``, ``glm4``): q/k/v bias ``attention_bias`` (default on), never on o_proj,
  no MLP bias; interleaved RoPE on ``partial_rotary_factor`` of each head (default 0.5, read by
  `shared.model.config_fields.rope_fields`);
* ERNIE 4.5 (``ernie4_5``): ``use_bias`` on q/k/v/o and the MLP (default off);
* Helium (``helium``): q/k/v bias ``attention_bias``, never on o_proj, ``mlp_bias``.

The shape keys a config.json lacks take the family's transformers defaults (``_SHAPES``).
`check_dense` refuses, in one line, what these classes cannot serve: a GLM rotary part that is
odd or empty, a Helium whose heads do not span ``hidden_size`` (its o_proj is hidden x hidden).
"""

from __future__ import annotations

from typing import Any

from shared.model.config_fields import partial_rotary_of
from shared.model.config_shape import decoder_fields, shape_over_defaults
from shared.model.errors import CheckpointError

# transformers 5.x's defaults: vocab, hidden, intermediate, layers, heads, KV heads, head_dim
# (None: hidden_size // num_attention_heads)
_SHAPES: dict[str, tuple[int, int, int, int, int, int, int | None]] = {
    "ministral": (32000, 4096, 14336, 32, 32, 8, None),
    "seed_oss": (155136, 4096, 27648, 64, 80, 8, 128),
    "glm": (151552, 4096, 13696, 40, 32, 2, 128),
    "glm4": (151552, 4096, 13696, 40, 32, 2, 128),
    "ernie4_5": (103424, 1024, 3072, 18, 16, 2, 128),
    "helium": (48000, 2560, 7040, 24, 20, 20, 128),
}
DENSE_TYPES = tuple(_SHAPES)


def _shape(cfg: dict) -> dict[str, Any]:
    """The shape keys of ``cfg`` with the family's defaults for the missing ones (a null
    ``num_key_value_heads`` or ``head_dim`` means every head, ``hidden_size // heads``)."""
    d = shape_over_defaults(cfg, _SHAPES[cfg["model_type"]])
    heads = int(d["num_attention_heads"])
    d["num_key_value_heads"] = int(d["num_key_value_heads"] or heads)
    d["head_dim"] = int(d["head_dim"] or int(d["hidden_size"]) // heads)
    return d


def _biases(cfg: dict) -> tuple[bool, bool, bool]:
    """``(q/k/v bias, o_proj bias, MLP bias)`` as each family's modules take them."""
    mt = cfg["model_type"]
    if mt == "ministral":
        return False, False, False
    if mt == "seed_oss":
        qkv = bool(cfg.get("attention_bias", True))
        return qkv, bool(cfg.get("attention_out_bias", False)), bool(cfg.get("mlp_bias", False))
    if mt in ("glm", "glm4"):
        return bool(cfg.get("attention_bias", True)), False, False
    if mt == "ernie4_5":
        b = bool(cfg.get("use_bias", False))
        return b, b, b
    return bool(cfg.get("attention_bias", False)), False, bool(cfg.get("mlp_bias", False))


def dense_fields(cfg: dict) -> dict[str, Any]:
    """The shape and bias fields of a family in `DENSE_TYPES` (other models: none); applied
    over the Llama-family reading of `shared.model.config._text_fields` (which has run
    `check_dense` through `shared.model.validate.check_decoder`)."""
    if cfg.get("model_type") not in DENSE_TYPES:
        return {}
    d = _shape(cfg)
    return decoder_fields(d, *_biases(cfg), qk_norm=False)


def check_dense(cfg: dict, source: str) -> None:
    """Refuse, in one line naming the key, a GLM / GLM-4 whose rotary part of the head
    (``int(head_dim * partial_rotary_factor)`` dims) is not a positive even size, and a Helium
    whose ``num_attention_heads * head_dim`` is not ``hidden_size``."""
    mt = cfg.get("model_type")
    if mt not in DENSE_TYPES:
        return
    d = _shape(cfg)
    heads, head_dim, hidden = int(d["num_attention_heads"]), d["head_dim"], int(d["hidden_size"])
    if mt in ("glm", "glm4"):
        partial = partial_rotary_of(cfg)
        rot = int(head_dim * partial)
        if not 0.0 < partial <= 1.0 or rot < 2 or rot % 2:
            raise CheckpointError(
                f"{source}: partial_rotary_factor {partial} gives {rot} rotary dims of the "
                f"{head_dim}-dim head; Strata rotates an even number of them, at least 2"
            )
    if mt == "helium" and heads * head_dim != hidden:
        raise CheckpointError(
            f"{source}: Helium with num_attention_heads * head_dim ({heads} x {head_dim}) "
            f"other than hidden_size ({hidden}) is not supported (its o_proj is hidden x hidden)"
        )
