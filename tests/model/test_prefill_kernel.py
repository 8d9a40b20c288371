"""The native prefill attention kernel (``gemm.c``) against SDPA with an offset
causal mask over the gathered context: fresh prompts, chunks over a cached prefix, GQA groups,
head sizes, threads; and the model path that uses it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.model import cpu_kernels

pytestmark = pytest.mark.usefixtures("kernel_isa")  # every test once per ISA variant


@pytest.fixture(autouse=True)
def _kernel():
    if not cpu_kernels.available():
        pytest.fail("the C compiler is part of the test environment; the kernel must build")


def _case(heads, kv_heads, head_dim, block_size, seqs, seed, stride_pad=0):
    """Random paged cache and query rows for ``seqs`` = [(context, new tokens)], rows of the
    sequences separated by ``stride_pad`` unrelated rows (like decode rows in a mixed batch)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // block_size) for c, _ in seqs) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(-(-c // block_size) for c, _ in seqs)
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int64)
    used, starts, row = 0, [], 0
    for i, (c, n) in enumerate(seqs):
        nb = -(-c // block_size)
        tables[i, :nb] = perm[used : used + nb]
        used += nb
        starts.append(row)
        row += n + stride_pad
    # q as a view with a wider token stride, like q inside the fused qkv GEMM output
    qkv = torch.randn(row, heads + 2 * kv_heads, head_dim, generator=g)
    q = qkv[:, :heads]
    ctx = torch.tensor([c for c, _ in seqs], dtype=torch.int64)
    qlen = torch.tensor([n for _, n in seqs], dtype=torch.int64)
    return q, k_cache, v_cache, tables, ctx, torch.tensor(starts, dtype=torch.int64), qlen


def _reference(q, k_cache, v_cache, tables, ctx, starts, qlen, scale, out):
    """Causal SDPA in float64 per sequence, written into ``out``'s rows of it."""
    q, k_cache, v_cache = q.double(), k_cache.double(), v_cache.double()
    bs, kvh, d = k_cache.shape[1:]
    group = q.shape[1] // kvh
    for i in range(len(ctx)):
        c, n, s = int(ctx[i]), int(qlen[i]), int(starts[i])
        blocks = tables[i, : -(-c // bs)]
        k = k_cache[blocks].reshape(-1, kvh, d)[:c].repeat_interleave(group, 1).transpose(0, 1)
        v = v_cache[blocks].reshape(-1, kvh, d)[:c].repeat_interleave(group, 1).transpose(0, 1)
        mask = torch.arange(c)[None, :] <= torch.arange(c - n, c)[:, None]
        o = F.scaled_dot_product_attention(
            q[s : s + n].transpose(0, 1), k, v, attn_mask=mask, scale=scale
        )
        out[s : s + n] = o.transpose(0, 1)
    return out


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size,seqs",
    [
        (8, 4, 64, 16, [(272, 272)]),  # the benchmark model, a fresh prompt
        (8, 4, 64, 16, [(1, 1), (15, 15), (16, 16), (17, 17), (33, 33)]),  # block edges
        (8, 4, 64, 16, [(700, 300), (90, 7), (40, 1)]),  # chunks over cached prefixes
        (16, 2, 128, 8, [(530, 530), (1200, 512)]),  # GQA 8, head dim 128
        (6, 6, 32, 32, [(65, 65), (100, 36)]),  # MHA, head dim 32
        (12, 4, 96, 16, [(47, 47)]),  # head dim 96, G 3 (not a power of two)
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_masked_sdpa(heads, kv_heads, head_dim, block_size, seqs, threads):
    q, kc, vc, tables, ctx, starts, qlen = _case(
        heads, kv_heads, head_dim, block_size, seqs, seed=heads * 7 + len(seqs), stride_pad=2
    )
    scale = head_dim**-0.5
    got = torch.full_like(q, float("nan"))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert cpu_kernels.prefill_attention(q, kc, vc, tables, ctx, starts, qlen, scale, got)
    finally:
        torch.set_num_threads(before)
    want = _reference(q, kc, vc, tables, ctx, starts, qlen, scale, torch.full_like(q, 7.0))
    rows = torch.cat(
        [torch.arange(int(s), int(s) + int(n)) for s, n in zip(starts, qlen, strict=True)]
    )
    # float32 sums against float64 (the kernel's exp held to ~3e-7 relative: with 2^f over
    # f in [0, 1) instead of [-1/2, 1/2] it was 5e-6 off)
    assert (got[rows] - want[rows]).abs().max().item() < 2e-6
    other = torch.ones(q.shape[0], dtype=torch.bool)
    other[rows] = False
    assert torch.isnan(got[other]).all()  # rows between the sequences are left alone


def test_not_applicable():
    q, kc, vc, tables, ctx, starts, qlen = _case(8, 4, 64, 16, [(20, 20)], seed=1)
    out = torch.empty_like(q)
    args = (tables, ctx, starts, qlen, 0.125)
    bf = kc.bfloat16()
    assert not cpu_kernels.prefill_attention(q.bfloat16(), bf, bf, *args, out.bfloat16())
    q3, kc3, vc3, *rest = _case(4, 2, 36, 16, [(20, 20)], seed=2)  # head dim not a vector
    assert not cpu_kernels.prefill_attention(q3, kc3, vc3, *rest, 0.1, torch.empty_like(q3))
    # more new tokens than context is no batch at all: the op refuses it, nothing written
    bad = torch.full_like(q, 3.0)
    with pytest.raises(RuntimeError, match="more new tokens than context"):
        cpu_kernels.prefill_attention(q, kc, vc, tables, ctx - 5, starts, qlen, 0.1, bad)
    assert (bad == 3.0).all()


@pytest.mark.parametrize("with_decode", [False, True])
def test_paged_attention_uses_the_kernel_and_matches_the_torch_path(monkeypatch, with_decode):
    """``paged_attention`` over a batch of a fresh prompt and a chunk over a cached prefix
    (plus a decode row, or not) sends the prompt rows through the kernel in one call (counted)
    and gives the torch path's output."""
    from shared.model import attention
    from shared.model.api import AttentionMetadata

    seqs = [(300, 300), (90, 40)] + ([(57, 1)] if with_decode else [])
    _, kc, vc, tables, ctx, _, qlen = _case(8, 4, 64, 16, seqs, seed=3)
    t = int(qlen.sum())
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(t, n, 64, generator=g) for n in (8, 4, 4))
    slots = [  # the new tokens' cache slots: positions ctx - qlen .. ctx - 1 of each sequence
        int(tables[i, p // 16]) * 16 + p % 16
        for i in range(len(seqs))
        for p in range(int(ctx[i] - qlen[i]), int(ctx[i]))
    ]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, *qlen.cumsum(0).tolist()]),
        context_lens=ctx,
        block_tables=tables,
        slot_mapping=torch.tensor(slots),
        query_lens=qlen.tolist(),
        context_lens_list=ctx.tolist(),
    )
    plan = attention.AttentionPlan.build(meta, 16, torch.device("cpu"))
    calls = []
    real = cpu_kernels.prefill_attention

    def counting(*a, **kw):
        calls.append(real(*a, **kw))
        return calls[-1]

    monkeypatch.setattr(cpu_kernels, "prefill_attention", counting)
    got = attention.paged_attention(q, k, v, kc.clone(), vc.clone(), meta.slot_mapping, plan, 0.125)
    assert calls == [True]
    monkeypatch.setattr(cpu_kernels, "prefill_attention", lambda *a, **kw: False)
    want = attention.paged_attention(
        q, k, v, kc.clone(), vc.clone(), meta.slot_mapping, plan, 0.125
    )
    assert (got - want).abs().max().item() < 1e-5
