"""HunYuan-V1-Dense (``HunYuanDenseV1ForCausalLM``) over the paged KV cache: Llama's layer whose
per-head q/k RMSNorms (``query_layernorm`` / ``key_layernorm``) come after RoPE.

* ``attention_bias`` on q/k/v and o_proj, the gated SiLU MLP without bias;
* q and k are rotated first (the fused RoPE kernel, no norm), then each head is RMS-normed
  with its weight (`HunYuanAttention`), as transformers does; the norm after the rotation is
  why the one-call native layer (`layer.c`: norm, then RoPE) does not apply and the layers run
  op by op (fused q/k/v and gate/up GEMMs, native attention kernels);
* its ``dynamic`` RoPE: with ``alpha`` a fixed NTK-alpha base, without it the plain base
  (`shared.model.config_more.hunyuan_rope`).

The q/k norms act within a head, so tensor parallelism splits the heads as Llama's.
"""

from __future__ import annotations

import torch

from shared.model import cpu_kernels
from shared.model.attention import paged_attention
from shared.model.config import ModelConfig
from shared.model.layers import (
    Attention,
    PreNormBlock,
    RMSNorm,
    apply_rope,
    attention_args,
    project,
)
from shared.model.models.llama import MLP, LlamaForCausalLM


def head_rms_norm(
    x: torch.Tensor, num_q: int, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``[T, H + KVH, D]`` q and k heads RMS-normed per head in float32, cast back, then times
    ``q_weight`` (the first ``num_q`` heads) or ``k_weight`` (transformers' RMSNorm order)."""
    h = x.float()
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    h[:, :num_q].mul_(q_weight)
    h[:, num_q:].mul_(k_weight)
    return h


class HunYuanAttention(Attention):
    """q/k/v (bias ``attention_bias``), RoPE, then per-head q/k RMSNorms, paged attention."""

    def __init__(self, c: ModelConfig):
        super().__init__(**attention_args(c))
        self.query_layernorm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.key_layernorm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(self, x, cos, sin, plan, slot_mapping, k_cache, v_cache) -> torch.Tensor:
        t, nh, nkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        gemm = self._fused_qkv()
        if gemm is not None:  # one GEMM; q and k rotated in place on its fresh output
            qkv = gemm(x).view(t, nh + 2 * nkv, d)
            qk, v = qkv[:, : nh + nkv], qkv[:, nh + nkv :]
            if not cpu_kernels.qk_norm_rope(qkv, nh + nkv, nh, None, None, 0.0, cos, sin):
                qk = apply_rope(qk, cos, sin)
        else:  # projections that do not stack (int8 on CUDA, tensor-parallel ones)
            q = project(self.q_proj, x).view(t, nh, d)
            k = project(self.k_proj, x).view(t, nkv, d)
            v = project(self.v_proj, x).view(t, nkv, d)
            qk = apply_rope(torch.cat((q, k), dim=1), cos, sin)
        qn, kn = self.query_layernorm, self.key_layernorm
        qk = head_rms_norm(qk, nh, qn.weight, kn.weight, qn.eps)
        o = paged_attention(
            qk[:, :nh], qk[:, nh:], v, k_cache, v_cache, slot_mapping, plan, self.scale
        )
        return project(self.o_proj, o.reshape(t, nh * d))


class HunYuanDecoderLayer(PreNormBlock):
    """Llama's pre-norm block on `HunYuanAttention`."""

    def __init__(self, c: ModelConfig, index: int = 0):
        mlp = MLP(c.hidden_size, c.intermediate_size, c.hidden_act)
        super().__init__(c, mlp, RMSNorm, "HunYuan (q/k norms after RoPE) runs op by op")
        self.self_attn = HunYuanAttention(c)


class HunYuanDenseV1ForCausalLM(LlamaForCausalLM):
    """Paged-KV HunYuan-V1-Dense; the batch contract of ``shared/model/api.py``."""

    layer_class = HunYuanDecoderLayer
