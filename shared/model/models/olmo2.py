"""OLMo-2 over the paged KV cache: the Llama-family model with norms moved.

* no input norm: each layer norms its attention and MLP outputs before the residual add,
  ``h += post_attn(attn(h))``, ``h += post_ff(mlp(h))``;
* ``q_norm`` / ``k_norm`` are RMSNorms over the whole q and k projections (every head at once,
  ``[T, heads * head_dim]``), before RoPE;
* its RMSNorm multiplies the weight before the cast back (``(w * x).to(dtype)``), which differs
  from Llama's only below float32.

The one-call native layer (`layer.c`: pre-norms, per-head q/k norm) does not apply: the model
runs op by op (fused q/k/v and gate/up GEMMs, native RoPE and attention kernels). Its q/k norm
spans every head, so tensor parallelism (heads over ranks) is refused
(`shared.model.parallel.check_shardable`).
"""

from __future__ import annotations

import torch
from torch import nn

from shared.model.config import ModelConfig
from shared.model.layers import MLP, Attention, RMSNorm, attention_args
from shared.model.models.llama import LlamaForCausalLM


class Olmo2RMSNorm(RMSNorm):
    """``(weight * x / rms(x)).to(dtype)`` in float32 (transformers' Olmo2RMSNorm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # the same numbers as Llama's order: its native kernel
            return super().forward(x)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


class Olmo2Attention(Attention):
    """Attention whose q/k norms span all heads of the projection."""

    kernel_qk_norm = False

    def __init__(self, c: ModelConfig):
        super().__init__(**attention_args(c))
        self.q_norm = Olmo2RMSNorm(c.num_heads * c.head_dim, c.rms_norm_eps)
        self.k_norm = Olmo2RMSNorm(c.num_kv_heads * c.head_dim, c.rms_norm_eps)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = q.shape[0]  # q, k: views into the fused GEMM's rows, copied whole for the kernel
        q = self.q_norm(q.reshape(t, -1).contiguous()).view(q.shape)
        return q, self.k_norm(k.reshape(t, -1).contiguous()).view(k.shape)


class Olmo2DecoderLayer(nn.Module):
    """Post-normed block (see the module doc)."""

    def __init__(self, c: ModelConfig, index: int = 0):
        super().__init__()
        self.self_attn = Olmo2Attention(c)
        self.mlp = MLP(c.hidden_size, c.intermediate_size, c.hidden_act)
        self.post_attention_layernorm = Olmo2RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_feedforward_layernorm = Olmo2RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.native_reason = "OLMo-2 (post-norms, q/k norm over all heads) runs op by op"

    def forward(self, h, cos, sin, plan, slot_mapping, k_cache, v_cache):
        a = self.self_attn(h, cos, sin, plan, slot_mapping, k_cache, v_cache)
        h = h + self.post_attention_layernorm(a)
        return h + self.post_feedforward_layernorm(self.mlp(h))

    def native(self) -> None:
        return None


class Olmo2ForCausalLM(LlamaForCausalLM):
    """Paged-KV OLMo-2; the batch contract of ``shared/model/api.py``."""

    layer_class = Olmo2DecoderLayer
    norm_class = Olmo2RMSNorm
