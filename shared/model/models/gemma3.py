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

import torch

from shared.model.api import AttentionMetadata, KVCache, LayerCallback
from shared.model.attention import AttentionPlan
from shared.model.config import ModelConfig
from shared.model.layers import Attention, Rotary
from shared.model.models.gemma2 import Gemma2DecoderLayer, Gemma2ForCausalLM, GemmaRMSNorm


class Gemma3Attention(Attention):
    """Attention with Gemma's per-head ``(1 + w)`` q/k norms."""

    kernel_qk_norm = False  # the fused kernel's norm is ``w * x``

    def __init__(self, c: ModelConfig):
        super().__init__(
            c.hidden_size,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            qkv_bias=c.attention_bias,
            o_bias=c.attention_bias,
            scale=(c.query_pre_attn_scalar or c.head_dim) ** -0.5,
        )
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
    """Paged-KV Gemma-3; the batch contract of ``shared/model/api.py``."""

    layer_class = Gemma3DecoderLayer
    _local: Rotary | None = None

    def local_rotary(self) -> Rotary:
        """The sliding layers' RoPE (`ModelConfig.rope_local`)."""
        if self._local is None or self._local.inv_freq.device != self.device:
            theta, scaling = self.config.rope_local or (self.config.rope_theta, None)
            self._local = Rotary(self.config.head_dim, theta, scaling, self.device)
        return self._local

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        inputs_embeds: torch.Tensor | None = None,
        layer_callback: LayerCallback | None = None,
    ) -> torch.Tensor:
        """Every layer op by op, each on its layer type's RoPE; final-normed hidden ``[T, H]``."""
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        h = h.to(self.dtype)
        positions = positions.to(self.device)
        ropes = (self.rotary()(positions, self.dtype), self.local_rotary()(positions, self.dtype))
        plan = AttentionPlan.build(meta, kv_cache.block_size, self.device)
        slots = meta.slot_mapping.to(self.device)
        sliding = self.config.sliding_layers
        for i, layer in enumerate(self.model.layers):
            cos, sin = ropes[i in sliding]
            h = layer(h, cos, sin, plan, slots, kv_cache.k[i], kv_cache.v[i])
            if layer_callback is not None:
                layer_callback(i)
        return self.model.norm(h)
