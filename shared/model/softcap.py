"""Paged attention with soft-capped scores (Gemma-2): ``s -> cap * tanh(s / cap)`` before the
softmax, as transformers' eager attention computes it; or with attention sinks (GPT-OSS): one
learned logit per head joins each row's softmax denominator (a key whose value is zero).

SDPA takes neither. The native CPU float32 kernels take the sinks (`sink_attention`: the decode
and prefill kernels start each row's softmax from the head's sink logit) but no cap. Otherwise
every sequence of the batch runs plain torch ops over its gathered context
(`softcap_attention`): ``q @ k^T * scale``, the cap, the offset causal mask, the sink column,
softmax in float32 (GPT-OSS's in a float64 model: float64), ``@ v``. The per-sequence list
comes from the same `AttentionPlan` the other paths use.
"""

from __future__ import annotations

import torch

from shared.model import cpu_kernels
from shared.model.attention import AttentionPlan, _context


def _sequences(plan: AttentionPlan) -> list[tuple[int, int, int, torch.Tensor | None]]:
    """``(first row, end row, context length, context blocks or None)`` per sequence; None
    blocks: a fresh prefill, whose context is its own new K/V."""
    if plan.fresh_uniform is not None:
        b, t = plan.fresh_uniform
        return [(i * t, (i + 1) * t, t, None) for i in range(b)]
    seqs = [(d.token, d.token + 1, d.context_len, d.blocks) for d in plan.decodes]
    return seqs + [(s.start, s.end, s.context_len, s.blocks) for s in plan.spans]


def softcap_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    cap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention`'s contract (writes the new K/V, returns ``[T, H, D]``) with the scores
    soft-capped at ``cap`` (None: not capped) and, with ``sinks`` ``[H]``, head h's sink logit
    in every row's softmax, dropped after it (the weights of a row then sum to less than 1)."""
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    group = heads // kv_heads
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)
    out = torch.empty_like(q)
    for start, end, ctx, blocks in _sequences(plan):
        if blocks is None:
            ks, vs = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
        else:
            ks, vs = _context(k_cache, blocks, ctx), _context(v_cache, blocks, ctx)
        ks = ks.repeat_interleave(group, dim=0)  # transformers' repeat_kv: head h reads h // g
        vs = vs.repeat_interleave(group, dim=0)
        scores = torch.matmul(q[start:end].transpose(0, 1), ks.transpose(1, 2)) * scale
        if cap is not None:
            scores = torch.tanh(scores / cap) * cap
        n = end - start
        qpos = torch.arange(ctx - n, ctx, device=q.device)
        allowed = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:  # the sink column: max-shifted with the row, as transformers
            sink = sinks.to(scores.dtype)[:, None, None].expand(-1, n, 1)
            scores = torch.cat([scores, sink], dim=-1)
            scores = scores - scores.max(dim=-1, keepdim=True).values
        # Gemma-2's softmax is float32 in any dtype, GPT-OSS's the model's (float32 at least)
        wide = torch.float64 if sinks is not None and q.dtype == torch.float64 else torch.float32
        probs = torch.softmax(scores, dim=-1, dtype=wide)[..., :ctx].to(q.dtype)
        out[start:end] = torch.matmul(probs, vs).transpose(0, 1)
    return out


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """`softcap_attention` with ``sinks`` and no cap, on the native kernels where they apply
    (CPU float32: every prompt row in one prefill call, every decode row in one decode call,
    each with the sink term); otherwise (another device or dtype, no compiler: each kernel
    counts its reason) the torch path for the whole batch."""
    if q.device.type != "cpu":  # no native kernel there (and nothing counted): torch at once
        return softcap_attention(q, k, v, k_cache, v_cache, slot_mapping, plan, scale, None, sinks)
    kv_heads, head_dim = k.shape[1], q.shape[2]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)
    prompts = plan.prefill is not None or plan.spans or plan.fresh_uniform is not None
    out = torch.empty_like(q)
    done = not prompts or (
        plan.prefill is not None
        and cpu_kernels.prefill_attention(
            q, k_cache, v_cache, *plan.prefill, scale, out, sinks=sinks
        )
    )
    if done and plan.decodes:
        rows = plan.decode_rows
        qd = q if rows is None else q.index_select(0, rows)
        native = cpu_kernels.decode_attention(
            qd, k_cache, v_cache, plan.decode_tables, plan.decode_ctx, scale, sinks=sinks
        )
        if native is None:
            done = False
        elif rows is None:
            out.copy_(native)
        else:
            out.index_copy_(0, rows, native)
    if done:
        return out
    return softcap_attention(q, k, v, k_cache, v_cache, slot_mapping, plan, scale, None, sinks)
