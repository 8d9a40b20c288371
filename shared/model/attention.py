"""Paged attention over the engine's KV cache (pure torch, CPU or CUDA).

``AttentionPlan`` is built once per forward from ``AttentionMetadata`` and shared by every
layer. Three paths, chosen per group of sequences:

* decode: sequences with one new token are batched: their K/V are gathered through the block
  table into a padded ``[B, KVH, S, D]`` tensor and attended with a key-padding mask; the GQA
  group is folded into the query axis so K/V are never repeated;
* fresh prefill: sequences with no cached context attend over their own new K/V with
  ``is_causal`` (one batched SDPA call when all lengths are equal);
* general: chunked prefill over a cached prefix, one SDPA call per sequence with an
  offset causal mask over the gathered context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.model.api import AttentionMetadata


@dataclass
class _DecodeGroup:
    token_idx: torch.Tensor  # [B] positions of the decode tokens in the flat batch
    block_tables: torch.Tensor  # [B, nblocks] trimmed to the longest context
    key_mask: torch.Tensor  # bool [B, 1, 1, S]: True where a key is inside the context
    num_keys: int


@dataclass
class _Span:
    start: int
    end: int
    context_len: int
    blocks: torch.Tensor | None  # block ids covering the context (None for fresh prefill)
    mask: torch.Tensor | None  # bool [q, ctx] offset causal mask (general path only)


@dataclass
class AttentionPlan:
    """Per-forward attention schedule shared by all layers."""

    num_tokens: int
    block_size: int
    decode: _DecodeGroup | None
    fresh_uniform: tuple[int, int] | None  # (num_seqs, seq_len) when the whole batch is fresh
    spans: list[_Span]  # sequences handled one by one

    @classmethod
    def build(cls, meta: AttentionMetadata, block_size: int, device: torch.device) -> AttentionPlan:
        qs = meta.query_start_loc.tolist() if meta.query_start_loc.numel() else [0]
        q_lens, ctx_lens = meta.query_lens, meta.context_lens_list
        num_tokens = qs[-1]
        decode_ids = [i for i, q in enumerate(q_lens) if q == 1 and ctx_lens[i] > 1]
        decode = None
        if decode_ids:
            ctx = torch.tensor([ctx_lens[i] for i in decode_ids], device=device)
            nblocks = -(-max(ctx_lens[i] for i in decode_ids) // block_size)
            sel = torch.tensor(decode_ids, device=device)
            tables = meta.block_tables.to(device)[sel, :nblocks]
            num_keys = nblocks * block_size
            key_mask = torch.arange(num_keys, device=device)[None, :] < ctx[:, None]
            decode = _DecodeGroup(
                token_idx=torch.tensor([qs[i] for i in decode_ids], device=device),
                block_tables=tables,
                key_mask=key_mask[:, None, None, :],
                num_keys=num_keys,
            )
        rest = [i for i in range(len(q_lens)) if not (q_lens[i] == 1 and ctx_lens[i] > 1)]
        fresh = all(ctx_lens[i] == q_lens[i] for i in rest)
        fresh_uniform = None
        if not decode_ids and fresh and rest and len(set(q_lens)) == 1 and len(rest) > 1:
            fresh_uniform = (len(rest), q_lens[0])
            rest = []
        spans = []
        for i in rest:
            q, c = q_lens[i], ctx_lens[i]
            blocks = mask = None
            if q == 0:
                continue
            if c != q:
                blocks = meta.block_tables[i, : -(-c // block_size)].to(device)
                kpos = torch.arange(c, device=device)
                qpos = torch.arange(c - q, c, device=device)
                mask = kpos[None, :] <= qpos[:, None]
            spans.append(_Span(qs[i], qs[i] + q, c, blocks, mask))
        return cls(num_tokens, block_size, decode, fresh_uniform, spans)


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``cache[blocks]`` for a layer slice ``[NB, BS, KVH, D]`` -> ``[..., nblocks*BS, KVH, D]``."""
    g = cache[blocks]
    return g.reshape(*blocks.shape[:-1], -1, *cache.shape[-2:])


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
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)

    if plan.fresh_uniform is not None:
        b, t = plan.fresh_uniform
        qb = q.view(b, t, num_heads, head_dim).transpose(1, 2)
        kb = k.view(b, t, kv_heads, head_dim).transpose(1, 2)
        vb = v.view(b, t, kv_heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            qb, kb, vb, is_causal=True, scale=scale, enable_gqa=group > 1
        )
        return o.transpose(1, 2).reshape(b * t, num_heads, head_dim)

    out = torch.empty_like(q)
    dec = plan.decode
    if dec is not None:
        b = dec.token_idx.numel()
        qd = q.index_select(0, dec.token_idx).view(b, kv_heads, group, head_dim)
        kd = _gather(k_cache, dec.block_tables).transpose(1, 2)  # [B, KVH, S, D]
        vd = _gather(v_cache, dec.block_tables).transpose(1, 2)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=dec.key_mask, scale=scale)
        out.index_copy_(0, dec.token_idx, o.reshape(b, num_heads, head_dim))
    for s in plan.spans:
        qs = q[s.start : s.end].transpose(0, 1)  # [H, q, D]
        if s.blocks is None:  # fresh prefill: only its own new tokens
            ks = k[s.start : s.end].transpose(0, 1)
            vs = v[s.start : s.end].transpose(0, 1)
            o = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scale, enable_gqa=group > 1
            )
        else:
            ks = _gather(k_cache, s.blocks)[: s.context_len].transpose(0, 1)
            vs = _gather(v_cache, s.blocks)[: s.context_len].transpose(0, 1)
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=s.mask, scale=scale, enable_gqa=group > 1
            )
        out[s.start : s.end] = o.transpose(0, 1)
    return out
