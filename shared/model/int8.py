"""int8 linears: weights stored as int8 with one symmetric scale per output channel.

On CPU with float32 activations the product runs on the native W8A8 kernel (``gemm_int8.c``,
`cpu_kernels.linear_int8`): each row of activations is quantised to int8 by its own scale at call
time, the sums are int32, the weight is packed once (:class:`Int8Gemm`, like `layers.Gemm` for
float32). W8A8 rounds the activations as well as the weights, so results differ from the
dequantised product by about the activation rounding (docs/ENGINE.md "Performance notes (CPU)").
Where the kernel does not apply (no compiler, ``STRATA_CPU_KERNELS=0`` or
``STRATA_CPU_PACKED_GEMM=0``, not float32), the weight is dequantised into a per-thread scratch
and the float GEMM runs, each such call counted in ``strata_kernel_fallback_total{op="int8_gemm"}``;
on CUDA ``_weight_int8pack_mm`` (int8 weights, activations as they are).

`shared.model.layers` fuses q/k/v and gate/up of int8 linears into one :class:`Int8Gemm` each
(:func:`fuse`) as it does for float ones; `shared.engine.quant.quantize_model_` makes them.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

from shared.config import RuntimeSettings
from shared.model import cpu_kernels

_scratch = threading.local()  # per-thread float copy of the int8 weight being used
PACK = RuntimeSettings.from_env().cpu_packed_gemm  # STRATA_CPU_PACKED_GEMM=0: no packed copy


def _float_weight(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q`` as ``dtype`` in a buffer reused by every layer of the same shape on this thread,
    so dequantising costs one int8 -> float copy and no memory per layer."""
    bufs = _scratch.__dict__.setdefault("bufs", {})
    key = (tuple(q.shape), dtype, q.device)
    buf = bufs.get(key)
    if buf is None:
        buf = bufs[key] = torch.empty(q.shape, dtype=dtype, device=q.device)
    return buf.copy_(q)


def _pack(
    w: torch.Tensor, scale: torch.Tensor, b: torch.Tensor | None
) -> tuple[cpu_kernels.PackedInt8 | None, str]:
    """``(w packed for the native int8 GEMM, "")``, or ``(None, why not)`` (a
    `cpu_kernels.fallback` reason; "" off the CPU, where there is no native kernel)."""
    if w.device.type != "cpu":
        return None, ""
    if not PACK:
        return None, "disabled"
    if scale.dtype != torch.float32 or (b is not None and b.dtype != torch.float32):
        return None, "dtype"  # a bf16 model's scales: its activations are bf16 too
    if w.shape[1] > cpu_kernels.INT8_MAX_K:
        return None, "shape"
    packed = cpu_kernels.pack_int8(w, scale)
    return packed, "" if packed is not None else cpu_kernels.off_reason() or "layout"


class Int8Gemm:
    """``x @ (w * scale[:, None]).T + b`` for an int8 ``w [N, K]``: on CPU float32 through the
    native W8A8 kernel on a copy of ``w`` packed once, else dequantised.

    ``current`` tells whether it still describes ``w``, ``scale`` and ``b`` (as `layers.Gemm`:
    a new tensor or an in-place write makes the owner build a fresh one)."""

    def __init__(self, w: torch.Tensor, scale: torch.Tensor, b: torch.Tensor | None):
        self.w, self.scale, self.b = w, scale, b
        self.native, self.why = _pack(w, scale, b)
        self.key = self._key(w, b)
        self.rows: list[tuple[int, int]] = []  # `fuse`: where each module's slices start

    def _key(self, w: torch.Tensor, b: torch.Tensor | None) -> tuple:
        v = None if b is None else (b.data_ptr(), b._version)
        s = self.scale
        return (w.data_ptr(), w._version, s.data_ptr(), s._version, v, cpu_kernels.generation())

    def current(self, w: torch.Tensor, b: torch.Tensor | None) -> bool:
        return self.key == self._key(w, b)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and x.dtype == torch.float32 and x.device.type == "cpu":
            return cpu_kernels.linear_int8(x, self.native, self.b)
        if x.device.type == "cpu":
            cpu_kernels.fallback("int8_gemm", self.why or "dtype")  # `why` "": x not float32
        # int8 -> float copy (K*N), float GEMM (M*K*N), then the per-channel scale
        # (``w.to(x.dtype) * scale[:, None]`` measured 12.7 ms vs 0.08 ms for this copy)
        y = F.linear(x, _float_weight(self.w, x.dtype))
        y.mul_(self.scale.to(x.dtype))
        return y if self.b is None else y + self.b


class Int8Linear(nn.Module):
    """``y = x @ (w_int8 * scale).T + b``; weights stored as int8 (per-output-channel
    symmetric scales), activations quantised per row on CPU float32 (:class:`Int8Gemm`)."""

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
        if not self._fast:
            return gemm_of(self)(x)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        y = torch.ops.aten._weight_int8pack_mm(x2, self.weight_int8, self.scale.to(x.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


def gemm_of(m: Int8Linear) -> Int8Gemm:
    """The :class:`Int8Gemm` cached on ``m``, made again when its weight, scale or bias
    changed."""
    g = m.__dict__.get("_gemm")
    if g is None or g.scale is not m.scale or not g.current(m.weight_int8, m.bias):
        g = m.__dict__["_gemm"] = Int8Gemm(m.weight_int8, m.scale, m.bias)
    return g


def row_key(m: Int8Linear) -> tuple[int, int]:
    """Where ``m``'s weight and scale start (`fuse` records it to tell its slices still hold)."""
    return (m.weight_int8.data_ptr(), m.scale.data_ptr())


def fuse(linears: list[Int8Linear]) -> Int8Gemm | None:
    """One :class:`Int8Gemm` over the stacked weights of ``linears`` (one input, e.g. q/k/v),
    each module's weight, scale and bias made a row slice of the stacked ones (no extra
    memory). The scales are per output and the activations' per row, so each module's outputs
    are bit for bit those of its own call. ``None`` off the CPU (CUDA keeps one
    ``_weight_int8pack_mm`` per module) or when the modules do not stack."""
    first = linears[0]
    if first.weight_int8.device.type != "cpu":
        return None
    kinds = {(m.in_features, m.scale.dtype, m.bias is None) for m in linears}
    if len(kinds) != 1:
        return None
    with torch.inference_mode(False), torch.no_grad():
        w = torch.cat([m.weight_int8 for m in linears])
        s = torch.cat([m.scale for m in linears])
        b = None if first.bias is None else torch.cat([m.bias for m in linears])
        row = 0
        for m in linears:
            n = m.out_features
            m.weight_int8, m.scale = w[row : row + n], s[row : row + n]
            if b is not None:
                m.bias = nn.Parameter(b[row : row + n], requires_grad=False)
            m.__dict__.pop("_gemm", None)  # a packed copy of the old tensors, if it ran alone
            row += n
    g = Int8Gemm(w, s, b)
    g.rows = [row_key(m) for m in linears]
    return g


def _has_int8_kernel(device: torch.device, dtype: torch.dtype) -> bool:
    try:
        x = torch.zeros(1, 32, device=device, dtype=dtype)
        w = torch.zeros(8, 32, device=device, dtype=torch.int8)
        torch.ops.aten._weight_int8pack_mm(x, w, torch.ones(8, device=device, dtype=dtype))
        return True
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
