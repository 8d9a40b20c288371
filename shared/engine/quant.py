"""int8 weight-only quantization of ``nn.Linear`` (per-output-channel symmetric scales)."""

from __future__ import annotations

import threading

import torch
from torch import nn

_scratch = threading.local()  # per-thread float copy of the int8 weight being used


def _float_weight(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q`` as ``dtype`` in a buffer reused by every layer of the same shape on this thread,
    so dequantising costs one int8 -> float copy and no memory per layer."""
    bufs = _scratch.__dict__.setdefault("bufs", {})
    key = (tuple(q.shape), dtype, q.device)
    buf = bufs.get(key)
    if buf is None:
        buf = bufs[key] = torch.empty(q.shape, dtype=dtype, device=q.device)
    return buf.copy_(q)


class Int8Linear(nn.Module):
    """``y = x @ (w_int8 * scale).T + b``; weights stored as int8, activations untouched."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_int8", q.contiguous())
        self.register_buffer("scale", scale.to(linear.weight.dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), False)
        # On CPU ``_weight_int8pack_mm`` measured 2-200x slower than converting the weight and
        # calling the float GEMM (docs/benchmarks/engine.md), so it is used on CUDA only.
        self._fast = q.device.type == "cuda" and _has_int8_kernel(q.device, linear.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self._fast:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.weight_int8, self.scale.to(x.dtype))
        else:  # int8 -> float copy (K*N), float GEMM (M*K*N), then the per-channel scale
            # (``w.to(x.dtype) * scale[:, None]`` measured 12.7 ms vs 0.08 ms for this copy)
            y = torch.nn.functional.linear(x2, _float_weight(self.weight_int8, x.dtype))
            y.mul_(self.scale.to(x.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


def _has_int8_kernel(device: torch.device, dtype: torch.dtype) -> bool:
    try:
        x = torch.zeros(1, 32, device=device, dtype=dtype)
        w = torch.zeros(8, 32, device=device, dtype=torch.int8)
        torch.ops.aten._weight_int8pack_mm(x, w, torch.ones(8, device=device, dtype=dtype))
        return True
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def quantize_model_(model: nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Replace every ``nn.Linear`` (except names containing ``skip``) in place; returns the count.

    The LM head stays in full precision by default: it decides the argmax and, when tied, shares
    its weight with the embedding. So does a MoE router (the ``gate`` beside ``experts``): a
    rounded router logit flips which experts a token reaches. Stacked expert weights are not
    ``nn.Linear`` and stay as they are.
    """
    n = 0
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if child_name == "gate" and hasattr(mod, "experts"):
                continue
            if isinstance(child, nn.Linear) and not any(s in full for s in skip):
                setattr(mod, child_name, Int8Linear(child))
                n += 1
    return n
