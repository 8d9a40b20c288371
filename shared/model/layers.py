"""Decoder building blocks: RMSNorm, rotary embedding (incl. llama3 scaling), attention, MLP.

Numerics follow transformers' Llama/Qwen code so logits match it: RMSNorm in float32, cos/sin
computed in float32 then cast to the activation dtype, ``rotate_half`` RoPE layout. Every
projection is a plain ``nn.Linear`` so it can be swapped for a quantised linear.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.attention import AttentionPlan, paged_attention

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
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
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


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
    """RoPE on ``x: [T, heads, D]`` with ``cos/sin: [T, D]`` (rotate_half layout)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """GQA self-attention over the paged cache, with optional qkv bias and q/k norm."""

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
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)
        else:
            self.q_norm = self.k_norm = None

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
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = paged_attention(q, k, v, k_cache, v_cache, slot_mapping, plan, self.scale)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """Gated MLP: ``down(act(gate(x)) * up(x))`` (SwiGLU for ``silu``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
