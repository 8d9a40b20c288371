"""The native CPU kernels against what they replace: decode attention against the torch path
(and SDPA), the float32 GEMM against a float64 product."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.model import cpu_kernels

pytestmark = pytest.mark.usefixtures("kernel_isa")  # every test once per ISA variant


def _reference(q, k_cache, v_cache, tables, ctx, scale):
    """Per-sequence SDPA in float64 over the gathered context (GQA by repeating K/V heads)."""
    q, k_cache, v_cache = q.double(), k_cache.double(), v_cache.double()
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
        (4, 2, 72, 16, [5, 300, 17]),  # head dim 9 x 8: AVX2 path, portable on AVX-512
        (6, 3, 24, 16, [1, 9, 70]),  # 3 x 8, short contexts: softmax lanes past the end
        (4, 4, 20, 16, [7, 40]),  # not a multiple of 8: portable path everywhere
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
    # float32 sums against float64: ~1e-6 at most. The vectorised softmax's exp is held to
    # it too (with 2^f over f in [0, 1) instead of [-1/2, 1/2] it was 5e-6 off)
    assert (got.double() - want).abs().max().item() < 2e-6


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
    gemm = Path(cpu_kernels.__file__).with_name("gemm.c")
    assert gemm in cpu_kernels._SOURCES and "strata_gemm_f32" in gemm.read_text()
    root = Path(cpu_kernels.__file__).parents[2]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = data["package-data"]["shared.model"]
    assert cpu_kernels._HEADERS
    for f in (*cpu_kernels._SOURCES, *cpu_kernels._HEADERS):
        assert f.exists() and any(fnmatch.fnmatch(f.name, p) for p in patterns), f.name


@pytest.mark.parametrize(
    "rows,k,n",
    [
        (1, 512, 1024),  # one decode row
        (16, 512, 2816),  # a decode batch, the benchmark model's gate_up
        (7, 13, 37),  # ragged: row tile, odd K, last panel narrower than the kernel's width
        (97, 1408, 20),  # more rows than one work item, K over one K-block, N under a panel
        (300, 515, 129),  # prefill-sized, several K-blocks with a tail
        (0, 64, 8),  # no rows
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_matches_float64(rows, k, n, bias):
    torch.manual_seed(rows * 7 + k + n)
    w = torch.randn(n, k)
    b = torch.randn(n) if bias else None
    x = torch.randn(rows, k)
    packed = cpu_kernels.pack_linear(w)
    got = cpu_kernels.linear(x, packed, b)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.shape == (rows, n) and got.dtype == torch.float32
    # float32 sums of k products of N(0,1) terms: error grows like sqrt(k) ulps of the sum
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-6 * k**0.5)


def test_gemm_rows_do_not_depend_on_the_batch():
    """Each output is summed over k in one fixed order, so a row's result is bit-identical
    whatever else is in the batch (a decode row alone or among 40 others, or in a prefill)."""
    w, x = torch.randn(300, 700), torch.randn(41, 700)
    packed = cpu_kernels.pack_linear(w)
    whole = cpu_kernels.linear(x, packed, None)
    for i in (0, 5, 6, 40):
        assert torch.equal(cpu_kernels.linear(x[i : i + 1], packed, None)[0], whole[i])
    assert torch.equal(cpu_kernels.linear(x[3:20], packed, None), whole[3:20])


@pytest.mark.parametrize(
    "shape,n",
    [
        ((2, 3, 64), 96),  # leading dims, a few panels
        ((16, 512), 2816),  # a decode batch: many panels handed out in runs
        ((300, 515), 700),  # several row blocks x panels, a K tail
    ],
)
def test_gemm_keeps_leading_dims_and_threads_agree(shape, n):
    """Work items are handed out to the threads as they come free (OpenMP dynamic), so which
    thread computes an output varies from call to call; its sum must not."""
    w, x = torch.randn(n, shape[-1]), torch.randn(*shape)
    packed = cpu_kernels.pack_linear(w)
    got = cpu_kernels.linear(x, packed, None)
    assert got.shape == (*shape[:-1], n)
    torch.testing.assert_close(got, x @ w.T, rtol=1e-4, atol=1e-4 * shape[-1] ** 0.5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernels.linear(x, packed, None)
        torch.set_num_threads(2)
        two = [cpu_kernels.linear(x, packed, None) for _ in range(3)]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, got) and all(torch.equal(one, t) for t in two)


def test_gemm_not_applicable():
    assert cpu_kernels.pack_linear(torch.randn(8, 8, dtype=torch.bfloat16)) is None
    assert cpu_kernels.pack_linear(torch.randn(2, 8, 8)) is None


def test_native_gemm_choice(monkeypatch):
    """``STRATA_CPU_GEMM``: ``auto`` (the default) and ``native`` pick the native kernel on any
    CPU (measured no slower than oneDNN on AVX2 and AVX-512), ``onednn`` keeps oneDNN's."""
    monkeypatch.delenv("STRATA_CPU_GEMM", raising=False)
    assert cpu_kernels.native_gemm_chosen()
    assert cpu_kernels.native_gemm_chosen("auto") and cpu_kernels.native_gemm_chosen("native")
    assert not cpu_kernels.native_gemm_chosen("onednn")
    monkeypatch.setenv("STRATA_CPU_GEMM", "onednn")
    assert not cpu_kernels.native_gemm_chosen()


def test_layers_route_float32_and_bf16_to_the_chosen_gemm(monkeypatch):
    """`Gemm` (every projection of the models) packs float32 and bf16 weights for the native
    kernels when they are chosen, for oneDNN otherwise; all give F.linear's result (bf16: to
    its rounding of the output)."""
    from shared.model import layers
    from shared.model.bf16 import PackedBF16
    from shared.model.layers import Gemm

    w, b, x = torch.randn(40, 32), torch.randn(40), torch.randn(5, 32)
    wb, bb, xb = w.bfloat16(), b.bfloat16(), x.bfloat16()
    monkeypatch.setattr(layers, "NATIVE_CPU_GEMM", True)
    g = Gemm(w, b)
    assert g.native is not None and g.packed is None
    torch.testing.assert_close(g(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    gb = Gemm(wb, bb)
    assert type(gb.native) is PackedBF16 and gb.packed is None
    torch.testing.assert_close(gb(xb), F.linear(xb, wb, bb))  # bf16 in, bf16 out
    wide = F.linear(xb.float(), wb.float(), bb.float())  # float32 rows: a float32 result
    assert gb(xb.float()).dtype == torch.float32
    torch.testing.assert_close(gb(xb.float()), wide, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(layers, "NATIVE_CPU_GEMM", False)
    g, gb = Gemm(w, b), Gemm(wb, bb)
    assert g.native is None and g.packed is not None
    # oneDNN packs bf16 only where the CPU has avx512bw/vl/dq or avx_ne_convert (not AVX2-only
    # boxes); there the bf16 weight runs F.linear
    onednn_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert gb.native is None and (gb.packed is not None) == onednn_bf16
    torch.testing.assert_close(g(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gb(xb), F.linear(xb, wb, bb))


def _torch_rms(h, w, eps):
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("rows,dim", [(1, 512), (16, 1024), (3000, 64), (5, 13)])
def test_rms_norm_matches_the_torch_path(rows, dim):
    x, r, w = torch.randn(rows, dim), torch.randn(rows, dim), torch.randn(dim)
    h, y = cpu_kernels.rms_norm(x, w, 1e-6)
    assert h is x
    torch.testing.assert_close(y, _torch_rms(x, w, 1e-6), rtol=2e-6, atol=1e-6)
    h, y = cpu_kernels.rms_norm(x, w, 1e-6, residual=r)
    assert torch.equal(h, x + r)  # the fused add is the same float add
    torch.testing.assert_close(y, _torch_rms(x + r, w, 1e-6), rtol=2e-6, atol=1e-6)


def test_qk_norm_rope_matches_the_torch_path():
    """RoPE alone is bit-identical to `apply_rope` (no FMA contraction); with q/k norm it is
    within float32 rounding of `_qk_norm` + `apply_rope`. Only the q and k heads change."""
    from shared.model.layers import Rotary, apply_rope

    t, nh, nkv, d = 37, 8, 2, 64
    cos, sin = Rotary(d, 10000.0, None, "cpu")(torch.arange(t) * 3, torch.float32)
    qkv = torch.randn(t, nh + 2 * nkv, d)
    want = apply_rope(qkv[:, : nh + nkv], cos, sin)
    got = qkv.clone()
    assert cpu_kernels.qk_norm_rope(got, nh + nkv, nh, None, None, 0.0, cos, sin)
    assert torch.equal(got[:, : nh + nkv], want)
    assert torch.equal(got[:, nh + nkv :], qkv[:, nh + nkv :])

    wq, wk = torch.randn(d), torch.randn(d)
    normed = torch.cat(
        [_torch_rms(qkv[:, :nh], wq, 1e-6), _torch_rms(qkv[:, nh : nh + nkv], wk, 1e-6)], 1
    )
    got = qkv.clone()
    assert cpu_kernels.qk_norm_rope(got, nh + nkv, nh, wq, wk, 1e-6, cos, sin)
    torch.testing.assert_close(
        got[:, : nh + nkv], apply_rope(normed, cos, sin), rtol=2e-6, atol=2e-6
    )
    assert torch.equal(got[:, nh + nkv :], qkv[:, nh + nkv :])


def test_fused_ops_not_applicable():
    w = torch.randn(64)
    assert (
        cpu_kernels.rms_norm(torch.randn(4, 64, dtype=torch.bfloat16), w.bfloat16(), 1e-6) is None
    )
    assert cpu_kernels.rms_norm(torch.randn(64, 4).T, w, 1e-6) is None  # not contiguous
    cos = sin = torch.randn(3, 64)
    assert not cpu_kernels.qk_norm_rope(
        torch.randn(3, 4, 64).bfloat16(), 2, 1, None, None, 0.0, cos, sin
    )
    assert not cpu_kernels.qk_norm_rope(torch.randn(3, 4, 63), 2, 1, None, None, 0.0, cos, sin)


def test_every_exported_kernel_is_declared_once_and_bound():
    """Every non-static ``strata_*`` function of the sources is declared in ``kernels.h`` (which
    every source includes, so the compiler holds each definition to its declaration) and bound
    by name by the torch ops (``STRATA_KERNELS`` in ``torch_ops.cpp``, typed from the header):
    nothing restates a signature by hand, and a kernel left unbound fails here."""
    import re

    from shared.model import torch_ops

    assert cpu_kernels.available()
    names = set()
    for src in cpu_kernels._SOURCES:
        text = src.read_text()
        assert '#include "kernels.h"' in text, src.name
        names |= set(re.findall(r"^\w[\w *]*?\b(strata_\w+)\(", text, re.M))
    assert {"strata_gemm_f32", "strata_rms_norm_f32", "strata_decode_attn_f32"} <= names
    header = torch_ops.HEADER.read_text()
    declared = set(re.findall(r"\b(strata_\w+)\(", header))
    bound = set(re.findall(r"X\((strata_\w+)\)", torch_ops.SOURCE.read_text()))
    assert names == declared == bound
    assert torch_ops.HEADER in cpu_kernels._HEADERS  # hashed into every variant's build
