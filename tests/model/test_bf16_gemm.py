"""The native GEMM with bf16 weights (`gemm_bf16.c`, `shared.model.bf16`) and a bf16 model on it:
the widen path bit for bit the float32 kernel on the widened weight and the dot path the product
of bf16-rounded rows, on every ISA variant this CPU runs (counted per variant); the bf16 KV cache
the one-call layer writes and reads; a bf16 model's logits against the torch reference of its
weights widened to float32, one call per layer and op at a time, and an engine's greedy tokens
against the same reference; each fallback counted with its reason."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from prometheus_client import REGISTRY

from shared.model import bf16, cpu_kernels, layers
from shared.model.api import KVCache
from shared.model.models import llama
from tests.model import test_int8_gemm as int8_tests
from tests.model import test_native_layer as native_tests
from tests.model.paged_driver import PagedDriver

# K: 1, odd, even, past one K-block (384), past several; N: 1, not a multiple of any panel
# width (16, 32), exactly two panels, an odd number of panels (the dot path takes two at a time)
SHAPES = [(1, 1), (7, 3), (70, 40), (64, 64), (385, 97), (768, 96), (1408, 70)]


def _case(m: int, k: int, n: int, g: torch.Generator, bias: bool):
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g) * (1 + 10 * torch.rand(m, 1, generator=g))
    return w, x, torch.randn(n, generator=g) if bias else None


def _sum_abs(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``|x| @ |w|.T`` in float64: the scale each output's rounding errors are relative to."""
    return x.abs().double() @ w.abs().double().T


@pytest.mark.parametrize("m", [1, 3, 16, 33, 100])
def test_the_widen_path_is_the_float32_kernel_on_the_widened_weight(kernel_isa, m):
    """dot_rows 0: a pair word shifted and masked is each bf16 weight's float32 exactly, and the
    FMAs run in gemm.c's order, so the output is strata_gemm_f32's bit for bit; against torch's
    float32 product of the widened weight within float32 summation (1e-6 of sum |x w|)."""
    g = torch.Generator().manual_seed(m)
    before = cpu_kernels.calls[kernel_isa, "bf16_gemm"]
    for i, (k, n) in enumerate(SHAPES):
        w, x, b = _case(m, k, n, g, bias=i % 2 == 1)
        got = bf16.linear_bf16(x, bf16.pack_bf16(w, dot_rows=0), b)
        want = cpu_kernels.linear(x, cpu_kernels.pack_linear(w.float()), b)
        assert torch.equal(got, want), (k, n, (got - want).abs().max().item())
        ref = F.linear(x.double(), w.double(), None if b is None else b.double())
        assert ((got - ref).abs() <= 1e-6 * _sum_abs(x, w) + 1e-6).all(), (k, n)
    assert cpu_kernels.calls[kernel_isa, "bf16_gemm"] - before == len(SHAPES)


@pytest.mark.parametrize("m", [1, 3, 16, 33, 100])
def test_the_dot_path_is_the_product_of_bf16_rounded_rows(kernel_isa, m):
    """dot_rows 1 on the avx512bf16 variant: each row rounded to bf16 (nearest even) and the
    exact products summed in float32, so within 4e-6 of sum |x w| of the float64 product of the
    rounded rows (a truncating rounding is ~1e-4 off), and within bf16 rounding (2^-8 of
    sum |x w|) of the unrounded product. Where the variant has no dot path, the widen path's
    result bit for bit."""
    g = torch.Generator().manual_seed(100 + m)
    for i, (k, n) in enumerate(SHAPES):
        w, x, b = _case(m, k, n, g, bias=i % 2 == 0)
        got = bf16.linear_bf16(x, bf16.pack_bf16(w, dot_rows=1), b)
        if kernel_isa != "avx512bf16":
            assert torch.equal(got, bf16.linear_bf16(x, bf16.pack_bf16(w, dot_rows=0), b))
            continue
        bias = None if b is None else b.double()
        rounded = F.linear(x.bfloat16().double(), w.double(), bias)
        scale = _sum_abs(x, w)
        assert ((got - rounded).abs() <= 4e-6 * scale + 1e-6).all(), (k, n)
        exact = F.linear(x.double(), w.double(), bias)
        assert ((got - exact).abs() <= 2**-8 * scale + 1e-6).all(), (k, n)


@pytest.mark.parametrize("dot_rows", [0, 1])
def test_a_row_gets_the_same_result_alone_or_in_a_batch(kernel_isa, dot_rows):
    g = torch.Generator().manual_seed(1)
    w, x, b = _case(40, 300, 200, g, bias=True)
    x[7] *= 100.0  # an outlier row changes nothing for the others
    packed = bf16.pack_bf16(w, dot_rows=dot_rows)
    batch = bf16.linear_bf16(x, packed, b)
    for i in (0, 7, 39):
        assert torch.equal(bf16.linear_bf16(x[i : i + 1], packed, b)[0], batch[i])


def test_bf16_rows_in_give_bf16_out(kernel_isa):
    """Op by op in a bf16 model: bf16 rows widened, the float32 result rounded to bf16."""
    g = torch.Generator().manual_seed(2)
    w, x, b = _case(5, 64, 48, g, bias=True)
    packed = bf16.pack_bf16(w)
    got = bf16.linear_bf16(x.bfloat16(), packed, b.bfloat16())
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, bf16.linear_bf16(x.bfloat16().float(), packed, b.bfloat16()).bfloat16())


def test_the_attention_kernels_read_a_bf16_cache_as_its_widened_copy(kernel_isa):
    """The ops over a bf16 cache (what the one-call layer of a bf16 model calls) give the
    float32 kernels' output over the widened cache, bit for bit: decode (each sequence's context
    widened into a copy) and prefill (widened as its blocks are packed)."""
    torch.manual_seed(3)
    kc, vc = torch.randn(12, 16, 2, 64).bfloat16(), torch.randn(12, 16, 2, 64).bfloat16()
    tables = torch.tensor([[5, 2, 9], [0, 11, 3]])
    ctx = torch.tensor([40, 17])
    q = torch.randn(2, 4, 64)
    ops = torch.ops.strata
    want = ops.decode_attention(q, kc.float(), vc.float(), tables, ctx, 0.125)
    assert torch.equal(ops.decode_attention(q, kc, vc, tables, ctx, 0.125), want)
    qp = torch.randn(13, 4, 64)
    args = (tables, ctx, torch.tensor([0, 9]), torch.tensor([9, 4]), 0.125)
    got, want = torch.zeros_like(qp), torch.zeros_like(qp)
    ops.prefill_attention_(qp, kc, vc, *args, got)
    ops.prefill_attention_(qp, kc.float(), vc.float(), *args, want)
    assert torch.equal(got, want)


def test_the_one_call_layer_rounds_the_kv_it_writes_to_bf16(kernel_isa, monkeypatch):
    """A bf16 model's layers with a bf16 cache and with a float32 one: the first layer's K/V
    are computed alike, so the bf16 cache holds the float32 one rounded as torch rounds
    (nearest even) bit for bit, and the hidden states stay within that rounding."""
    monkeypatch.setattr(llama, "NATIVE_LAYER", True)
    model = native_tests._model(head_dim=64).bfloat16()
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        drv = PagedDriver(model, block_size=16)
        c = drv.cache
        drv.cache = KVCache.allocate(model.num_layers, c.k.shape[1], 16, 2, 64, dtype)
        before = cpu_kernels.layer_calls
        h = drv.step([(drv.new_seq(), native_tests._tokens(37, 1))])[0]
        assert cpu_kernels.layer_calls - before == model.config.num_layers
        out[dtype] = (h, drv.cache)
    (h16, c16), (h32, c32) = out[torch.bfloat16], out[torch.float32]
    assert torch.equal(c16.k[0], c32.k[0].bfloat16()) and torch.equal(c16.v[0], c32.v[0].bfloat16())
    assert (h16 - h32).abs().max().item() < 0.02 * h32.abs().max().item()


def _bf16_pair(arch: str):
    """A small random model in bf16, and the torch reference: its weights widened to float32."""
    model = int8_tests._model(arch).bfloat16()
    return model, copy.deepcopy(model).float()


def _torch_reference(model, prompt, n, forced=None):
    """Greedy tokens and logits of ``model`` with the native kernels off: torch alone."""
    mp = pytest.MonkeyPatch()
    try:
        mp.setenv("STRATA_CPU_KERNELS", "0")
        cpu_kernels.use(None)
        return int8_tests._generate(model, prompt, n, forced)
    finally:
        mp.undo()


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_a_bf16_model_runs_natively_close_to_its_float32_reference(kernel_isa, arch, monkeypatch):
    """Teacher-forced on the reference's greedy tokens, logits against it: one call per layer
    (bf16 weights, float32 hidden state, bf16 KV; only the LM head's GEMM from Python) and op by
    op (each linear on the bf16 kernel, bf16 activations between them, as before).

    Tolerance: with the dot path (this CPU's avx512bf16) one call per layer is off the reference
    by at most 0.4% (Qwen3) / 1.3% (Llama) of a step's logit range, 0.3% / 0.9% of its std on
    average; widened (the other variants: the KV cache's rounding alone) 0.1% / 0.5%; op by op,
    bf16 between all ops, 0.7% / 1.9%, 0.6% / 1.4%. The test allows 3% and 2% one call per
    layer, 5% and 4% op by op; greedy generation keeps the reference's tokens."""
    prompt = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    model, ref = _bf16_pair(arch)
    want, ref_logits = _torch_reference(ref, prompt, 16)
    assert cpu_kernels.use(kernel_isa) == kernel_isa
    layers_per_step = model.config.num_layers
    for native, (worst_max, mean_max) in ((True, (0.03, 0.02)), (False, (0.05, 0.04))):
        monkeypatch.setattr(llama, "NATIVE_LAYER", native)
        before = cpu_kernels.layer_calls, cpu_kernels.calls[kernel_isa, "bf16_gemm"]
        fallbacks = _fallbacks("decoder_layer", "dtype")
        got, logits = int8_tests._generate(model, prompt, 16, forced=want)
        layer_calls = cpu_kernels.layer_calls - before[0]
        gemms = cpu_kernels.calls[kernel_isa, "bf16_gemm"] - before[1]
        assert layer_calls == (17 * layers_per_step if native else 0)
        assert gemms == 17 * (1 if native else 4 * layers_per_step + 1)  # + the LM head
        assert _fallbacks("decoder_layer", "dtype") == fallbacks
        worst, mean = int8_tests._err(logits, ref_logits)
        assert worst < worst_max and mean < mean_max, (native, worst, mean)
        assert int8_tests._generate(model, prompt, 16)[0] == want


def test_a_bf16_checkpoint_generates_the_reference_greedy_tokens(tmp_path, monkeypatch):
    """End to end through `LLMEngine`: a bf16 checkpoint served in bf16 (its one-call layers on
    the bf16 kernel, its KV cache bf16) generates the greedy tokens of the same checkpoint
    loaded in float32 and run by torch alone (the kernels off). Random tiny models have flat
    logits: the prompts are ones whose reference tokens lead their runner-up by at least 1.8% of
    the step's logit range, where the bf16 path is off by at most 0.7% of it."""
    import transformers as tf

    from shared.engine.engine import LLMEngine
    from shared.engine.params import EngineConfig
    from shared.model.loader import load_model
    from shared.protocol.sampling import SamplingParams

    cfg = tf.Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        initializer_range=0.2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    tf.Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval().save_pretrained(tmp_path)
    monkeypatch.setattr(llama, "NATIVE_LAYER", True)
    prompts = []
    for seed in (9, 7, 32):
        g = torch.Generator().manual_seed(seed)
        n = int(torch.randint(4, 40, (1,), generator=g))
        prompts.append(torch.randint(0, 256, (n,), generator=g).tolist())
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ecfg = EngineConfig(kv_cache_bytes=1 << 20, block_size=16, max_num_seqs=4)

    def generate(dtype: torch.dtype) -> tuple[list[list[int]], LLMEngine]:
        eng = LLMEngine(load_model(tmp_path, dtype=dtype), ecfg)
        return eng.generate(prompts, greedy), eng

    before = cpu_kernels.layer_calls
    got, eng = generate(None)  # the checkpoint's dtype
    assert eng.runner.kv.k.dtype == torch.bfloat16 and cpu_kernels.layer_calls > before
    try:
        monkeypatch.setenv("STRATA_CPU_KERNELS", "0")
        cpu_kernels.use(None)
        want, ref = generate(torch.float32)
        assert ref.runner.kv.k.dtype == torch.float32
    finally:
        monkeypatch.delenv("STRATA_CPU_KERNELS")
        cpu_kernels.use(None)
    assert got == want


def _fallbacks(op: str, reason: str) -> float:
    labels = {"op": op, "reason": reason}
    return REGISTRY.get_sample_value("strata_kernel_fallback_total", labels) or 0.0


def test_each_bf16_fallback_is_counted_with_its_reason(monkeypatch, tmp_path):
    """The bf16 linears on oneDNN (``STRATA_CPU_GEMM=onednn``, ``STRATA_CPU_PACKED_GEMM=0``,
    ``STRATA_CPU_KERNELS=0``, no compiler) count each call as a ``bf16_gemm`` fallback with its
    reason, and a bf16 model then runs its layers op at a time (``decoder_layer``
    ``unsupported``: no projection on a native GEMM)."""
    torch.manual_seed(0)
    x = torch.randn(3, 64).bfloat16()

    def counted(reason: str) -> float:
        lin = torch.nn.Linear(64, 8).bfloat16()  # a fresh Gemm: packed under the settings now
        before = _fallbacks("bf16_gemm", reason)
        torch.testing.assert_close(layers.project(lin, x), F.linear(x, lin.weight, lin.bias))
        return _fallbacks("bf16_gemm", reason) - before

    for flag in ("NATIVE_CPU_GEMM", "PACK_CPU_GEMM"):
        monkeypatch.setattr(layers, flag, False)
        assert counted("disabled") == 1
        drv = PagedDriver(native_tests._model().bfloat16(), block_size=16)
        before = _fallbacks("decoder_layer", "unsupported")
        drv.step([(drv.new_seq(), [1, 2])])
        assert _fallbacks("decoder_layer", "unsupported") - before == 1
        monkeypatch.setattr(layers, flag, True)
    assert counted("disabled") == counted("unavailable") == 0  # on the native kernel
    try:
        monkeypatch.setenv("STRATA_CPU_KERNELS", "0")
        cpu_kernels.use(None)
        assert counted("disabled") == 1
        monkeypatch.delenv("STRATA_CPU_KERNELS")
        monkeypatch.setenv("STRATA_CACHE", str(tmp_path))
        monkeypatch.setenv("CC", "false")
        cpu_kernels.use(None)
        assert counted("unavailable") == 1
    finally:
        monkeypatch.undo()
        cpu_kernels.use(None)
