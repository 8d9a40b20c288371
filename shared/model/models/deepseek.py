"""DeepSeek-V3 and DeepSeek-V2 (``DeepseekV3ForCausalLM`` / ``DeepseekV2ForCausalLM``) over the
paged KV cache: Llama's pre-norm layer with multi-head latent attention (MLA) and DeepSeekMoE.

* attention (`MLAttention`): q from ``q_proj``, or through the low-rank ``q_a_proj`` ->
  ``q_a_layernorm`` -> ``q_b_proj`` when ``q_lora_rank`` is set; ``kv_a_proj_with_mqa`` gives
  the compressed latent (``kv_lora_rank``, normed by ``kv_a_layernorm``) and one rope key
  shared by every head; ``kv_b_proj`` expands the latent into each head's no-RoPE key
  (``qk_nope_head_dim``) and value (``v_head_dim``). RoPE acts on the last
  ``qk_rope_head_dim`` dims of q and on the shared key: V3 on interleaved pairs
  (``rope_interleave``, else rotate_half), V2 as complex numbers in float32; YaRN scales cos /
  sin by its attention factor and the softmax scale by ``mscale(mscale_all_dim) ** 2``. The
  q_a / kv_a projections share one GEMM; the a-norms have transformers' fixed eps 1e-6;
* the cache holds the decompressed per-head K (nope + rope) and V, V zero-padded to K's head
  dim (`ModelConfig.head_dim`, the larger of the two; q and k are padded instead when V is the
  wider), and sliced back after the attention: the paged attention and its kernels take them
  as ordinary attention with ``num_kv_heads = num_heads`` (docs/MODEL.md says what it costs);
* MLP: dense for the first ``first_k_dense_replace`` layers, then `shared.model.moe.SparseMoE`
  with DeepSeek's router (`moe.route_grouped`) and its ungated shared experts.

The layers run op by op (the one-call native layer is Llama's attention): counted as a
``decoder_layer`` fallback, reason ``unsupported``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from shared.model.attention import paged_attention
from shared.model.config import ModelConfig
from shared.model.layers import (
    MLP,
    RMSNorm,
    _fuse,
    _still_fused,
    apply_rope,
    project,
    rope_inv_freq,
)
from shared.model.models.llama import LlamaForCausalLM
from shared.model.moe import SparseMoE
from shared.model.parallel import _row_parallel, _rows

_A_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with its default eps


def yarn_inv_freq(dim: int, theta: float, s: dict) -> torch.Tensor:
    """YaRN's inverse frequencies for ``dim`` rotary dims: the interpolated (``/ factor``) and
    the original ones blended over the dims between the ``beta_fast`` and ``beta_slow``
    rotation counts at ``original_max_position_embeddings`` (rounded out unless ``truncate``
    is false), as transformers computes them."""
    factor, orig = float(s["factor"]), float(s["original_max_position_embeddings"])
    fast, slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    base = theta ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    keep = 1 - ramp  # the share of the original frequency
    return (1.0 / (factor * base)) * (1 - keep) + (1.0 / base) * keep


class DeepseekRotary:
    """RoPE tables over the ``qk_rope_head_dim`` rotary dims: ``(cos, sin)`` ``[T, dims]``
    (rotate_half layout, times YaRN's attention factor, in the activation dtype), or for V2's
    ``"complex"`` RoPE ``(freqs_cis [T, dims / 2] complex64, None)`` as transformers builds it."""

    def __init__(self, c: ModelConfig, device):
        m, s = c.mla, c.rope_scaling
        dim = m.qk_rope_head_dim
        if s and s["rope_type"] == "yarn":
            inv = yarn_inv_freq(dim, c.rope_theta, s)
        else:
            inv = rope_inv_freq(dim, c.rope_theta, s)
        self.inv_freq = inv.to(device)
        self.factor, self.complex = m.attention_factor, m.rope == "complex"

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        if self.complex:
            return torch.polar(torch.ones_like(freqs), freqs) * self.factor, None
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.factor).to(dtype), (emb.sin() * self.factor).to(dtype)


class MLAttention(nn.Module):
    """Multi-head latent attention over the paged cache (see the module doc); the
    checkpoint's names."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        m = self.mla = c.mla
        h, nh = c.hidden_size, c.num_heads
        self.num_heads = self.num_kv_heads = nh
        self.head_dim, self.scale = c.head_dim, m.scale
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(h, nh * m.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, m.q_lora_rank, bias=c.attention_bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, _A_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, nh * m.qk_head_dim, bias=False)
        width = m.kv_lora_rank + m.qk_rope_head_dim
        self.kv_a_proj_with_mqa = nn.Linear(h, width, bias=c.attention_bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, _A_NORM_EPS)
        kv = nh * (m.qk_nope_head_dim + m.v_head_dim)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, kv, bias=False)
        self.o_proj = nn.Linear(nh * m.v_head_dim, h, bias=c.o_proj_bias)
        self._a = None  # one Gemm over q_a_proj (or q_proj) and kv_a_proj_with_mqa

    def _q_first(self) -> nn.Module:
        return self.q_proj if self.mla.q_lora_rank is None else self.q_a_proj

    def _inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q_a_proj(x) or q_proj(x), kv_a_proj_with_mqa(x))``, one GEMM when they stack."""
        projs = [self._q_first(), self.kv_a_proj_with_mqa]
        if not _still_fused(self._a, projs):
            self._a = _fuse(projs)
        if self._a is None:
            return project(projs[0], x), project(projs[1], x)
        y = self._a(x)
        n = projs[0].out_features
        return y[:, :n], y[:, n:]

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor | None) -> torch.Tensor:
        """RoPE on the rotary dims ``x [T, heads, qk_rope_head_dim]``. V2: pairs as complex
        numbers in float32 (the result stays interleaved); V3 interleaved: the pairs split
        into rotate_half's halves first (same products as transformers)."""
        if self.mla.rope == "complex":
            pairs = x.float().reshape(*x.shape[:-1], -1, 2).contiguous()
            out = torch.view_as_complex(pairs) * cos[:, None, :]
            return torch.view_as_real(out).flatten(-2).to(x.dtype)
        if self.mla.rope == "interleave":
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return apply_rope(x, cos, sin)

    def _heads(self, parts: list[torch.Tensor], t: int) -> torch.Tensor:
        """``parts`` (``[T, heads or 1, d_i]``) side by side in a ``[T, heads, head_dim]``
        tensor, zero-padded at the end."""
        out = parts[0].new_empty(t, self.num_heads, self.head_dim)
        at = 0
        for p in parts:
            out[..., at : at + p.shape[-1]] = p
            at += p.shape[-1]
        out[..., at:] = 0
        return out

    def forward(self, x, cos, sin, plan, slot_mapping, k_cache, v_cache) -> torch.Tensor:
        m, t, nh = self.mla, x.shape[0], self.num_heads
        dn, dv = m.qk_nope_head_dim, m.v_head_dim
        q, ckv = self._inputs(x)
        if m.q_lora_rank is not None:
            q = project(self.q_b_proj, self.q_a_layernorm(q.contiguous()))
        q = q.view(t, nh, m.qk_head_dim)
        latent = self.kv_a_layernorm(ckv[:, : m.kv_lora_rank].contiguous())
        kv = project(self.kv_b_proj, latent).view(t, nh, dn + dv)
        q_rot = self.rope(q[..., dn:], cos, sin)
        k_rot = self.rope(ckv[:, None, m.kv_lora_rank :], cos, sin)  # one key for every head
        q = self._heads([q[..., :dn], q_rot], t)
        k = self._heads([kv[..., :dn], k_rot], t)
        v = self._heads([kv[..., dn:]], t)
        o = paged_attention(q, k, v, k_cache, v_cache, slot_mapping, plan, self.scale)
        return project(self.o_proj, o[..., :dv].reshape(t, nh * dv))

    def shard_heads(self, rank: int, world: int, tp) -> None:
        """Keep rank ``rank``'s ``num_heads / world`` heads (`shared.model.parallel`): their
        q rows (``q_proj`` or ``q_b_proj``), ``kv_b_proj`` rows (nope key and value) and
        ``o_proj`` columns (row-parallel, all-reduced); the latent path (``q_a_proj``,
        ``kv_a_proj_with_mqa``, the a-norms) and the shared rope key stay whole."""
        m, nh = self.mla, self.num_heads // world
        lo, hi = rank * nh, (rank + 1) * nh
        q = self.q_proj if m.q_lora_rank is None else self.q_b_proj
        _rows(q, lo * m.qk_head_dim, hi * m.qk_head_dim)
        per = m.qk_nope_head_dim + m.v_head_dim
        _rows(self.kv_b_proj, lo * per, hi * per)
        self.o_proj = _row_parallel(self.o_proj, lo * m.v_head_dim, hi * m.v_head_dim, tp)
        self.num_heads = self.num_kv_heads = nh
        self._a = None


class DeepseekDecoderLayer(nn.Module):
    """Pre-norm block ``h += attn(norm(h)); h += mlp(norm(h))`` with `MLAttention`; the MLP
    dense below ``first_k_dense_replace``, DeepSeekMoE from there."""

    def __init__(self, c: ModelConfig, index: int = 0):
        super().__init__()
        self.self_attn = MLAttention(c)
        if index in c.moe_layers:
            self.mlp: MLP | SparseMoE = SparseMoE(c, index)
        else:
            self.mlp = MLP(c.hidden_size, c.intermediate_size, c.hidden_act, bias=c.mlp_bias)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.native_reason = "DeepSeek (latent attention, DeepSeekMoE) runs op by op"

    def forward(self, h, cos, sin, plan, slot_mapping, k_cache, v_cache):
        a = self.self_attn(self.input_layernorm(h), cos, sin, plan, slot_mapping, k_cache, v_cache)
        h, x = self.post_attention_layernorm.add_forward(h, a)
        return h + self.mlp(x)

    def native(self) -> None:
        return None


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """Paged-KV DeepSeek-V3; the batch contract of ``shared/model/api.py``. ``head_dim`` and
    ``num_kv_heads`` describe the cache: the decompressed heads."""

    layer_class = DeepseekDecoderLayer

    def rotary(self) -> DeepseekRotary:
        if self._rotary is None or self._rotary.inv_freq.device != self.device:
            self._rotary = DeepseekRotary(self.config, self.device)
        return self._rotary

    def layer_ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple]:
        """Every layer's RoPE tables (one RoPE: `DeepseekRotary`)."""
        return [self.rotary()(positions, dtype)] * self.num_layers


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """Paged-KV DeepSeek-V2: V3's model; the config selects the complex (interleaved, float32)
    RoPE, the softmax router and the bias-free choice (`deepseek_config.deepseek_fields`)."""
