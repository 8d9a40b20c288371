"""Paged attention over the engine's KV cache (pure torch, CPU or CUDA).

``AttentionPlan`` is built once per forward from ``AttentionMetadata`` and shared by every
layer, so all index tensors exist before the first layer runs. Three paths:

* decode: on CPU in float32 every decode token of the batch goes through one call of the native
  kernel in ``cpu_kernels`` (reads K/V from the blocks in place; no gather, no per-sequence
  ops). Otherwise (CUDA, half precision, no C compiler) each sequence's blocks are
  gathered with one ``index_select`` on the block axis (whole blocks, contiguous copies) and
  trimmed to the context length, so there is no padding and no mask; the GQA group is folded
  into the query axis so K/V are never repeated. One small SDPA call per sequence measured
  2-3x faster on CPU than one padded, masked SDPA over the whole batch: the masked kernel is
  slow for 1-2 query rows, and the padded gather copied up to 2x the bytes (see
  docs/benchmarks/model.md). The loop runs on one thread (see ``_serial``). When every decode
  has the same context length the batch is one unmasked SDPA call instead (nothing to pad);
* prefill on CPU in float32: every non-decode sequence of the batch (fresh prompt, chunk over a
  cached prefix, prefix-cache hit) goes through one call of the native prefill kernel in
  ``cpu_kernels`` (``gemm.c``), reading K/V from the blocks in place after the new ones are
  written; 1.0-1.45x torch's SDPA at 64-2048 tokens, and no gather or mask for a chunk over a
  prefix (docs/benchmarks/engine.md). Elsewhere, or for a head size it does not take:
* fresh prefill: sequences with no cached context attend over their own new K/V with
  ``is_causal`` (one batched SDPA call when all lengths are equal);
* general: a chunk over a cached prefix (chunked prefill, prefix-cache hit, speculative
  verification): one SDPA call per sequence with an offset causal mask over the gathered context.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.model import cpu_kernels
from shared.model.api import AttentionMetadata


@dataclass
class _Decode:
    token: int  # row of the decode token in the flat batch
    blocks: torch.Tensor  # block ids covering the context
    context_len: int


@dataclass
class _Span:
    start: int
    end: int
    context_len: int
    blocks: torch.Tensor | None  # block ids covering the context (None for fresh prefill)
    _mask: torch.Tensor | None = None

    def mask(self) -> torch.Tensor:
        """bool ``[q, ctx]`` offset causal mask (general path only), built on the first layer
        that needs it: the native prefill kernel never does."""
        if self._mask is None:
            c, device = self.context_len, self.blocks.device
            kpos = torch.arange(c, device=device)
            qpos = torch.arange(c - (self.end - self.start), c, device=device)
            self._mask = kpos[None, :] <= qpos[:, None]
        return self._mask


@dataclass
class AttentionPlan:
    """Per-forward attention schedule shared by all layers."""

    num_tokens: int
    block_size: int
    decodes: list[_Decode]
    uniform: torch.Tensor | None  # flat block ids when every decode has the same context
    decode_rows: torch.Tensor | None  # rows of the decode tokens (None: all rows, in order)
    decode_tables: torch.Tensor | None  # [num_decodes, max_blocks] block tables of the decodes
    decode_ctx: torch.Tensor | None  # [num_decodes] their context lengths
    fresh_uniform: tuple[int, int] | None  # (num_seqs, seq_len) when the whole batch is fresh
    spans: list[_Span]  # sequences handled one by one
    # the non-decode sequences for the native prefill kernel, on CPU: int64 (block tables,
    # context lengths, first rows, new-token counts)
    prefill: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(cls, meta: AttentionMetadata, block_size: int, device: torch.device) -> AttentionPlan:
        qs = meta.query_start_loc.tolist() if meta.query_start_loc.numel() else [0]
        q_lens, ctx_lens = meta.query_lens, meta.context_lens_list
        num_tokens = qs[-1]
        tables = meta.block_tables.to(device)
        decodes: list[_Decode] = []
        spans: list[_Span] = []
        rest: list[int] = []
        dec_idx: list[int] = []
        for i, (q, c) in enumerate(zip(q_lens, ctx_lens, strict=True)):
            if q == 1 and c > 1:
                decodes.append(_Decode(qs[i], tables[i, : -(-c // block_size)], c))
                dec_idx.append(i)
            elif q > 0:
                rest.append(i)
        decode_rows = decode_tables = decode_ctx = None
        if decodes and len(decodes) != num_tokens:
            decode_rows = torch.tensor([d.token for d in decodes], device=device)
        if decodes:
            decode_tables = tables if len(dec_idx) == len(q_lens) else tables[dec_idx]
            decode_ctx = torch.tensor([d.context_len for d in decodes], device=device)
        prefill = None
        if rest and device.type == "cpu":
            i64 = torch.int64
            prefill = (
                tables[rest].to(i64).contiguous(),
                torch.tensor([ctx_lens[i] for i in rest], dtype=i64),
                torch.tensor([qs[i] for i in rest], dtype=i64),
                torch.tensor([q_lens[i] for i in rest], dtype=i64),
            )
        fresh_uniform = None
        if (
            not decodes
            and len(rest) > 1
            and all(ctx_lens[i] == q_lens[i] == q_lens[rest[0]] for i in rest)
        ):
            fresh = (len(rest), q_lens[rest[0]])
            return cls(num_tokens, block_size, [], None, None, None, None, fresh, [], prefill)
        for i in rest:
            q, c = q_lens[i], ctx_lens[i]
            blocks = tables[i, : -(-c // block_size)] if c != q else None
            spans.append(_Span(qs[i], qs[i] + q, c, blocks))
        uniform = None
        if len(decodes) > 1 and len({d.context_len for d in decodes}) == 1:
            uniform = torch.cat([d.blocks for d in decodes])
        return cls(
            num_tokens,
            block_size,
            decodes,
            uniform,
            decode_rows,
            decode_tables,
            decode_ctx,
            fresh_uniform,
            spans,
            prefill,
        )


@contextmanager
def _serial(device: torch.device):
    """Run the per-sequence decode ops on one CPU thread. They are small (a few hundred KB
    each); with several intra-op threads each op paid a thread-pool hand-off, which on a
    loaded 2-core box made the loop 2-3x slower than the padded batch it replaces."""
    n = torch.get_num_threads()
    if device.type != "cpu" or n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _context(cache: torch.Tensor, blocks: torch.Tensor, n: int) -> torch.Tensor:
    """First ``n`` tokens of the blocks of a layer slice ``[NB, BS, KVH, D]`` -> ``[KVH, n, D]``."""
    g = cache.index_select(0, blocks)
    return g.view(-1, *cache.shape[-2:])[:n].transpose(0, 1)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
) -> torch.Tensor:
    """Write the new K/V into the cache, then attend.

    ``q``: ``[T, H, D]``; ``k``/``v``: ``[T, KVH, D]``; ``k_cache``/``v_cache``: one layer of the
    paged cache, ``[num_blocks, block_size, KVH, D]``. Returns ``[T, H, D]``.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    group = num_heads // kv_heads
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    if v is not k or v_cache.data_ptr() != k_cache.data_ptr():  # not one cache (`kv_shared`)
        v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)

    out = q.new_empty(q.shape[0], kv_heads, group, head_dim)
    spans = plan.spans
    if plan.prefill is not None and cpu_kernels.prefill_attention(
        q, k_cache, v_cache, *plan.prefill, scale, out.view(q.shape)
    ):  # CPU float32: every prompt chunk in one call, K/V read from the blocks in place
        if not plan.decodes:
            return out.view(q.shape)
        spans = []
    elif plan.fresh_uniform is not None:
        b, t = plan.fresh_uniform
        qb = q.view(b, t, num_heads, head_dim).transpose(1, 2)
        kb = k.view(b, t, kv_heads, head_dim).transpose(1, 2)
        vb = v.view(b, t, kv_heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            qb, kb, vb, is_causal=True, scale=scale, enable_gqa=group > 1
        )
        return o.transpose(1, 2).reshape(b * t, num_heads, head_dim)

    if plan.decodes:
        rows = plan.decode_rows
        qd = q if rows is None else q.index_select(0, rows)
        native = cpu_kernels.decode_attention(
            qd, k_cache, v_cache, plan.decode_tables, plan.decode_ctx, scale
        )
        qd = qd.view(-1, kv_heads, group, head_dim)
        od = out if rows is None else torch.empty_like(qd)
        if native is not None:  # CPU float32: one call reading the blocks in place
            od.copy_(native.view_as(qd))
        elif plan.uniform is not None:  # equal contexts: one unmasked batched call, no padding
            b, n = len(plan.decodes), plan.decodes[0].context_len
            kd = k_cache.index_select(0, plan.uniform).view(b, -1, kv_heads, head_dim)
            vd = v_cache.index_select(0, plan.uniform).view(b, -1, kv_heads, head_dim)
            kd, vd = kd[:, :n].transpose(1, 2), vd[:, :n].transpose(1, 2)
            od.copy_(F.scaled_dot_product_attention(qd, kd, vd, scale=scale))
        else:
            with _serial(q.device):
                for j, d in enumerate(plan.decodes):
                    kd = _context(k_cache, d.blocks, d.context_len)
                    vd = _context(v_cache, d.blocks, d.context_len)
                    od[j] = F.scaled_dot_product_attention(qd[j], kd, vd, scale=scale)
        if rows is not None:
            out.index_copy_(0, rows, od)
    out = out.view(q.shape)
    for s in spans:
        qs = q[s.start : s.end].transpose(0, 1)  # [H, q, D]
        if s.blocks is None:  # fresh prefill: only its own new tokens
            ks = k[s.start : s.end].transpose(0, 1)
            vs = v[s.start : s.end].transpose(0, 1)
            o = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scale, enable_gqa=group > 1
            )
        else:
            ks = _context(k_cache, s.blocks, s.context_len)
            vs = _context(v_cache, s.blocks, s.context_len)
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=s.mask(), scale=scale, enable_gqa=group > 1
            )
        out[s.start : s.end] = o.transpose(0, 1)
    return out
