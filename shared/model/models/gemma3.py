"""Gemma-3 (text, ``Gemma3ForCausalLM``) over the paged KV cache: Gemma-2's model with

* per-head ``q_norm`` / ``k_norm``, ``(1 + w)`` RMSNorms, on q and k before RoPE;
* two RoPEs: the layers ``layer_types`` marks sliding rotate by ``rope_local`` (4.x
  ``rope_local_base_freq``, default base 10000), the others by the global one (default base
  1e6, where a ``linear`` scaling applies);
* no attention soft-capping (transformers 5.x's Gemma-3 attention passes no cap, whatever
  ``attn_logit_softcapping`` says), the final logit cap only when set (default none).

Its sliding layers get the context cap of a windowed checkpoint (`ModelConfig.max_model_len`),
where full attention is exact. No cap means the native attention kernels apply; the one-call
native layer does not (sandwich norms, GELU): the model runs op by op.
"""

from __future__ import annotations

from shared.model.config import ModelConfig
from shared.model.layers import Attention, attention_args
from shared.model.models.gemma2 import Gemma2DecoderLayer, Gemma2ForCausalLM, GemmaRMSNorm


class Gemma3Attention(Attention):
    """Attention with Gemma's per-head ``(1 + w)`` q/k norms."""

    kernel_qk_norm = False  # the fused kernel's norm is ``w * x``

    def __init__(self, c: ModelConfig):
        scale = (c.query_pre_attn_scalar or c.head_dim) ** -0.5
        super().__init__(**attention_args(c, o_bias=c.attention_bias, scale=scale))
        self.q_norm = GemmaRMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(c.head_dim, c.rms_norm_eps)


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    """Gemma-2's sandwich-normed block around `Gemma3Attention`."""

    def __init__(self, c: ModelConfig, index: int = 0):
        super().__init__(c, index)
        self.native_reason = "Gemma-3 (sandwich and (1 + w) q/k norms, GELU) runs op by op"

    def attention(self, c: ModelConfig) -> Attention:
        return Gemma3Attention(c)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Paged-KV Gemma-3; the batch contract of ``shared/model/api.py``. Every layer runs op by
    op, each on its layer type's RoPE (`LlamaForCausalLM.layer_ropes`: the layers
    ``sliding_layers`` lists on ``rope_local``)."""

    layer_class = Gemma3DecoderLayer
