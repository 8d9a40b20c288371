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
* the cache holds the latent, as vLLM and SGLang serve MLA: one KV "head" per token,
  ``[kv_a_layernorm(latent) (kv_lora_rank), rotated k_rope (qk_rope_head_dim)]``
  (`ModelConfig.head_dim`, 576 for V3; ``num_kv_heads`` 1), used as both K and V.
  ``kv_b_proj``'s key rows (W_uk) are absorbed into q: each head attends with
  ``[q_nope @ W_uk, q_rope]`` over the latent (GQA, every query head on the one KV head; the
  softmax scale unchanged), and its output's first ``kv_lora_rank`` dims times the value rows
  (W_uv) are the head's V output, then ``o_proj``. The paged attention and its kernels take
  it as ordinary GQA; the K and V caches are one tensor (``kv_shared``, `KVCache.allocate`);
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
from shared.model.deepseek_config import rope_scales
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


class YarnRotary:
    """RoPE tables over ``dim`` rotary dims that may be YaRN (DeepSeek's rope part, gpt-oss and
    Arcee's whole head): ``(cos, sin)`` ``[T, dim]`` (rotate_half layout) times YaRN's
    attention factor, computed in float32 and cast as transformers does, or for DeepSeek-V2's
    ``complex`` RoPE ``(freqs_cis [T, dim / 2] complex64, None)``. Another RoPE: its usual
    frequencies (`rope_inv_freq`), with the factor given."""

    def __init__(
        self, dim: int, theta: float, s: dict | None, factor: float, device, complex=False
    ):
        yarn = s is not None and s["rope_type"] == "yarn"
        inv = yarn_inv_freq(dim, theta, s) if yarn else rope_inv_freq(dim, theta, s)
        self.inv_freq, self.factor, self.complex = inv.to(device), factor, complex

    @classmethod
    def whole_head(cls, c: ModelConfig, device) -> YarnRotary:
        """Over the whole head (gpt-oss, Arcee): YaRN's original context is the model's
        ``max_position_embeddings`` unless the scaling names one; the factor `rope_scales`'."""
        s = c.rope_scaling
        if s and s["rope_type"] == "yarn":
            s = {"original_max_position_embeddings": c.max_position_embeddings, **s}
        return cls(c.head_dim, c.rope_theta, s, rope_scales(s, c.head_dim)[1], device)

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
        self.num_heads, self.num_kv_heads = nh, 1  # the latent: one KV head for every head
        self.head_dim, self.scale = c.head_dim, m.scale  # kv_lora_rank + qk_rope_head_dim
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
        self._b: tuple | None = None  # (key, W_uk [heads, nope, rank], W_uv [heads, v, rank])

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

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_b_proj``'s key rows ``W_uk [heads, qk_nope_head_dim, kv_lora_rank]`` and value
        rows ``W_uv [heads, v_head_dim, kv_lora_rank]`` (views of its weight; an int8 one
        dequantised once, again when it changes)."""
        m, b = self.mla, self.kv_b_proj
        int8 = not isinstance(b, nn.Linear)  # `shared.model.int8.Int8Linear`: rows and scales
        src = (b.weight_int8, b.scale) if int8 else (b.weight,)
        key = tuple((p.data_ptr(), p._version, p.shape) for p in src)
        if self._b is None or self._b[0] != key:
            w = src[0].to(src[1].dtype) * src[1][:, None] if int8 else src[0].detach()
            w = w.view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim, -1)
            self._b = (key, w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim :])
        return self._b[1], self._b[2]

    def forward(self, x, cos, sin, plan, slot_mapping, k_cache, v_cache) -> torch.Tensor:
        m, t, nh = self.mla, x.shape[0], self.num_heads
        dn, r = m.qk_nope_head_dim, m.kv_lora_rank
        q, ckv = self._inputs(x)
        if m.q_lora_rank is not None:
            q = project(self.q_b_proj, self.q_a_layernorm(q.contiguous()))
        q = q.view(t, nh, m.qk_head_dim)
        w_uk, w_uv = self._absorbed()
        # the latent KV head: [normed latent, rotated shared rope key]
        kv = x.new_empty(t, 1, self.head_dim)
        kv[:, 0, :r] = self.kv_a_layernorm(ckv[:, :r].contiguous())
        kv[:, :, r:] = self.rope(ckv[:, None, r:], cos, sin)
        # each head's q: nope part through W_uk into the latent space, then its rotated rope part
        qe = x.new_empty(t, nh, self.head_dim)
        qe[..., :r] = torch.bmm(q[..., :dn].transpose(0, 1), w_uk).transpose(0, 1)
        qe[..., r:] = self.rope(q[..., dn:], cos, sin)
        o = paged_attention(qe, kv, kv, k_cache, v_cache, slot_mapping, plan, self.scale)
        # the attention's latent output (first kv_lora_rank dims) through W_uv: each head's V
        v = torch.bmm(o[..., :r].transpose(0, 1), w_uv.transpose(1, 2))  # [heads, T, v]
        return project(self.o_proj, v.transpose(0, 1).reshape(t, nh * m.v_head_dim))

    def shard_heads(self, rank: int, world: int, tp) -> None:
        """Keep rank ``rank``'s ``num_heads / world`` heads (`shared.model.parallel`): their
        q rows (``q_proj`` or ``q_b_proj``), ``kv_b_proj`` rows (their W_uk and W_uv) and
        ``o_proj`` columns (row-parallel, all-reduced); the latent path (``q_a_proj``,
        ``kv_a_proj_with_mqa``, the a-norms) stays whole, and so does the cached latent: its
        one KV head is replicated on every rank."""
        m, nh = self.mla, self.num_heads // world
        lo, hi = rank * nh, (rank + 1) * nh
        q = self.q_proj if m.q_lora_rank is None else self.q_b_proj
        _rows(q, lo * m.qk_head_dim, hi * m.qk_head_dim)
        per = m.qk_nope_head_dim + m.v_head_dim
        _rows(self.kv_b_proj, lo * per, hi * per)
        self.o_proj = _row_parallel(self.o_proj, lo * m.v_head_dim, hi * m.v_head_dim, tp)
        self.num_heads, self._a, self._b = nh, None, None


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
    ``num_kv_heads`` describe the cache: one latent head, the same in K and V (``kv_shared``:
    the engine gives both one tensor)."""

    layer_class = DeepseekDecoderLayer
    kv_shared = True

    def rotary(self) -> YarnRotary:
        if self._rotary is None or self._rotary.inv_freq.device != self.device:
            self._rotary = YarnRotary(
                self.config.mla.qk_rope_head_dim,
                self.config.rope_theta,
                self.config.rope_scaling,
                self.config.mla.attention_factor,
                self.device,
                complex=self.config.mla.rope == "complex",
            )
        return self._rotary

    def layer_ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple]:
        """Every layer's RoPE tables (one RoPE: `YarnRotary`)."""
        return [self.rotary()(positions, dtype)] * self.num_layers


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """Paged-KV DeepSeek-V2: V3's model; the config selects the complex (interleaved, float32)
    RoPE, the softmax router and the bias-free choice (`deepseek_config.deepseek_fields`)."""
