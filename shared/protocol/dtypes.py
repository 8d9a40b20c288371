"""The one mapping between dtype names and torch dtypes.

The names travel on the wire (`BlockFrame.dtype`, `TokenizeReply.kv_dtype`) and into every block
hash's salt, so every process must spell a dtype the same way: the engine, the tokenizer, the
frame codec and the checkpoint loader all ask this module.
"""

from __future__ import annotations

import torch

_TORCH: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,  # int8 KV frames (per-row scales beside them)
}
_ALIASES = {"float": "float32", "half": "float16"}  # config.json spellings
_NAMES = {v: k for k, v in _TORCH.items()}
FLOAT_NAMES = ("float32", "bfloat16", "float16")


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of ``dtype`` ("float32", "bfloat16", "float16", "int8")."""
    if dtype not in _NAMES:
        raise ValueError(f"unsupported dtype {dtype}; expected one of {sorted(_TORCH)}")
    return _NAMES[dtype]


def torch_dtype(name: str, floats_only: bool = False) -> torch.dtype:
    """The torch dtype of a wire or config name (``torch.`` prefix and config aliases accepted);
    ``floats_only`` refuses int8 (model weights and activations)."""
    key = str(name).removeprefix("torch.")
    key = _ALIASES.get(key, key)
    allowed = FLOAT_NAMES if floats_only else tuple(_TORCH)
    if key not in allowed:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(allowed)}")
    return _TORCH[key]
