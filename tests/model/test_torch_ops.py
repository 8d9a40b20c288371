"""The native kernels as torch custom ops, ``torch.ops.strata.*`` (`shared.model.torch_ops`):
each op bound to every ISA variant this CPU runs, equal to the torch reference the kernel tests
use (bit for bit where the arithmetic is the same: the int8 GEMM, the residual add), passing
torch's own op checks (schema, fake tensors, AOT dispatch), refusing bad input by name; the
model's forward on CPU float32 runs through them (one-call layer and op by op), and nothing
calls a kernel through ctypes."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from shared.model import bf16, cpu_kernels, torch_ops
from shared.model.api import AttentionMetadata
from shared.model.attention import AttentionPlan
from shared.model.models import llama
from tests.model import test_native_layer as native_layer
from tests.model.paged_driver import PagedDriver
from tests.model.test_int8_gemm import w8a8_reference

pytestmark = pytest.mark.usefixtures("kernel_isa")  # every test once per ISA variant
ops = torch.ops.strata


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_ops_run_the_loaded_variant(kernel_isa):
    assert torch_ops.bound == kernel_isa == cpu_kernels.loaded_isa()
    assert ops.gemm_panel_width() in (8, 16, 32, 64)


@pytest.mark.parametrize("shape", [(1, 64), (7, 3, 100), (33, 2048)])
def test_rms_norm_and_add_rms_norm(shape):
    torch.manual_seed(shape[-1])
    x, res, w = torch.randn(shape), torch.randn(shape), torch.randn(shape[-1])
    y = ops.rms_norm(x, w, 1e-6)
    _close(y, _rms(x, w, 1e-6))
    h, y2 = ops.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(h, x + res)  # one float32 add, as torch's
    _close(y2, _rms(x + res, w, 1e-6))
    assert torch.equal(cpu_kernels.rms_norm(x, w, 1e-6)[1], y)  # the wrapper the model calls
    torch.library.opcheck(ops.rms_norm.default, (x, w, 1e-6))
    torch.library.opcheck(ops.add_rms_norm.default, (x, res, w, 1e-6))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos[:, None] + rot * sin[:, None]


@pytest.mark.parametrize("norm", [True, False])
def test_qk_norm_rope(norm):
    torch.manual_seed(1)
    t, heads, nq, d = 5, 6, 4, 64  # 4 q heads, 2 k heads normed and rotated, 2 v heads left
    qkv = torch.randn(t, heads + 2, d)
    cos, sin = (torch.randn(t, d // 2).repeat(1, 2) for _ in range(2))  # halves alike, as RoPE's
    wq, wk = (torch.randn(d), torch.randn(d)) if norm else (None, None)
    want = qkv.clone()
    if norm:
        want[:, :nq] = _rms(want[:, :nq], wq, 1e-6)
        want[:, nq:heads] = _rms(want[:, nq:heads], wk, 1e-6)
    want[:, :heads] = _rope(want[:, :heads], cos, sin)
    got = qkv.clone()
    ops.qk_norm_rope_(got, heads, nq, wq, wk, 1e-6, cos, sin)
    _close(got, want)
    assert torch.equal(got[:, heads:], qkv[:, heads:])
    torch.library.opcheck(ops.qk_norm_rope_.default, (qkv, heads, nq, wq, wk, 1e-6, cos, sin))


def _cache(blocks: int, bs: int, kvh: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(blocks, bs, kvh, d), torch.randn(blocks, bs, kvh, d)


def _context(cache: torch.Tensor, table: list[int], n: int, group: int) -> torch.Tensor:
    """``[H, n, D]``: a sequence's first ``n`` cached rows, each KV head repeated ``group``x."""
    return torch.cat([cache[b] for b in table])[:n].repeat_interleave(group, 1).transpose(0, 1)


def test_decode_attention():
    torch.manual_seed(2)
    kc, vc = _cache(6, 16, 2, 64)
    q, tables, ctx = torch.randn(2, 4, 64), torch.tensor([[2, 0], [1, 5]]), torch.tensor([20, 31])
    got = ops.decode_attention(q, kc, vc, tables, ctx, 0.2)
    for i in range(2):
        k, v = (_context(c, tables[i].tolist(), int(ctx[i]), 2) for c in (kc, vc))
        want = F.scaled_dot_product_attention(q[i][:, None], k, v, scale=0.2)[:, 0]
        _close(got[i], want)
    assert torch.equal(cpu_kernels.decode_attention(q, kc, vc, tables, ctx, 0.2), got)
    torch.library.opcheck(ops.decode_attention.default, (q, kc, vc, tables, ctx, 0.2))


def test_prefill_attention():
    torch.manual_seed(3)
    d = 64
    kc, vc = _cache(6, 16, 2, d)
    q = torch.randn(12, 4, d)
    tables, ctx = torch.tensor([[3, 4], [0, 1]]), torch.tensor([20, 7])
    qstart, qlen = torch.tensor([0, 5]), torch.tensor([5, 7])
    args = (q, kc, vc, tables, ctx, qstart, qlen, 0.125)
    got = torch.zeros_like(q)
    ops.prefill_attention_(*args, got)
    for s in range(2):
        n, m, a = int(ctx[s]), int(qlen[s]), int(qstart[s])
        k, v = (_context(c, tables[s].tolist(), n, 2) for c in (kc, vc))
        mask = torch.ones(m, n, dtype=torch.bool).tril(n - m)  # the new rows are the last ones
        qs = q[a : a + m].transpose(0, 1)
        want = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=0.125)
        _close(got[a : a + m], want.transpose(0, 1))
    torch.library.opcheck(ops.prefill_attention_.default, (*args, torch.zeros_like(q)))


@pytest.mark.parametrize("bias", [False, True])
def test_pack_linear_and_linear(bias):
    torch.manual_seed(4)
    w, x = torch.randn(100, 70), torch.randn(9, 70)
    b = torch.randn(100) if bias else None
    packed = ops.pack_linear(w)
    got = ops.linear(x, packed, 100, b)
    _close(got, F.linear(x, w, b))
    assert torch.equal(cpu_kernels.linear(x, cpu_kernels.pack_linear(w), b), got)
    torch.library.opcheck(ops.pack_linear.default, (w,))
    torch.library.opcheck(ops.linear.default, (x, packed, 100, b))


@pytest.mark.parametrize("bias", [False, True])
def test_pack_int8_and_linear_int8(bias):
    g = torch.Generator().manual_seed(5)
    w = torch.randn(100, 70, generator=g)
    scale = w.abs().amax(1) / 127
    w8 = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    x = torch.randn(9, 70, generator=g)
    b = torch.randn(100, generator=g) if bias else None
    packed = ops.pack_int8(w8, scale)
    assert packed.dtype == torch.uint8 and packed.numel() == ops.int8_packed_bytes(100, 70)
    got = ops.linear_int8(x, packed, 100, b)
    assert torch.equal(got, w8a8_reference(x, w8, scale, b))
    torch.library.opcheck(ops.pack_int8.default, (w8, scale))
    torch.library.opcheck(ops.linear_int8.default, (x, packed, 100, b))


@pytest.mark.parametrize("bias,dot_rows", [(False, 0), (True, 0), (True, 1)])
def test_pack_bf16_and_linear_bf16(bias, dot_rows):
    g = torch.Generator().manual_seed(6)
    w = torch.randn(100, 71, generator=g).bfloat16()
    x = torch.randn(9, 71, generator=g)
    b = torch.randn(100, generator=g) if bias else None
    packed = ops.pack_bf16(w)
    assert packed.dtype == torch.bfloat16 and packed.numel() == ops.bf16_packed_numel(100, 71)
    got = ops.linear_bf16(x, packed, 100, b, dot_rows)
    bf = bf16.pack_bf16(w, dot_rows=dot_rows)
    assert torch.equal(bf16.linear_bf16(x, bf, b), got)
    want = F.linear(x, w.float(), b)  # the dot path: within the rows' bf16 rounding
    torch.testing.assert_close(
        got, want, rtol=1e-5 if not dot_rows else 2e-2, atol=5e-2 * dot_rows + 1e-5
    )
    torch.library.opcheck(ops.pack_bf16.default, (w,))
    torch.library.opcheck(ops.linear_bf16.default, (x, packed, 100, b, dot_rows))


def _one_layer_batch(model, t: int):
    """A layer of ``model`` and the arguments of one prefill forward of ``t`` tokens over it."""
    layer = model.model.layers[0].native()
    d = layer.head_dim
    pos = torch.arange(t)
    cos, sin = model.rotary()(pos, torch.float32)
    prefill = (torch.tensor([[0]]), torch.tensor([t]), torch.tensor([0]), torch.tensor([t]))
    batch = cpu_kernels.layer_batch([layer], cos, sin, pos, prefill, None)
    kc, vc = (torch.zeros(2, 16, model.num_kv_heads, d, dtype=model.dtype) for _ in "kv")
    return layer, batch, kc, vc


def test_decoder_layer_op_is_the_torch_layer():
    """The op fills ``strata_layer`` from its arguments: every norm with its own weights and eps
    (so a field filled from the wrong argument shows), against the op-at-a-time layer."""
    model = native_layer._model()
    block = model.model.layers[0]
    norms = (block.input_layernorm, block.post_attention_layernorm)
    norms += (block.self_attn.q_norm, block.self_attn.k_norm)
    with torch.no_grad():
        for norm, eps in zip(norms, (0.5, 0.05, 0.2, 0.2), strict=True):
            norm.weight.uniform_(0.5, 1.5)
            norm.eps = eps
    layer, batch, kc, vc = _one_layer_batch(model, 5)
    h = torch.randn(5, model.hidden_size)
    got = h.clone()
    cpu_kernels.decoder_layer(layer, batch, got, kc, vc)
    # the same layer op by op (STRATA_CPU_LAYER=0's path), on the same rows
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, 5]),
        context_lens=torch.tensor([5]),
        block_tables=torch.tensor([[0]]),
        slot_mapping=torch.arange(5),
        query_lens=[5],
        context_lens_list=[5],
    )
    plan = AttentionPlan.build(meta, 16, torch.device("cpu"))
    cos, sin = batch.args["cos"], batch.args["sin"]
    kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
    with torch.inference_mode():
        want = model.model.layers[0](h, cos, sin, plan, torch.arange(5), kc2, vc2)
    _close(got, want)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)  # the same K/V bits written
    ordered = (*layer.ordered, *batch.ordered)
    args = (h.clone(), kc, vc, batch.scratch, *ordered)
    torch.library.opcheck(ops.decoder_layer_.default, args)


def test_decoder_layer_op_takes_a_bf16_layer_and_cache():
    """A bf16 model's layer: bf16 projections (widened norms and biases), a bf16 cache."""
    model = native_layer._model(bias=True).bfloat16()
    layer, batch, kc, vc = _one_layer_batch(model, 5)
    assert layer.args["qkv_p"].dtype == kc.dtype == torch.bfloat16
    assert layer.args["ln1_w"].dtype == layer.args["qkv_b"].dtype == torch.float32
    h = torch.randn(5, model.hidden_size)
    args = (h.clone(), kc, vc, batch.scratch, *layer.ordered, *batch.ordered)
    torch.library.opcheck(ops.decoder_layer_.default, args)
    cpu_kernels.decoder_layer(layer, batch, h, kc, vc)
    assert kc.abs().sum() > 0 and torch.isfinite(h).all()


def test_bad_input_is_refused_by_name():
    with pytest.raises(RuntimeError, match="strata::rms_norm takes float32"):
        ops.rms_norm(torch.randn(2, 8).bfloat16(), torch.randn(8).bfloat16(), 1e-6)
    with pytest.raises(RuntimeError, match="weight size 7 for rows of 8"):
        ops.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)
    with pytest.raises(RuntimeError, match="strata::linear: packed has 10 elements"):
        ops.linear(torch.randn(2, 8), torch.randn(10), 4, None)
    with pytest.raises(RuntimeError, match="not a packed int8"):
        ops.linear_int8(torch.randn(2, 8), ops.pack_linear(torch.randn(4, 8)), 4, None)
    with pytest.raises(RuntimeError, match="not a packed bfloat16"):
        ops.linear_bf16(torch.randn(2, 8), ops.pack_linear(torch.randn(4, 8)), 4, None, 0)
    with pytest.raises(RuntimeError, match="block_tables must be a contiguous int64"):
        kc = torch.randn(2, 16, 2, 32)
        ops.decode_attention(torch.randn(1, 4, 32), kc, kc, torch.tensor([[0.0]]),
                             torch.tensor([3]), 0.1)  # fmt: skip
    model = native_layer._model()
    layer, batch, kc, vc = _one_layer_batch(model, 5)
    with pytest.raises(RuntimeError, match="strata::decoder_layer_: k_cache of shape"):
        cpu_kernels.decoder_layer(layer, batch, torch.randn(5, 64), kc[..., :16].contiguous(), vc)
    with pytest.raises(RuntimeError, match="v_cache and k_cache differ in shape or dtype"):
        cpu_kernels.decoder_layer(layer, batch, torch.randn(5, 64), kc, vc.bfloat16())
    with pytest.raises(RuntimeError, match="scratch of 1 floats"):
        small = cpu_kernels.LayerBatch(batch.args, torch.empty(1))
        cpu_kernels.decoder_layer(layer, small, torch.randn(5, 64), kc, vc)


class _StrataOps(TorchDispatchMode):
    """Counts the ``strata::`` ops dispatched while it is on."""

    def __init__(self):
        super().__init__()
        self.seen: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name.startswith("strata::"):
            self.seen[name.removeprefix("strata::")] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("one_call", [True, False])
def test_the_forward_runs_through_the_torch_ops(one_call, monkeypatch):
    """A prefill and a decode step of a Llama-family model in float32 on CPU: every kernel
    call is a ``torch.ops.strata`` op, counted as the wrappers count it (`cpu_kernels.calls`)."""
    monkeypatch.setattr(llama, "NATIVE_LAYER", one_call)
    model = native_layer._model(head_dim=64)  # a head size the prefill kernel takes everywhere
    drv = PagedDriver(model, block_size=16)
    seqs = [drv.new_seq(), drv.new_seq()]
    layers = model.config.num_layers
    before = collections.Counter(cpu_kernels.calls)
    with _StrataOps() as prefill:
        drv.step([(seqs[0], [1, 2, 3]), (seqs[1], [4, 5])])
    with _StrataOps() as decode:
        drv.step([(seqs[0], [6]), (seqs[1], [7])])
    counted = collections.Counter({op: n for (_, op), n in (cpu_kernels.calls - before).items()})
    if one_call:
        for step in (prefill, decode):
            assert step.seen["decoder_layer_"] == layers
            assert step.seen["rms_norm"] == 1  # the final norm
            assert step.seen["linear"] == 1  # the LM head
        assert counted["decoder_layer"] == 2 * layers
    else:
        for step, attn in ((prefill, "prefill_attention_"), (decode, "decode_attention")):
            assert step.seen[attn] == layers and "decoder_layer_" not in step.seen
            assert step.seen["linear"] == 4 * layers + 1  # qkv, o, gate/up, down; LM head
            assert step.seen["qk_norm_rope_"] == layers
            assert step.seen["add_rms_norm"] == layers  # the post-attention norm and add
        assert counted["prefill_attention"] == counted["decode_attention"] == layers
    ran = collections.Counter()
    for op, n in (prefill.seen + decode.seen).items():
        if op in _COUNTED_AS:
            ran[_COUNTED_AS[op]] += n
    assert ran == counted  # every kernel call the wrappers count is one of these ops


@pytest.mark.parametrize("one_call", [True, False])
def test_a_bf16_forward_runs_its_linears_through_the_bf16_op(one_call, monkeypatch):
    """A bf16 model: one call per layer (then only the final norm, widened, and the LM head
    from Python), or op by op with every linear on ``linear_bf16`` and the rest in torch (bf16
    rows: no other kernel)."""
    monkeypatch.setattr(llama, "NATIVE_LAYER", one_call)
    model = native_layer._model(head_dim=64).bfloat16()
    drv = PagedDriver(model, block_size=16)
    seq, layers = drv.new_seq(), model.config.num_layers
    for toks in ([1, 2, 3], [4]):
        with _StrataOps() as step:
            drv.step([(seq, toks)])
        kernels = {op: n for op, n in step.seen.items() if op in _COUNTED_AS}  # not packing
        if one_call:
            assert kernels == {"decoder_layer_": layers, "rms_norm": 1, "linear_bf16": 1}
        else:
            assert kernels == {"linear_bf16": 4 * layers + 1}


# each kernel op by the `cpu_kernels.calls` name its wrapper counts it under
_COUNTED_AS = {
    "decoder_layer_": "decoder_layer",
    "rms_norm": "rms_norm",
    "add_rms_norm": "rms_norm",
    "linear": "gemm",
    "linear_int8": "int8_gemm",
    "linear_bf16": "bf16_gemm",
    "qk_norm_rope_": "qk_norm_rope",
    "decode_attention": "decode_attention",
    "prefill_attention_": "prefill_attention",
}


def test_no_ctypes_left():
    for module in (cpu_kernels, torch_ops):
        assert "import ctypes" not in Path(module.__file__).read_text(), module.__name__


def test_the_op_sources_are_package_data():
    import fnmatch
    import tomllib

    root = Path(torch_ops.__file__).parents[2]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = data["package-data"]["shared.model"]
    for f in (torch_ops.SOURCE, torch_ops.HEADER):
        assert f.exists() and any(fnmatch.fnmatch(f.name, p) for p in patterns), f.name
