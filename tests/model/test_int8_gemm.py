"""The native W8A8 GEMM (`gemm_int8.c`, `cpu_kernels.linear_int8`) and the int8 linears on it
(`shared.model.int8`): bit for bit the torch reference of the same arithmetic on every ISA
variant this CPU runs, counted per variant; fused q/k/v equal to separate calls; the one-call
layer over int8 projections; a quantised model's logits against float32 and its greedy tokens
against the dequantised (W8A16) path; each fallback counted with its reason."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from prometheus_client import REGISTRY

from shared.engine.quant import quantize_model_
from shared.model import cpu_kernels, int8
from shared.model.config import ModelConfig
from shared.model.int8 import Int8Linear
from shared.model.models import llama
from tests.model.paged_driver import PagedDriver


def w8a8_reference(
    x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The kernel's arithmetic in torch: each row of ``x`` by its own symmetric int8 scale
    (max|x| / 127, round half to even, a zero row to 0), the products summed exactly (int64),
    then ``acc * (sx * sw)`` and ``+ bias``, each rounded in float32."""
    amax = x.abs().amax(-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))  # IEEE division
    q = torch.round(x * inv[:, None]).clamp(-127, 127).to(torch.int64)
    acc = q @ w8.to(torch.int64).T
    y = acc.to(torch.float32) * ((amax / torch.tensor(127.0))[:, None] * scale[None, :])
    return y if bias is None else y + bias


def _quantised(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=g)
    scale = w.abs().amax(1) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


# K: below a group of 4, an odd multiple of 4, not a multiple of 4, past one 64-wide panel's
# worth; N: a single output, not a multiple of any panel width (16, 32, 64), several panels
SHAPES = [(3, 1), (12, 5), (68, 40), (70, 97), (516, 130), (1408, 70)]


@pytest.mark.parametrize("m", [1, 3, 16, 33, 64])
def test_the_kernel_is_the_w8a8_product_bit_for_bit(kernel_isa, m):
    g = torch.Generator().manual_seed(m)
    before = cpu_kernels.calls[kernel_isa, "int8_gemm"]
    for i, (k, n) in enumerate(SHAPES):
        w8, scale = _quantised(n, k, g)
        x = torch.randn(m, k, generator=g) * (1 + 10 * torch.rand(m, 1, generator=g))
        if m > 2:
            x[1] = 0.0  # a zero row quantises to 0, not NaN
        bias = torch.randn(n, generator=g) if i % 2 else None
        got = cpu_kernels.linear_int8(x, cpu_kernels.pack_int8(w8, scale), bias)
        want = w8a8_reference(x, w8, scale, bias)
        assert torch.equal(got, want), (k, n, (got - want).abs().max().item())
    assert cpu_kernels.calls[kernel_isa, "int8_gemm"] - before == len(SHAPES)


def test_a_row_gets_the_same_result_alone_or_in_a_batch(kernel_isa):
    """Per-row activation scales: a decode row's output does not depend on its neighbours."""
    g = torch.Generator().manual_seed(1)
    w8, scale = _quantised(200, 300, g)
    packed = cpu_kernels.pack_int8(w8, scale)
    x = torch.randn(40, 300, generator=g)
    x[7] *= 100.0  # an outlier row: it must not coarsen the others' rounding
    batch = cpu_kernels.linear_int8(x, packed, None)
    for i in (0, 7, 39):
        assert torch.equal(cpu_kernels.linear_int8(x[i : i + 1], packed, None)[0], batch[i])


def test_fused_int8_projections_equal_separate_calls(kernel_isa):
    """q/k/v fused into one `Int8Gemm` (stacked rows and scales) give each module's own
    outputs bit for bit, and the modules' weights become slices of the stacked one."""
    torch.manual_seed(0)
    linears = [torch.nn.Linear(48, n, bias=True) for n in (64, 32, 32)]
    mods = [Int8Linear(m) for m in linears]
    x = torch.randn(5, 48)
    alone = [m(x) for m in mods]
    fused = int8.fuse(mods)
    assert fused is not None and fused.native is not None
    out = fused(x)
    assert torch.equal(torch.cat(alone, dim=-1), out)
    assert mods[1].weight_int8.data_ptr() == fused.w[64:].data_ptr()
    assert torch.equal(torch.cat([m(x) for m in mods], dim=-1), out)  # the slices run alone too


def _model(arch: str = "qwen3", seed: int = 0, vocab: int = 128) -> llama.LlamaForCausalLM:
    """A small random model with weights of about a trained one's scale (std 1.5 / sqrt(fan
    in), so activations neither vanish nor blow up over the layers)."""
    cfg = ModelConfig(
        architecture="Qwen3ForCausalLM" if arch == "qwen3" else "LlamaForCausalLM",
        model_type=arch,
        text_model_type=arch,
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=344,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        attention_bias=arch == "qwen3",  # Qwen2-style q/k/v bias through the fused int8 GEMM
        o_proj_bias=False,
        mlp_bias=False,
        qk_norm=arch == "qwen3",
        hidden_act="silu",
        dtype_name="float32",
        bos_token_id=None,
        eos_token_ids=(),
    )
    torch.manual_seed(seed)
    m = llama.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif p.dim() == 2 and "embed" not in name:
                p.normal_(0, 1.5 / math.sqrt(p.shape[1]))
            else:
                p.normal_(0, 1.0)
    return m


def _generate(model, prompt: list[int], n: int, forced: list[int] | None = None):
    """Greedy tokens (or ``forced`` ones fed back) and the logits of each step."""
    drv = PagedDriver(model, block_size=16)
    seq = drv.new_seq()
    _, logits = drv.step([(seq, list(prompt))])
    toks, out = [], []
    for i in range(n):
        out.append(logits[0])
        toks.append(int(logits[0].argmax()) if forced is None else forced[i])
        _, logits = drv.step([(seq, [toks[-1]])])
    return toks, torch.stack(out)


def _err(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(largest |a - b| over each step's logit range, mean |a - b| over each step's std)."""
    rng = b.amax(-1) - b.amin(-1)
    return (
        ((a - b).abs().amax(-1) / rng).max().item(),
        ((a - b).abs().mean(-1) / b.std(-1)).mean().item(),
    )


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_a_quantised_model_stays_close_to_float32(kernel_isa, arch, monkeypatch):
    """Logits of the W8A8 model against float32's, teacher-forced on float32's greedy tokens,
    and greedy generation against the dequantised (W8A16) path's.

    Tolerance: on these two models W8A8 is off float32 by at most 2.0% (Qwen3) / 4.4% (Llama)
    of a step's logit range, 2.3% / 4.3% of its std on average: 1.5-1.6x W8A16's mean error
    (the activations' rounding on top of the weights'); over seeds 0-2, up to 2.4% / 4.8% of
    the range and 1.5-1.7x W8A16's mean error. The test allows 8% of the range, 7% of the std, 2.5x W8A16's mean error. Both
    generations part at a near-tie (top two 0.2% of the range apart) after 7 / 13 tokens."""
    monkeypatch.setattr(llama, "NATIVE_LAYER", True)
    prompt = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    fp = _model(arch)
    want, fp_logits = _generate(fp, prompt, 16)
    q = _model(arch)
    assert quantize_model_(q) == 3 * 7
    layers, gemms = cpu_kernels.layer_calls, cpu_kernels.calls[kernel_isa, "int8_gemm"]
    _, q_logits = _generate(q, prompt, 16, forced=want)
    assert cpu_kernels.layer_calls - layers == 17 * 3  # every step, every layer in one call
    assert cpu_kernels.calls[kernel_isa, "int8_gemm"] == gemms  # (layer.c calls it inside)
    monkeypatch.setattr(int8, "PACK", False)  # the dequantising path: W8A16
    deq = _model(arch)
    quantize_model_(deq)
    deq_tokens, deq_free = _generate(deq, prompt, 16)
    _, deq_logits = _generate(deq, prompt, 16, forced=want)
    monkeypatch.setattr(int8, "PACK", True)
    worst, mean = _err(q_logits, fp_logits)
    assert worst < 0.08 and mean < 0.07, (worst, mean)
    assert mean < 2.5 * _err(deq_logits, fp_logits)[1]
    top5 = [
        len(set(a.topk(5).indices.tolist()) & set(b.topk(5).indices.tolist()))
        for a, b in zip(q_logits, fp_logits, strict=True)
    ]
    assert min(top5) >= 3 and sum(top5) >= 4 * len(top5), top5
    # free-running greedy: W8A16's tokens up to the first near-tie at most (top two within 2%
    # of the step's logit range, while logits may differ by up to 8% of it), where W8A8 takes
    # W8A16's second choice
    q_tokens, _ = _generate(q, prompt, 16)
    pairs = enumerate(zip(q_tokens, deq_tokens, strict=True))
    j = next((i for i, (a, b) in pairs if a != b), None)
    if j is not None:
        top2 = deq_free[j].topk(2)
        margin = (top2.values[0] - top2.values[1]) / (deq_free[j].max() - deq_free[j].min())
        assert margin < 0.02 and q_tokens[j] == top2.indices[1], (j, margin)


def test_int8_layers_in_one_call_match_op_at_a_time(kernel_isa, monkeypatch):
    """layer.c over int8 projections: the op-at-a-time int8 path's hidden states (to SiLU's
    rounding, as for float32: ~1e-7 here; an ulp of SiLU could flip one activation's int8
    rounding, ~1e-3 on the outputs, which no row does on this model), with the calls counted."""
    model = _model("qwen3")
    quantize_model_(model)
    prompt = list(range(3, 40))
    out = {}
    for native in (True, False):
        monkeypatch.setattr(llama, "NATIVE_LAYER", native)
        layers, gemms = cpu_kernels.layer_calls, cpu_kernels.calls[kernel_isa, "int8_gemm"]
        drv = PagedDriver(model, block_size=16)
        a, b = drv.new_seq(), drv.new_seq()
        out[native] = [
            drv.step([(a, prompt)])[0],
            drv.step([(b, prompt[:9]), (a, [5])])[0],
            drv.step([(a, [6]), (b, [7])])[0],
        ]
        assert cpu_kernels.layer_calls - layers == (3 * 3 if native else 0)
        # op at a time: qkv, o, gate_up, down per layer per step
        assert cpu_kernels.calls[kernel_isa, "int8_gemm"] - gemms == (0 if native else 3 * 3 * 4)
    for g, w in zip(out[True], out[False], strict=True):
        assert (g - w).abs().max().item() < 1e-4 * max(1.0, w.abs().max().item())


def _fallbacks(reason: str) -> float:
    labels = {"op": "int8_gemm", "reason": reason}
    return REGISTRY.get_sample_value("strata_kernel_fallback_total", labels) or 0.0


def test_each_int8_fallback_is_counted_with_its_reason(monkeypatch):
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 16)
    x = torch.randn(2, 32)
    native = Int8Linear(lin)
    want = native(x)
    monkeypatch.setattr(int8, "PACK", False)  # STRATA_CPU_PACKED_GEMM=0
    before = _fallbacks("disabled")
    deq = Int8Linear(lin)(x)
    assert _fallbacks("disabled") - before == 1
    # W8A16 against W8A8: the activations' rounding apart
    assert (deq - want).abs().max().item() < 0.02 * want.abs().max().item()
    monkeypatch.setattr(int8, "PACK", True)
    before = _fallbacks("dtype")
    Int8Linear(copy.deepcopy(lin).bfloat16())(x.bfloat16())  # a bf16 model's scales and rows
    native(x.double())  # float32 packed, other activations
    assert _fallbacks("dtype") - before == 2
    try:
        monkeypatch.setenv("STRATA_CPU_KERNELS", "0")
        cpu_kernels.use(None)
        before = _fallbacks("disabled")
        torch.testing.assert_close(Int8Linear(lin)(x), deq)
        assert _fallbacks("disabled") - before == 1
    finally:
        monkeypatch.undo()
        cpu_kernels.use(None)
