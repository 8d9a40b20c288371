"""`RawKV`: whole KV blocks in and out of the paged cache, outside the forward (swap, eviction,
the pool, disaggregation); `ModelRunner` is one.

Under tensor parallelism each rank's cache holds its own KV heads; these methods still read and
write whole blocks (every KV head): rank 0 gathers / scatters the other ranks' heads
(`shared.engine.tp_kv`), the ``_local_`` methods work on this rank's.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from shared.engine import tp_kv


class RawKV:
    """Needs ``model``, ``kv`` (`KVCache`), ``device`` and ``block_size``."""

    @property
    def kv_heads(self) -> int:
        """KV heads of a whole block (every rank's, under tensor parallelism)."""
        tp = getattr(self.model, "tp", None)
        shards = tp is not None and tp.shards_kv  # expert parallel alone: every rank, every head
        return self.kv.k.shape[3] * (tp.world_size if shards else 1)

    def _kv_op(self, name: str, args: tuple, data: torch.Tensor | None = None):
        tp = getattr(self.model, "tp", None)
        if tp is not None and tp.world_size > 1:
            return tp_kv.run(self, tp, name, args, data)
        local = getattr(self, "_local_" + name)
        return local(*args) if data is None else local(*args, data)

    def read_blocks(self, block_ids: Seq[int], layers: range | None = None) -> torch.Tensor:
        """``[L', 2, n, block_size, kvh, hd]`` copy of the given blocks."""
        return self._kv_op("read_blocks", (list(block_ids), layers))

    def read_tokens(
        self, block_table: Seq[int], layers: range, start: int, end: int
    ) -> torch.Tensor:
        """``[len(layers), 2, end - start, kvh, hd]`` copy of token positions of one sequence."""
        return self._kv_op("read_tokens", (list(block_table), layers, start, end))

    def write_blocks(self, block_ids: Seq[int], data: torch.Tensor) -> None:
        """Inverse of :meth:`read_blocks` over all layers."""
        self._kv_op("write_blocks", (list(block_ids),), data)

    def write_token_layers(self, slots: torch.Tensor, layers: range, kv: torch.Tensor) -> None:
        """Write per-token K/V ``[len(layers), 2, n, kvh, hd]`` into ``slots`` of ``layers``."""
        self._kv_op("write_token_layers", (slots.cpu(), layers), kv)

    def _local_read_blocks(self, block_ids: list[int], layers: range | None) -> torch.Tensor:
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        lay = slice(None) if layers is None else slice(layers.start, layers.stop)
        return torch.stack([self.kv.k[lay, idx], self.kv.v[lay, idx]], dim=1)

    def _local_read_tokens(self, table: list[int], layers: range, start: int, end: int):
        L, nb, bs, h, d = self.kv.k.shape
        slots = self.slots_for(table, start, end).to(self.device)
        lay = slice(layers.start, layers.stop)
        k = self.kv.k.view(L, nb * bs, h, d)[lay][:, slots]
        v = self.kv.v.view(L, nb * bs, h, d)[lay][:, slots]
        return torch.stack([k, v], dim=1)

    def _local_write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        data = data.to(self.device, self.kv.k.dtype)
        self.kv.k[:, idx] = data[:, 0]
        self.kv.v[:, idx] = data[:, 1]

    def _local_write_token_layers(self, slots: torch.Tensor, layers: range, kv: torch.Tensor):
        L, nb, bs, h, d = self.kv.k.shape
        slots = slots.to(self.device)
        kv = kv.to(self.device, self.kv.k.dtype)
        for i, layer in enumerate(layers):
            self.kv.k.view(L, nb * bs, h, d)[layer, slots] = kv[i, 0]
            self.kv.v.view(L, nb * bs, h, d)[layer, slots] = kv[i, 1]

    def slots_for(self, block_table: Seq[int], start: int, end: int) -> torch.Tensor:
        p = torch.arange(start, end)
        table = torch.tensor(list(block_table), dtype=torch.long)
        return table[p // self.block_size] * self.block_size + p % self.block_size
