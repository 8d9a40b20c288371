"""The one-call decoder layer (`layer.c`, `cpu_kernels.decoder_layer`): the same hidden states
as the op-at-a-time path for every batch shape the engine builds, with the call counted so a
silent fallback fails the test, and a fallback exactly where the kernel does not apply.

(`test_text_models.py` and the acceptance tests compare greedy tokens with transformers through
the default path, which is this one.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shared.model import cpu_kernels
from shared.model.config import ModelConfig
from shared.model.models import llama
from tests.model.paged_driver import PagedDriver

pytestmark = pytest.mark.usefixtures("kernel_isa")  # every test once per ISA variant

VOCAB = 96


def _model(
    head_dim: int = 32, qk_norm: bool = True, bias: bool = False, act: str = "silu", seed: int = 0
):
    cfg = ModelConfig(
        architecture="Qwen3ForCausalLM",
        model_type="qwen3",
        text_model_type="qwen3",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=90,  # not a multiple of the 8-wide SiLU loop: the tail runs too
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        attention_bias=bias,
        o_proj_bias=bias,
        mlp_bias=bias,
        qk_norm=qk_norm,
        hidden_act=act,
        dtype_name="float32",
        bos_token_id=None,
        eos_token_ids=(),
    )
    torch.manual_seed(seed)
    m = llama.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
        for name, p in m.named_parameters():
            if "norm" in name:
                p.add_(1.0)
    return m


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def _run(model, native: bool, monkeypatch) -> tuple[list[torch.Tensor], int]:
    """Hidden states of a fixed schedule (a fresh prompt, a uniform fresh batch, a chunk over a
    cached prefix with decodes beside it, a pure decode batch of mixed lengths) and the number
    of one-call layers it ran."""
    monkeypatch.setattr(llama, "NATIVE_LAYER", native)
    before = cpu_kernels.layer_calls
    drv = PagedDriver(model, block_size=16)
    a, b, c, d = (drv.new_seq() for _ in range(4))
    out = [
        drv.step([(a, _tokens(37, 1))])[0],
        drv.step([(b, _tokens(20, 2)), (c, _tokens(20, 3))])[0],
        drv.step([(d, _tokens(70, 4)[:40]), (a, [5]), (b, [6])])[0],
        drv.step([(d, _tokens(70, 4)[40:]), (c, [7])])[0],
        drv.step([(a, [8]), (b, [9]), (c, [10]), (d, [11])])[0],
    ]
    return out, cpu_kernels.layer_calls - before


@pytest.mark.parametrize(
    "kw", [dict(), dict(qk_norm=False, bias=True), dict(head_dim=64, qk_norm=False)]
)
def test_one_call_layers_match_the_op_at_a_time_path(kw, monkeypatch):
    model = _model(**kw)
    got, calls = _run(model, True, monkeypatch)
    assert calls == 5 * model.num_layers  # every forward, every layer: no silent fallback
    want, none = _run(model, False, monkeypatch)
    assert none == 0
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert (g - w).abs().max().item() < 1e-4 * max(1.0, w.abs().max().item())


def test_a_head_size_the_prefill_kernel_refuses_falls_back_only_for_prompts(monkeypatch):
    """Head size 8 is less than a GEMM panel: prompts run op at a time, decodes in one call."""
    model = _model(head_dim=8)
    got, calls = _run(model, True, monkeypatch)
    assert calls == 1 * model.num_layers  # only the last step is decode-only
    want, _ = _run(model, False, monkeypatch)
    assert (got[-1] - want[-1]).abs().max().item() < 1e-4


def test_gelu_gating_runs_op_at_a_time(monkeypatch):
    model = _model(act="gelu")
    assert all(layer.native() is None for layer in model.model.layers)
    got, calls = _run(model, True, monkeypatch)
    assert calls == 0
    want, _ = _run(model, False, monkeypatch)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_a_changed_weight_is_used_by_the_next_forward(monkeypatch):
    model = _model()
    first, _ = _run(model, True, monkeypatch)
    layer = model.model.layers[1]
    built = layer.native()
    with torch.no_grad():
        layer.post_attention_layernorm.weight.mul_(1.5)  # in place
    layer.mlp.down_proj.weight = nn.Parameter(torch.randn(64, 90) * 0.3, requires_grad=False)
    assert layer.native() is not built
    got, calls = _run(model, True, monkeypatch)
    assert calls == 5 * model.num_layers
    want, _ = _run(model, False, monkeypatch)
    assert not torch.allclose(got[-1], first[-1])
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max().item() < 1e-4 * max(1.0, w.abs().max().item())


def test_inputs_embeds_are_not_written(monkeypatch):
    """The layers update their hidden states in place: never the caller's embeddings."""
    model = _model()
    monkeypatch.setattr(llama, "NATIVE_LAYER", True)
    drv = PagedDriver(model, block_size=16)
    ids = _tokens(12, 9)
    embeds = model.embed_tokens(torch.tensor(ids)).clone()
    keep = embeds.clone()
    before = cpu_kernels.layer_calls
    hidden, _ = drv.step([(drv.new_seq(), ids)], inputs_embeds=embeds)
    assert cpu_kernels.layer_calls - before == model.num_layers
    assert torch.equal(embeds, keep)
    solo = PagedDriver(model, block_size=16)
    ref, _ = solo.step([(solo.new_seq(), ids)])
    assert (hidden - ref).abs().max().item() < 1e-5


def test_silu_matches_torch_over_the_float_range():
    """layer.c's SiLU (exp2_poly.h's e^x) against torch's, from -960 to 960: where e^-x
    overflows float32 and where it underflows."""
    model = _model(head_dim=64, qk_norm=False)
    mlp = model.model.layers[0].mlp
    with torch.no_grad():
        mlp.gate_proj.weight.zero_()
        mlp.up_proj.weight.zero_()
        mlp.gate_proj.weight[:, 0] = torch.linspace(-120, 120, 90)  # gate = x[0] * w
        mlp.up_proj.weight[:, 0] = 1.0
        mlp.down_proj.weight.copy_(torch.eye(64, 90))
    x = torch.zeros(3, 64)
    x[:, 0] = torch.tensor([1.0, 0.37, -0.9])
    # the native layer's MLP: h + down(silu(gate) * up) with the attention half zeroed
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        attn.o_proj.weight.zero_()
        ln = model.model.layers[0].post_attention_layernorm
        ln.weight.fill_(1.0)
    layer = model.model.layers[0].native()
    assert layer is not None
    # rmsnorm(x) feeds the MLP: compare against torch on the same normed rows
    normed = ln(x)
    g = normed[:, :1] * torch.linspace(-120, 120, 90)
    want = x + (torch.nn.functional.silu(g) * normed[:, :1])[:, :64]
    h = x.clone()
    kv = torch.zeros(4, 16, 2, 64)
    batch = cpu_kernels.layer_batch(
        [layer],
        torch.ones(3, 64),
        torch.zeros(3, 64),
        torch.tensor([0, 1, 2]),
        (torch.tensor([[0]]), torch.tensor([3]), torch.tensor([0]), torch.tensor([3])),
        None,
    )
    cpu_kernels.decoder_layer(layer, batch, h, kv, kv.clone())
    rel = ((h - want).abs() / want.abs().clamp_min(1e-3)).max().item()
    assert rel < 1e-5, rel
