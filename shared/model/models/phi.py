"""Phi (Phi-1 / 1.5 / 2, ``PhiForCausalLM``) over the paged KV cache.

* one LayerNorm (with bias, ``layer_norm_eps``) per layer feeds attention and MLP in parallel:
  ``h = attn(ln(h)) + mlp(ln(h)) + h``;
* RoPE on the first ``int(head_dim * partial_rotary_factor)`` dims of each q / k head (default
  half), the rest passed through;
* biases on q/k/v, the output projection (``dense``), ``fc1`` / ``fc2`` and the LM head;
* an ungated ``gelu_new`` MLP, a final ``final_layernorm``;
* optional ``qk_layernorm``: a LayerNorm over each q and k head before RoPE.

The attention writes and reads Strata's paged KV cache (`paged_attention`, its native kernels
on CPU float32), the projections run on the fused q/k/v and packed GEMMs; RoPE on part of the
head runs in torch (the fused norm + RoPE kernel rotates whole heads: counted as a
``qk_norm_rope`` fallback, reason ``unsupported``), and the one-call native layer (`layer.c`)
does not apply (counted as a ``decoder_layer`` fallback, reason ``unsupported``).
"""

from __future__ import annotations

import torch
from torch import nn

from shared.model import cpu_kernels
from shared.model.attention import paged_attention
from shared.model.config import ModelConfig
from shared.model.layers import Attention, Rotary, apply_rope, project
from shared.model.models.llama import LlamaForCausalLM
from shared.model.models.starcoder2 import PlainMLP


def rope_part(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int) -> torch.Tensor:
    """RoPE on the first ``rot`` dims of ``x [T, heads, D]`` (``cos``/``sin [T, rot]``), in place
    on ``x`` (a fresh projection); the other dims unchanged, as transformers' Phi does."""
    if rot == x.shape[-1]:
        return apply_rope(x, cos, sin)
    x[..., :rot] = apply_rope(x[..., :rot], cos, sin)
    return x


class PhiAttention(Attention):
    """Biased q/k/v and ``dense`` projections, optional per-head LayerNorms on q and k, RoPE on
    ``rotary_dim`` dims of each head."""

    o_name = "dense"  # the output projection's name (`shared.model.parallel.shard_model`)

    def __init__(self, c: ModelConfig):
        super().__init__(
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, qkv_bias=True, o_bias=True
        )
        self.dense = self._modules.pop("o_proj")
        self.rotary_dim = int(c.head_dim * c.partial_rotary_factor)
        if c.qk_norm:  # transformers sizes them hidden_size // num_attention_heads
            self.q_layernorm = nn.LayerNorm(c.hidden_size // c.num_heads, c.rms_norm_eps)
            self.k_layernorm = nn.LayerNorm(c.hidden_size // c.num_heads, c.rms_norm_eps)
        else:
            self.q_layernorm = self.k_layernorm = None

    def forward(self, x, cos, sin, plan, slot_mapping, k_cache, v_cache) -> torch.Tensor:
        t, nh, nkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        gemm = self._fused_qkv()
        if gemm is not None:  # one GEMM over q/k/v; q, k, v are views of its fresh output
            qkv = gemm(x).view(t, nh + 2 * nkv, d)
            q, k, v = qkv[:, :nh], qkv[:, nh : nh + nkv], qkv[:, nh + nkv :]
        else:  # projections that do not stack (int8 on CUDA, tensor-parallel ones)
            q = project(self.q_proj, x).view(t, nh, d)
            k = project(self.k_proj, x).view(t, nkv, d)
            v = project(self.v_proj, x).view(t, nkv, d)
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if x.device.type == "cpu" and x.dtype == torch.float32:
            cpu_kernels.fallback("qk_norm_rope", "unsupported")  # the kernel rotates whole heads
        q = rope_part(q, cos, sin, self.rotary_dim)
        k = rope_part(k, cos, sin, self.rotary_dim)
        o = paged_attention(q, k, v, k_cache, v_cache, slot_mapping, plan, self.scale)
        return project(self.dense, o.reshape(t, nh * d))


class PhiDecoderLayer(nn.Module):
    """Parallel block: ``x = ln(h); h = attn(x) + mlp(x) + h``."""

    def __init__(self, c: ModelConfig, index: int = 0):
        super().__init__()
        self.self_attn = PhiAttention(c)
        self.mlp = PlainMLP(c, ("fc1", "fc2"))
        self.input_layernorm = nn.LayerNorm(c.hidden_size, c.rms_norm_eps)
        self.native_reason = (
            "Phi (parallel attention and MLP, LayerNorm, partial RoPE) runs op by op"
        )

    def forward(self, h, cos, sin, plan, slot_mapping, k_cache, v_cache):
        x = self.input_layernorm(h)
        a = self.self_attn(x, cos, sin, plan, slot_mapping, k_cache, v_cache)
        return a + self.mlp(x) + h  # transformers' order of the sum

    def native(self) -> None:
        return None


class PhiForCausalLM(LlamaForCausalLM):
    """Paged-KV Phi; the batch contract of ``shared/model/api.py``."""

    layer_class = PhiDecoderLayer
    norm_class = nn.Identity  # Phi's final norm is ``model.final_layernorm``, applied in forward

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.model.final_layernorm = nn.LayerNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=True)
        self.tie_weights()

    def rotary(self) -> Rotary:
        """RoPE over the rotated part of the head (`PhiAttention.rotary_dim`)."""
        if self._rotary is None or self._rotary.inv_freq.device != self.device:
            c = self.config
            dim = int(c.head_dim * c.partial_rotary_factor)
            self._rotary = Rotary(dim, c.rope_theta, c.rope_scaling, self.device)
        return self._rotary

    @torch.inference_mode()
    def forward(self, *args, **kwargs) -> torch.Tensor:
        """The Llama-family forward (its final norm the identity), then ``final_layernorm``."""
        return self.model.final_layernorm(super().forward(*args, **kwargs))
