"""Decoder building blocks: RMSNorm, rotary embedding (incl. llama3 scaling), attention, MLP.

Numerics follow transformers' Llama/Qwen code so logits match it: RMSNorm in float32, cos/sin
computed in float32 then cast to the activation dtype, ``rotate_half`` RoPE layout. Every
projection is a plain ``nn.Linear`` so it can be swapped for a quantised linear; the forward
runs it through :class:`Gemm`, which on CPU packs the weight once: for the native float32 GEMM
(``gemm.c``), the native bf16-weight one (``gemm_bf16.c``, `shared.model.bf16`), or for oneDNN
(where the native kernels are off). An int8 projection (`shared.model.int8.Int8Linear`) runs
through its own `Int8Gemm` (native W8A8 on CPU float32), and q/k/v and gate/up are fused for it
as for float ones.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shared.config import RuntimeSettings
from shared.model import bf16, cpu_kernels, int8
from shared.model.attention import AttentionPlan, paged_attention
from shared.model.bf16 import PackedBF16
from shared.model.int8 import Int8Gemm, Int8Linear
from shared.model.softcap import softcap_attention

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
    "relu2": lambda x: torch.square(F.relu(x)),  # Arcee, Nemotron
}


def activation(name: str):
    """Look up an activation function by its transformers name."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}")
    return ACTIVATIONS[name]


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, computed in float32 like transformers."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        native = cpu_kernels.rms_norm(x, self.weight, self.eps)  # one call on CPU float32
        if native is not None:
            return native[1]
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor):
        """``(x + residual, self(x + residual))``, the add fused into the norm where it can."""
        native = cpu_kernels.rms_norm(x, self.weight, self.eps, residual)
        if native is not None:
            return native
        h = x + residual
        return h, self(h)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies for RoPE: default, ``linear`` or ``llama3`` scaled."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling["rope_type"]
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind != "llama3":
        raise ValueError(f"unsupported rope_type {kind!r}")
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Rotary:
    """Computes ``(cos, sin)`` of shape ``[T, head_dim]`` for a positions vector."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, device):
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x: [T, heads, D]`` with ``cos/sin: [T, D]`` (rotate_half layout).

    Same roundings as transformers' ``x * cos + rotate_half(x) * sin`` (``a + (-b) == a - b``
    exactly, and both halves of ``cos``/``sin`` are equal), without the ``cat`` and ``neg``.
    """
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    lo, hi = out[..., :half], out[..., half:]
    torch.mul(x1, c, out=lo).sub_(x2 * s)
    torch.mul(x2, c, out=hi).add_(x1 * s)
    return out


# oneDNN's fp32/bf16 GEMM on a weight reordered once into its blocked layout measured 1.2-2.7x
# faster than ``F.linear`` (MKL) for 1-64 rows and 1.1-1.35x for 1024 rows on the benchmark
# model's shapes (docs/benchmarks/model.md); for float32 the native kernel (gemm.c) beats it
# again at decode sizes (docs/benchmarks/engine.md). Either packed copy sits beside the dense
# weight (which the loader, quantiser and KV tooling keep using): linear weights cost 2x host
# memory. ``STRATA_CPU_PACKED_GEMM=0`` turns packing off (plain ``F.linear``);
# ``STRATA_CPU_GEMM`` picks native (auto) or oneDNN for float32 and bf16 weights.
PACK_CPU_GEMM = RuntimeSettings.from_env().cpu_packed_gemm
NATIVE_CPU_GEMM = cpu_kernels.native_gemm_chosen()  # STRATA_CPU_GEMM
_PACK_ROWS_HINT = 16  # oneDNN picks its blocking for this many rows; 1-1024 all ran well


def _pack(w: torch.Tensor) -> torch.Tensor | None:
    if not PACK_CPU_GEMM or w.device.type != "cpu":
        return None
    if w.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w.detach(), _PACK_ROWS_HINT)
    except (RuntimeError, AttributeError, NotImplementedError):
        return None


def _pack_native(
    w: torch.Tensor, b: torch.Tensor | None
) -> tuple[cpu_kernels.PackedLinear | PackedBF16 | None, str]:
    """``(w packed for the native float32 or bf16 GEMM, "")``, or ``(None, why not)`` (a
    `cpu_kernels.fallback` reason; "" off the CPU, where there is no native kernel)."""
    if w.device.type != "cpu":
        return None, ""
    if not (PACK_CPU_GEMM and NATIVE_CPU_GEMM):
        return None, "disabled"
    if w.dtype == torch.bfloat16:
        return bf16.pack(w, b)
    if w.dtype != torch.float32 or (b is not None and b.dtype != w.dtype):
        return None, "dtype"
    if b is not None and b.device != w.device:
        return None, "layout"
    packed = cpu_kernels.pack_linear(w)
    return packed, "" if packed is not None else cpu_kernels.off_reason() or "shape"


class Gemm:
    """``x @ w.T + b`` with ``w`` packed once on CPU: for the native float32 or bf16 kernel, else
    for oneDNN (plain ``F.linear`` elsewhere). Its fallbacks count as ``gemm``, or ``bf16_gemm``
    for a bf16 weight.

    ``current`` tells whether it still describes ``w``: a new tensor or an in-place write
    (``_version``) makes the owner build a fresh one."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None):
        self.w, self.b = w, b
        self.native, self.why = _pack_native(w, b)
        self.packed = None if self.native is not None else _pack(w)
        self.op = "bf16_gemm" if w.dtype == torch.bfloat16 else "gemm"
        self.key = self._key(w, b)
        self.rows: list[int] = []  # `_fuse`: data_ptr of each fused module's weight slice

    @staticmethod
    def _key(w: torch.Tensor, b: torch.Tensor | None) -> tuple:
        # the kernels' generation: another ISA variant loaded packs another panel width
        v = None if b is None else b._version
        return (w.data_ptr(), w._version, v, cpu_kernels.generation())

    def current(self, w: torch.Tensor, b: torch.Tensor | None) -> bool:
        return self.key == self._key(w, b)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        native, cpu = self.native, x.device.type == "cpu"
        if cpu and type(native) is PackedBF16 and x.dtype in bf16.ACTIVATIONS:
            return bf16.linear_bf16(x, native, self.b)
        if cpu and type(native) is cpu_kernels.PackedLinear and x.dtype == torch.float32:
            return cpu_kernels.linear(x, native, self.b)
        if cpu:
            cpu_kernels.fallback(self.op, self.why or "dtype")  # `why` "": x of another dtype
        if self.packed is None or x.dtype != self.w.dtype:
            return F.linear(x, self.w, self.b)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.b, "none", [], "")


def _gemm_of(m: nn.Linear) -> Gemm:
    """The :class:`Gemm` cached on a plain ``nn.Linear``, made again when its weight changed."""
    g = m.__dict__.get("_gemm")
    if g is None or not g.current(m.weight, m.bias):
        g = m.__dict__["_gemm"] = Gemm(m.weight, m.bias)
    return g


Packed = tuple[cpu_kernels.PackedLinear | cpu_kernels.PackedInt8 | PackedBF16, torch.Tensor | None]


def _native(g: Gemm | Int8Gemm | None) -> Packed | None:
    """``(packed weight, bias)`` when ``g`` runs on the native float32, bf16 or int8 GEMM, else
    ``None``."""
    return None if g is None or g.native is None else (g.native, g.b)


def project(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``m(x)``, through a cached :class:`Gemm` when ``m`` is a plain ``nn.Linear`` (an int8
    one runs its own `Int8Gemm`, counting its own fallbacks)."""
    if type(m) is nn.Linear:
        return _gemm_of(m)(x)
    if type(m) is not Int8Linear:
        _torch_on_cpu(x, "gemm")  # a replaced projection (tensor parallel)
    return m(x)


def _torch_on_cpu(x: torch.Tensor, op: str) -> None:
    """Count a call of ``op`` that a CPU float32 ``x`` runs in torch because the module is one
    the native kernel has no code for (`cpu_kernels.fallback` "unsupported")."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        cpu_kernels.fallback(op, "unsupported")


def native_linear(m: nn.Module) -> Packed | None:
    """``(packed weight, bias)`` of a plain ``nn.Linear`` on the native float32 or bf16 GEMM or
    of an `Int8Linear` on the native int8 GEMM, else ``None``."""
    if type(m) is Int8Linear:
        return _native(int8.gemm_of(m))
    return _native(_gemm_of(m)) if type(m) is nn.Linear else None


def _fuse(linears: list[nn.Module]) -> Gemm | Int8Gemm | None:
    """Stack the weights of ``linears`` into one matrix and make each module's weight (and
    bias) a row slice of it, so one GEMM replaces several and the dense weights are not
    doubled (int8 ones: `int8.fuse`). Returns ``None`` when they cannot share one GEMM (a
    mixed or replaced module, int8 off the CPU)."""
    if all(type(m) is Int8Linear for m in linears):
        return int8.fuse(linears)
    if any(type(m) is not nn.Linear for m in linears):
        return None
    if len({(m.weight.dtype, m.weight.device, m.bias is None) for m in linears}) != 1:
        return None
    with torch.inference_mode(False), torch.no_grad():
        w = torch.cat([m.weight for m in linears])
        b = None if linears[0].bias is None else torch.cat([m.bias for m in linears])
        row = 0
        for m in linears:
            n = m.out_features
            m.weight = nn.Parameter(w[row : row + n], requires_grad=False)
            if b is not None:
                m.bias = nn.Parameter(b[row : row + n], requires_grad=False)
            row += n
    g = Gemm(w, b)
    g.rows = [m.weight.data_ptr() for m in linears]  # where each module's weight must start
    return g


def _still_fused(fused: Gemm | Int8Gemm | None, linears: list[nn.Module]) -> bool:
    """True while every module's weight is still the row slice of ``fused`` it was given."""
    if fused is None or not fused.current(fused.w, fused.b) or len(linears) != len(fused.rows):
        return False
    for m, row in zip(linears, fused.rows, strict=True):  # per forward: no slicing of ``w``
        if type(m) is nn.Linear:
            if m.weight.data_ptr() != row:
                return False
        elif type(m) is not Int8Linear or int8.row_key(m) != row:
            return False
    return True


def attention_args(c, **over: Any) -> dict[str, Any]:
    """`Attention`'s arguments from a `ModelConfig`: its shape, the q/k/v bias
    (``attention_bias``) and o_proj's (``o_proj_bias``); ``over`` replaces or adds any."""
    shape = dict(hidden_size=c.hidden_size, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads)
    return shape | dict(head_dim=c.head_dim, qkv_bias=c.attention_bias, o_bias=c.o_proj_bias) | over


class Attention(nn.Module):
    """GQA self-attention over the paged cache, with optional qkv bias and q/k norm.

    ``q_norm`` / ``k_norm`` are per-head `RMSNorm`s (Qwen3) that the fused norm + RoPE kernel
    computes; a subclass with other norms (Gemma-3's, OLMo-2's) sets ``kernel_qk_norm`` False
    and overrides `norm_qk`."""

    kernel_qk_norm = True  # q_norm / k_norm are what `cpu_kernels.qk_norm_rope` computes

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
        eps: float = 1e-6,
        softcap: float | None = None,
        scale: float | None = None,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.softcap = softcap  # Gemma-2's attention score cap (`shared.model.softcap`)
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)
        else:
            self.q_norm = self.k_norm = None
        self._qkv = None  # Gemm over the weight backing q/k/v_proj, built on first forward

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: AttentionPlan,
        slot_mapping: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        t, nh, nkv = x.shape[0], self.num_heads, self.num_kv_heads
        gemm = self._fused_qkv()
        if gemm is not None:  # one GEMM, then q/k normed and rotated together
            qkv = gemm(x).view(t, nh + 2 * nkv, self.head_dim)
            qk, v = qkv[:, : nh + nkv], qkv[:, nh + nkv :]
            qn, kn = self.q_norm, self.k_norm
            if qn is not None and not self.kernel_qk_norm:  # normed here, only rotated below
                qkv = qk = torch.cat(self.norm_qk(qk[:, :nh], qk[:, nh:]), dim=1)
                qn = kn = None
            fused = cpu_kernels.qk_norm_rope(  # in place on the fresh GEMM output, one call
                qkv,
                nh + nkv,
                nh,
                None if qn is None else qn.weight,
                None if kn is None else kn.weight,
                0.0 if qn is None else qn.eps,
                cos,
                sin,
            )
            if not fused:
                if qn is not None:
                    qk = self._qk_norm(qk)
                qk = apply_rope(qk, cos, sin)
            q, k = qk[:, :nh], qk[:, nh:]
        else:  # projections that do not stack (int8 on CUDA, replaced ones)
            q = project(self.q_proj, x).view(t, nh, self.head_dim)
            k = project(self.k_proj, x).view(t, nkv, self.head_dim)
            v = project(self.v_proj, x).view(t, nkv, self.head_dim)
            if self.q_norm is not None:
                q, k = self.norm_qk(q, k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = self.attend(q, k, v, plan, slot_mapping, k_cache, v_cache)
        return project(self.o_proj, o.reshape(t, self.num_heads * self.head_dim))

    def attend(self, q, k, v, plan, slot_mapping, k_cache, v_cache) -> torch.Tensor:
        """The new K/V written, ``q [T, H, D]`` attended over the paged context (a subclass with
        another score rule overrides it: GPT-OSS's sinks)."""
        if self.softcap is not None:  # the native attention kernels take no cap
            if plan.decodes:
                _torch_on_cpu(q, "decode_attention")
            if plan.prefill is not None:
                _torch_on_cpu(q, "prefill_attention")
            return softcap_attention(
                q, k, v, k_cache, v_cache, slot_mapping, plan, self.scale, self.softcap
            )
        return paged_attention(q, k, v, k_cache, v_cache, slot_mapping, plan, self.scale)

    def _fused_qkv(self) -> Gemm | Int8Gemm | None:
        """The one GEMM over q/k/v_proj, fused again when a projection changed; ``None`` when
        they cannot share one."""
        projs = [self.q_proj, self.k_proj, self.v_proj]
        if not _still_fused(self._qkv, projs):
            self._qkv = _fuse(projs)
        return self._qkv

    def native_qkv(self) -> Packed | None:
        """``(packed weight, bias)`` of the fused q/k/v projection on a native GEMM, or None."""
        return _native(self._fused_qkv())

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q [T, H, D]`` and ``k [T, KVH, D]`` normed (before RoPE)."""
        return self.q_norm(q), self.k_norm(k)

    def _qk_norm(self, qk: torch.Tensor) -> torch.Tensor:
        """``q_norm``/``k_norm`` over ``[T, H + KVH, D]`` in one pass (same ops per element)."""
        h = qk.float()
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.q_norm.eps)).to(qk.dtype)
        h[:, : self.num_heads].mul_(self.q_norm.weight)
        h[:, self.num_heads :].mul_(self.k_norm.weight)
        return h


class MLP(nn.Module):
    """Gated MLP: ``down(act(gate(x)) * up(x))`` (SwiGLU for ``silu``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = activation(act)
        self.act_name = act
        self._gate_up = None  # Gemm over the weight backing gate/up_proj, built on first forward

    def _fused_gate_up(self) -> Gemm | Int8Gemm | None:
        """The one GEMM over gate/up_proj, fused again when one changed; ``None`` when they
        cannot share one."""
        projs = [self.gate_proj, self.up_proj]
        if not _still_fused(self._gate_up, projs):
            self._gate_up = _fuse(projs)
        return self._gate_up

    def native_gate_up(self) -> Packed | None:
        """``(packed weight, bias)`` of the fused gate/up projection on a native GEMM when the
        gating is SiLU (the one the native layer computes), or None."""
        return _native(self._fused_gate_up()) if self.act_name == "silu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self._fused_gate_up()
        if fused is None:
            g, u = project(self.gate_proj, x), project(self.up_proj, x)
            return project(self.down_proj, self.act(g) * u)
        n = self.gate_proj.out_features
        gu = fused(x)
        return project(self.down_proj, self.act(gu[..., :n]).mul_(gu[..., n:]))


class PreNormBlock(nn.Module):
    """The pre-norm decoder block, ``h += attn(norm1(h)); h += mlp(norm2(h))``, for families
    whose norm or MLP the one-call native layer does not take (Gemma's ``(1 + w)`` RMSNorm,
    StarCoder2's LayerNorms and ungated MLP): run op by op, ``native_reason`` saying why. The
    submodules keep the checkpoints' names (``self_attn``, ``mlp``, ``input_layernorm``,
    ``post_attention_layernorm``)."""

    def __init__(self, c, mlp: nn.Module, norm, native_reason: str):
        super().__init__()
        self.self_attn = Attention(**attention_args(c))
        self.mlp = mlp
        self.input_layernorm = norm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = norm(c.hidden_size, c.rms_norm_eps)
        self.native_reason = native_reason

    def forward(self, h, cos, sin, plan, slot_mapping, k_cache, v_cache):
        a = self.self_attn(self.input_layernorm(h), cos, sin, plan, slot_mapping, k_cache, v_cache)
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h))

    def native(self) -> None:
        return None
