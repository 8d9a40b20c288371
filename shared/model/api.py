"""The narrow contract between the engine and the model.

The engine owns the paged KV cache and decides which tokens run in a step; the model only reads
and writes the slots the engine hands it. Every forward is a flattened variable-length batch:
the new tokens of all scheduled sequences are concatenated along one token axis.
"""

from __future__ import annotations

import contextlib
import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class KVCache:
    """Paged KV storage for every layer.

    ``k`` and ``v`` have shape ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``.
    A token's *slot* is ``block_id * block_size + offset``; ``k.view(L, -1, H, D)[l, slot]``
    is its key in layer ``l``. A model whose K and V are the same values (``kv_shared``:
    DeepSeek's cached latent) gets one tensor for both (``v is k``): the memory of one.
    """

    k: torch.Tensor
    v: torch.Tensor

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        shared: bool = False,
    ) -> KVCache:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        k = _zeros(shape, dtype, device)
        return cls(k=k, v=k if shared else _zeros(shape, dtype, device))

    @staticmethod
    def bytes_per_block(
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        shared: bool = False,
    ) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return (1 if shared else 2) * num_layers * block_size * num_kv_heads * head_dim * elem


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeros; on CPU lazily: a private anonymous mapping of its own is the kernel's zero pages,
    which become resident as they are first written, so a large KV budget (`kv_budget`) costs
    memory only as blocks come into use, and allocating it takes no time (torch.zeros writes every
    page: 1.8 s and 4 GiB resident for 4 GiB). Its own mapping, not ``calloc``: where the
    process's malloc serves large sizes from freed heap memory, ``calloc`` writes every byte.
    Advised for transparent huge pages, so a decode step's scattered block reads cost few TLB
    misses; unmapped when the tensor is freed."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no THP on this kernel or platform
        buf.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


@dataclass
class AttentionMetadata:
    """Where each sequence's new tokens sit in the flat batch and in the cache.

    For sequence ``i`` the new tokens are ``[query_start_loc[i], query_start_loc[i+1])`` of the
    flat batch; they are the *last* ``query_lens[i]`` tokens of a context of ``context_lens[i]``
    tokens (cached prefix + new tokens), so causal masking is offset by
    ``context_lens[i] - query_lens[i]``. The model writes each new token's K/V to
    ``slot_mapping[t]`` before attending, then reads the whole context through
    ``block_tables[i]``.
    """

    query_start_loc: torch.Tensor  # int64 [B + 1]
    context_lens: torch.Tensor  # int64 [B]
    block_tables: torch.Tensor  # int64 [B, max_blocks_per_seq], padded with 0
    slot_mapping: torch.Tensor  # int64 [T]
    query_lens: list[int]  # python copy of the per-sequence query lengths
    context_lens_list: list[int]  # python copy of context_lens

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_pure_decode(self) -> bool:
        return all(q == 1 for q in self.query_lens)


# Called by the model after layer ``i`` has written its K/V for this step (layer-wise transfer).
LayerCallback = Callable[[int], None]
