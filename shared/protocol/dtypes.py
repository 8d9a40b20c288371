"""The one mapping between dtype names and torch dtypes.

The names travel on the wire (`BlockFrame.dtype`, `TokenizeReply.kv_dtype`) and into every block
hash's salt, so every process must spell a dtype the same way: the engine, the tokenizer, the
frame codec and the checkpoint loader all ask this module. Names need no torch (the tokenizer
never imports it); torch is imported when a torch dtype is first asked for.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

NAMES = ("float32", "bfloat16", "float16", "int8")  # int8: KV frames (per-row scales beside them)
_ALIASES = {"float": "float32", "half": "float16"}  # config.json spellings
FLOAT_NAMES = ("float32", "bfloat16", "float16")


@functools.cache
def _torch_of() -> dict[str, torch.dtype]:
    import torch  # on first use: the names need no torch

    return {n: getattr(torch, n) for n in NAMES}


@functools.cache
def _name_of() -> dict[torch.dtype, str]:
    return {v: k for k, v in _torch_of().items()}


def canonical_name(name: object, floats_only: bool = False) -> str:
    """The wire name of a wire or config name (``torch.`` prefix and config aliases accepted),
    without importing torch; ``floats_only`` refuses int8 (model weights and activations)."""
    key = str(name).removeprefix("torch.")
    key = _ALIASES.get(key, key)
    allowed = FLOAT_NAMES if floats_only else NAMES
    if key not in allowed:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(allowed)}")
    return key


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of ``dtype`` ("float32", "bfloat16", "float16", "int8")."""
    names = _name_of()
    if dtype not in names:
        raise ValueError(f"unsupported dtype {dtype}; expected one of {sorted(NAMES)}")
    return names[dtype]


def torch_dtype(name: str, floats_only: bool = False) -> torch.dtype:
    """The torch dtype of a wire or config name (``torch.`` prefix and config aliases accepted);
    ``floats_only`` refuses int8 (model weights and activations)."""
    return _torch_of()[canonical_name(name, floats_only)]
