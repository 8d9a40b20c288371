"""The native decode-attention kernel against the torch path it replaces (and SDPA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.model import cpu_kernels


def _reference(q, k_cache, v_cache, tables, ctx, scale):
    """Per-sequence SDPA over the gathered context (GQA by repeating K/V heads)."""
    kvh, bs = k_cache.shape[2], k_cache.shape[1]
    group = q.shape[1] // kvh
    out = []
    for i, n in enumerate(ctx.tolist()):
        blocks = tables[i, : -(-n // bs)]
        k = k_cache[blocks].reshape(-1, kvh, q.shape[2])[:n].repeat_interleave(group, dim=1)
        v = v_cache[blocks].reshape(-1, kvh, q.shape[2])[:n].repeat_interleave(group, dim=1)
        out.append(
            F.scaled_dot_product_attention(
                q[i][:, None], k.transpose(0, 1), v.transpose(0, 1), scale=scale
            )[:, 0]
        )
    return torch.stack(out)


@pytest.fixture(autouse=True)
def _kernel():
    if not cpu_kernels.available():
        pytest.fail("the C compiler is part of the test environment; the kernel must build")


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size,ctx",
    [
        (8, 4, 64, 16, [256] * 8),  # equal contexts
        (8, 8, 64, 16, [1, 2, 15, 16, 17, 100]),  # MHA, block-boundary lengths
        (16, 2, 128, 8, [3000, 40, 700, 2500]),  # GQA 8, long contexts (threaded split)
        (6, 3, 80, 32, [33, 64, 65]),  # head dim 5 x 16
        (4, 2, 72, 16, [5, 300, 17]),  # head dim not a multiple of 16: portable path
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_sdpa(heads, kv_heads, head_dim, block_size, ctx, threads):
    g = torch.Generator().manual_seed(sum(ctx) + heads)
    num_blocks = sum(-(-n // block_size) for n in ctx) + 5
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    perm = torch.randperm(num_blocks, generator=g)  # scattered, like a long-running pool
    max_blocks = max(-(-n // block_size) for n in ctx)
    tables = torch.zeros(len(ctx), max_blocks, dtype=torch.long)
    used = 0
    for i, n in enumerate(ctx):
        nb = -(-n // block_size)
        tables[i, :nb] = perm[used : used + nb]
        used += nb
    q = torch.randn(len(ctx), heads, head_dim, generator=g)
    lens = torch.tensor(ctx)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_kernels.decode_attention(q, k_cache, v_cache, tables, lens, head_dim**-0.5)
    finally:
        torch.set_num_threads(before)
    want = _reference(q, k_cache, v_cache, tables, lens, head_dim**-0.5)
    assert got is not None
    assert (got - want).abs().max().item() < 1e-5


def test_not_applicable_returns_none():
    q = torch.randn(2, 4, 64, dtype=torch.bfloat16)
    cache = torch.randn(4, 16, 2, 64, dtype=torch.bfloat16)
    tables = torch.tensor([[0], [1]])
    assert cpu_kernels.decode_attention(q, cache, cache, tables, torch.tensor([3, 4]), 0.1) is None
    strided = torch.randn(4, 16, 4, 64)[:, :, :2]
    assert (
        cpu_kernels.decode_attention(q.float(), strided, strided, tables, torch.tensor([3, 4]), 0.1)
        is None
    )


def test_kernel_source_is_package_data():
    """The C source is a file beside the module (a plain checkout finds it) and pyproject ships
    it with the package (``pip install .`` finds it too)."""
    import fnmatch
    import tomllib
    from pathlib import Path

    src = Path(cpu_kernels.__file__).with_name("decode_attention.c")
    assert src == cpu_kernels._SOURCE and "strata_decode_attn_f32" in src.read_text()
    root = Path(cpu_kernels.__file__).parents[2]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = data["package-data"]["shared.model"]
    assert any(fnmatch.fnmatch(src.name, p) for p in patterns)
