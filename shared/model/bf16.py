"""bfloat16 weights on CPU: the native GEMM with bf16 weights and float32 activations and outputs
(``gemm_bf16.c``), which a bf16 model's projections run through (`shared.model.layers.Gemm`).

The weight is packed once (:func:`pack_bf16`: panels of pairs of k, half float32's bytes).
Decode-sized products widen the weight to float32 in registers (a shift) and use float32 FMAs:
bit-identical to the float32 kernel on the widened weight, on every ISA variant but one: from
`DOT_ROWS` rows up (measured: every call), the ``avx512bf16`` variant rounds each row of
activations to bf16 once per call and uses ``vdpbf16ps`` (two products per float32 lane, twice
the FMA's rate), within bf16 rounding of the activations of the widened product.

A bf16 model's one-call layer (``layer.c``) runs its projections on the same kernel with its
hidden state, norms and attention in float32 and its KV cache in bf16 (docs/ENGINE.md). Op by
op, a bf16 row is widened on the way in and the output rounded back to bf16 (what oneDNN's bf16
GEMM gives: float32 sums, a bf16 result). Where the kernel does not apply (no compiler,
``STRATA_CPU_KERNELS=0``, ``STRATA_CPU_GEMM=onednn``, ``STRATA_CPU_PACKED_GEMM=0``, float16
rows) the projection runs on oneDNN or ``F.linear`` as before, each call counted in
``strata_kernel_fallback_total{op="bf16_gemm"}``.
"""

from __future__ import annotations

import torch

from shared.model import cpu_kernels

# Rows from which the avx512bf16 variant takes the vdpbf16ps path: all. Measured on the 2-core
# AVX-512 BF16 EPYC (loadtests/bench_bf16.py, a pass over the benchmark model's projections,
# weights from memory; first timings, under load from other sessions): the dot path 1.14x the
# widen one at 1 row, 1.2x at 2, 1.4x at 4, 1.56x from 8 (the widen path's unpacking costs ALU
# work even where the weight's bytes bound it), and the decode step (16 rows) 1.2x float32's
# against 1.05x widened. One path for every batch size also keeps a row's result independent of
# its batch. The price is the activations' bf16 rounding (docs/ENGINE.md); 0 keeps the widen
# path, which the variants without AVX-512 BF16 always run.
DOT_ROWS = 1

ACTIVATIONS = (torch.float32, torch.bfloat16)  # the rows the kernel takes (bf16: widened)


class PackedBF16:
    """A ``[N, K]`` bf16 weight packed for ``gemm_bf16.c`` (panels of the kernel's width, pairs of
    k in one 32-bit word, zero past ``N`` and ``K``); ``data`` keeps it alive; ``gen`` the
    `cpu_kernels.generation` it was packed for; ``dot_rows`` the rows from which a call takes
    the dot path (0: never)."""

    __slots__ = ("data", "n", "k", "gen", "dot_rows")

    def __init__(self, data: torch.Tensor, n: int, k: int, dot_rows: int):
        self.data, self.n, self.k, self.dot_rows = data, n, k, dot_rows
        self.gen = cpu_kernels.generation()


def pack_bf16(w: torch.Tensor, dot_rows: int | None = None) -> PackedBF16 | None:
    """``w`` (bf16 ``[N, K]`` on the CPU) packed for :func:`linear_bf16`, or ``None`` when the
    kernel does not apply (another dtype, device or shape, or no compiler /
    ``STRATA_CPU_KERNELS=0``). ``dot_rows``: `DOT_ROWS` when not given."""
    if w.device.type != "cpu" or w.dtype != torch.bfloat16 or w.dim() != 2:
        return None
    if not cpu_kernels.available():
        return None
    n, k = w.shape
    data = torch.ops.strata.pack_bf16(w.detach().contiguous())
    return PackedBF16(data, n, k, DOT_ROWS if dot_rows is None else dot_rows)


def linear_bf16(x: torch.Tensor, w: PackedBF16, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ w.T + bias`` for CPU ``x`` of shape ``[..., K]``: float32 in, float32 out; bf16 in
    (widened, exactly), bf16 out (the float32 result rounded). ``bias`` float32 or bf16."""
    if w.gen != cpu_kernels.generation():
        raise RuntimeError("weight packed for other kernels than the loaded ones")
    lead = x.shape[:-1]
    half = x.dtype == torch.bfloat16
    x2 = x.reshape(-1, w.k)
    x2 = x2.float() if half else x2.contiguous()
    if bias is not None:
        bias = bias.float().contiguous()
    out = torch.ops.strata.linear_bf16(x2, w.data, w.n, bias, w.dot_rows)  # OOM: no rows
    cpu_kernels.calls[cpu_kernels.loaded_isa(), "bf16_gemm"] += 1
    out = out.view(*lead, w.n)
    return out.to(torch.bfloat16) if half else out


def pack(w: torch.Tensor, b: torch.Tensor | None) -> tuple[PackedBF16 | None, str]:
    """For `layers.Gemm`: ``(w packed, "")``, or ``(None, why not)`` (a `cpu_kernels.fallback`
    reason) for a bf16 ``w`` on the CPU."""
    if b is not None and (b.device != w.device or b.dtype not in ACTIVATIONS):
        return None, "dtype" if b.device == w.device else "layout"
    packed = pack_bf16(w)
    return packed, "" if packed is not None else cpu_kernels.off_reason() or "shape"
