"""The fused gate/up (and q/k/v) GEMM follows its modules' weights: a replaced weight or an
in-place write is seen by the next forward, which fuses afresh."""

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.layers import MLP


def _reference(m: MLP, x: torch.Tensor) -> torch.Tensor:
    g = F.linear(x, m.gate_proj.weight)
    u = F.linear(x, m.up_proj.weight)
    return F.linear(F.silu(g) * u, m.down_proj.weight)


def _mlp() -> tuple[MLP, torch.Tensor]:
    torch.manual_seed(0)
    m = MLP(32, 48, "silu")
    return m, torch.randn(5, 32)


def test_fused_forward_matches_the_modules():
    m, x = _mlp()
    with torch.inference_mode():
        torch.testing.assert_close(m(x), _reference(m, x), rtol=1e-5, atol=1e-5)
    assert m._gate_up is not None and m._gate_up.rows  # fused on first use


def test_a_replaced_weight_is_used_by_the_next_forward():
    m, x = _mlp()
    with torch.inference_mode():
        before = m(x)
    fused = m._gate_up
    m.gate_proj.weight = nn.Parameter(torch.randn(48, 32), requires_grad=False)
    with torch.inference_mode():
        after = m(x)
    assert m._gate_up is not fused  # fused afresh over the new weight
    assert not torch.allclose(after, before)
    with torch.inference_mode():
        torch.testing.assert_close(after, _reference(m, x), rtol=1e-5, atol=1e-5)


def test_an_in_place_write_is_used_by_the_next_forward():
    m, x = _mlp()
    with torch.inference_mode():
        m(x)
    fused = m._gate_up
    with torch.no_grad():
        m.up_proj.weight.mul_(2.0)
    with torch.inference_mode():
        out = m(x)
        assert m._gate_up is not fused
        torch.testing.assert_close(out, _reference(m, x), rtol=1e-5, atol=1e-5)
