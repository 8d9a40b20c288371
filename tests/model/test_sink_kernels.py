"""The attention-sink term (GPT-OSS) in the native decode and prefill attention kernels, on every
ISA variant this CPU runs (`kernel_isa`): head h's sink logit joins each row's softmax
denominator as a key whose value is zero. Against a reference written out here (scores, the
sink column, softmax, the column dropped), for head sizes that take each code path (the
portable body, AVX2 / AVX-512 with and without the constant-size bodies), grouped heads, a
context over several blocks, a chunk over a cached prefix and a fresh prompt; sinks far above
and far below the scores; and the kernels counted for the variant."""

from __future__ import annotations

import pytest
import torch

from shared.model import cpu_kernels


def _reference(q, keys, values, scale, sinks, causal_from: int | None = None):
    """``q [n, H, D]`` over ``keys``/``values`` ``[ctx, KVH, D]``; query i at position
    ``causal_from + i`` (None: every key visible, a decode)."""
    n, heads, _ = q.shape
    group = heads // keys.shape[1]
    k = keys.repeat_interleave(group, 1).transpose(0, 1).double()  # [H, ctx, D]
    v = values.repeat_interleave(group, 1).transpose(0, 1).double()
    s = torch.matmul(q.transpose(0, 1).double(), k.transpose(1, 2)) * scale  # [H, n, ctx]
    if causal_from is not None:
        pos = torch.arange(causal_from, causal_from + n)
        s = s.masked_fill(torch.arange(keys.shape[0])[None, :] > pos[:, None], float("-inf"))
    col = sinks.double()[:, None, None].expand(-1, n, 1)
    p = torch.softmax(torch.cat([s, col], -1), -1)[..., :-1]
    return torch.matmul(p, v).transpose(0, 1).float()  # [n, H, D]


def _cache(blocks: int, bs: int, kvh: int, d: int):
    return torch.randn(blocks, bs, kvh, d), torch.randn(blocks, bs, kvh, d)


def _gather(cache, table: list[int], n: int, bs: int):
    return torch.cat([cache[b] for b in table])[:n]


@pytest.mark.parametrize("d", [20, 32, 64, 128])
@pytest.mark.parametrize("shift", [0.0, 40.0, -40.0])
def test_decode_attention_takes_the_sinks(kernel_isa, d, shift):
    torch.manual_seed(d)
    heads, kvh, bs = 4, 2, 16
    kc, vc = _cache(6, bs, kvh, d)
    tables = torch.tensor([[3, 0, 5], [1, 4, 2]])
    ctx = torch.tensor([37, 9])
    q = torch.randn(2, heads, d)
    sinks = torch.randn(heads) * 2 + shift  # +40: the sink takes nearly all; -40: nearly none
    before = cpu_kernels.calls[kernel_isa, "decode_attention"]
    out = cpu_kernels.decode_attention(q, kc, vc, tables, ctx, 0.25, sinks=sinks)
    assert out is not None
    assert cpu_kernels.calls[kernel_isa, "decode_attention"] - before == 1
    for b in range(2):
        n, table = int(ctx[b]), tables[b].tolist()
        keys, values = _gather(kc, table, n, bs), _gather(vc, table, n, bs)
        want = _reference(q[b : b + 1], keys, values, 0.25, sinks)[0]
        torch.testing.assert_close(out[b], want, rtol=1e-4, atol=1e-5)
    plain = cpu_kernels.decode_attention(q, kc, vc, tables, ctx, 0.25)
    if shift >= 0:  # the sink's share is missing from every row of the plain kernel's answer
        assert not torch.allclose(plain, out, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("d", [32, 64])
@pytest.mark.parametrize("shift", [0.0, 40.0, -40.0])
def test_prefill_attention_takes_the_sinks(kernel_isa, d, shift):
    """Two sequences in one call: a 13-token chunk over a 21-token cached prefix (34 in all,
    three blocks) and a fresh 7-token prompt."""
    torch.manual_seed(100 + d)
    heads, kvh, bs = 4, 2, 16
    kc, vc = _cache(6, bs, kvh, d)
    tables = torch.tensor([[4, 1, 3], [0, 5, 2]], dtype=torch.int64)
    ctx = torch.tensor([34, 7], dtype=torch.int64)
    qlen = torch.tensor([13, 7], dtype=torch.int64)
    qstart = torch.tensor([0, 13], dtype=torch.int64)
    q = torch.randn(20, heads, d)
    sinks = torch.randn(heads) * 2 + shift
    out = torch.empty_like(q)
    before = cpu_kernels.calls[kernel_isa, "prefill_attention"]
    if not cpu_kernels.prefill_attention(
        q, kc, vc, tables, ctx, qstart, qlen, 0.25, out, sinks=sinks
    ):
        pytest.skip(f"head size {d} is not whole panels of the {kernel_isa} kernel")
    assert cpu_kernels.calls[kernel_isa, "prefill_attention"] - before == 1
    for s in range(2):
        n, ql, q0 = int(ctx[s]), int(qlen[s]), int(qstart[s])
        keys = _gather(kc, tables[s].tolist(), n, bs)
        values = _gather(vc, tables[s].tolist(), n, bs)
        want = _reference(q[q0 : q0 + ql], keys, values, 0.25, sinks, causal_from=n - ql)
        torch.testing.assert_close(out[q0 : q0 + ql], want, rtol=1e-4, atol=1e-5)


def test_sinks_of_the_wrong_size_are_refused():
    if not cpu_kernels.available():
        pytest.skip(f"no native kernels here: {cpu_kernels.off_reason()}")
    kc, vc = _cache(2, 16, 2, 32)
    q = torch.randn(1, 4, 32)
    with pytest.raises(RuntimeError, match="sinks has 3 elements, not 4"):
        cpu_kernels.decode_attention(
            q, kc, vc, torch.tensor([[0, 1]]), torch.tensor([20]), 0.2, sinks=torch.zeros(3)
        )
