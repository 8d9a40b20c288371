"""The shape of a decoder checkpoint read over its family's transformers defaults, and the
`ModelConfig` fields it gives (torch-free): shared by the family tables in `config_dense`,
`config_more` and `config_neox`."""

from __future__ import annotations

from typing import Any

SHAPE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)


def shape_over_defaults(cfg: dict, defaults: tuple) -> dict[str, Any]:
    """``cfg``'s `SHAPE_KEYS` (and ``head_dim`` when ``defaults`` has a seventh value) over a
    family's transformers defaults ``defaults``, in that order."""
    keys = SHAPE_KEYS + (("head_dim",) if len(defaults) > len(SHAPE_KEYS) else ())
    d = dict(zip(keys, defaults, strict=True))
    d.update({k: cfg[k] for k in keys if k in cfg})
    return d


def decoder_fields(d: dict, qkv: bool, o: bool, mlp: bool, **more: Any) -> dict[str, Any]:
    """`ModelConfig` fields of a resolved shape ``d`` (`shape_over_defaults` with
    ``num_key_value_heads`` and ``head_dim`` set), the three biases and ``more``."""
    shape = dict(
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_layers=int(d["num_hidden_layers"]),
        num_heads=int(d["num_attention_heads"]),
        num_kv_heads=d["num_key_value_heads"],
        head_dim=d["head_dim"],
    )
    return shape | dict(attention_bias=qkv, o_proj_bias=o, mlp_bias=mlp) | more
