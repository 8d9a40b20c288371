"""A tiny paged-KV driver for model tests (the real engine lives in shared/engine/).

Sequences get blocks from a free list handed out in a scrambled order so block tables are
never contiguous; ``step`` runs one flat varlen batch of any mix of prefill chunks and decodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shared.model.api import AttentionMetadata, KVCache


@dataclass
class Seq:
    """One sequence's cache state."""

    blocks: list[int] = field(default_factory=list)
    length: int = 0  # tokens already in the cache


class PagedDriver:
    def __init__(self, model, num_blocks: int = 256, block_size: int = 4, seed: int = 0):
        self.model = model
        self.block_size = block_size
        self.cache = KVCache.allocate(
            model.num_layers,
            num_blocks,
            block_size,
            model.num_kv_heads,
            model.head_dim,
            model.dtype,
            model.device,
            shared=getattr(model, "kv_shared", False),  # K and V one tensor (DeepSeek's latent)
        )
        g = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=g).tolist()

    def new_seq(self) -> Seq:
        return Seq()

    def _reserve(self, seq: Seq, new_len: int) -> None:
        while len(seq.blocks) * self.block_size < new_len:
            seq.blocks.append(self.free.pop())

    def step(
        self,
        batch: list[tuple[Seq, list[int]]],
        inputs_embeds: torch.Tensor | None = None,
        layer_callback=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run new tokens for each sequence; returns (hidden [T, H], last-token logits [B, V])."""
        ids, pos, slots, qsl, ctx, qlens = [], [], [], [0], [], []
        for seq, toks in batch:
            self._reserve(seq, seq.length + len(toks))
            for j in range(len(toks)):
                p = seq.length + j
                pos.append(p)
                slots.append(
                    seq.blocks[p // self.block_size] * self.block_size + p % self.block_size
                )
            ids += toks
            qsl.append(qsl[-1] + len(toks))
            qlens.append(len(toks))
            ctx.append(seq.length + len(toks))
        width = max(len(s.blocks) for s, _ in batch)
        tables = torch.zeros(len(batch), width + 1, dtype=torch.long)  # +1: padded like an engine
        for i, (seq, _) in enumerate(batch):
            tables[i, : len(seq.blocks)] = torch.tensor(seq.blocks)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(qsl),
            context_lens=torch.tensor(ctx),
            block_tables=tables,
            slot_mapping=torch.tensor(slots),
            query_lens=qlens,
            context_lens_list=ctx,
        )
        hidden = self.model(
            torch.tensor(ids),
            torch.tensor(pos),
            meta,
            self.cache,
            inputs_embeds=inputs_embeds,
            layer_callback=layer_callback,
        )
        for seq, toks in batch:
            seq.length += len(toks)
        last = torch.tensor(qsl[1:]) - 1
        return hidden, self.model.compute_logits(hidden[last])

    def prefill(self, seq: Seq, ids: list[int], chunk: int | None = None, embeds=None):
        """Prefill ``ids`` in chunks; returns logits for every prompt position ``[T, V]``."""
        chunk = chunk or len(ids)
        out = []
        for s in range(0, len(ids), chunk):
            e = embeds[s : s + chunk] if embeds is not None else None
            hidden, _ = self.step([(seq, ids[s : s + chunk])], inputs_embeds=e)
            out.append(self.model.compute_logits(hidden))
        return torch.cat(out)

    def greedy(self, prompt: list[int], n: int, chunk: int | None = None, embeds=None) -> list[int]:
        seq = self.new_seq()
        logits = self.prefill(seq, prompt, chunk, embeds)
        out = [int(logits[-1].argmax())]
        for _ in range(n - 1):
            _, lg = self.step([(seq, [out[-1]])])
            out.append(int(lg[0].argmax()))
        return out
