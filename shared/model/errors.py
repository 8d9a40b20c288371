"""Errors raised while reading a checkpoint directory."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint directory cannot be loaded.

    The message always names the offending file and, where one is involved, the tensor
    (missing tensor, wrong shape, unknown architecture, malformed config).
    """
