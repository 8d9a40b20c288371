"""Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) over the paged KV cache.

One class covers the family; ``ModelConfig`` flags select qkv bias (Qwen2), q/k norm (Qwen3),
RoPE scaling and tied embeddings. Module names mirror transformers so checkpoints load by name.
"""

from __future__ import annotations

import torch
from torch import nn

from shared.model.api import AttentionMetadata, KVCache, LayerCallback
from shared.model.attention import AttentionPlan
from shared.model.config import ModelConfig
from shared.model.layers import MLP, Attention, RMSNorm, Rotary, project


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h += attn(norm(h)); h += mlp(norm(h))``."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.self_attn = Attention(
            c.hidden_size,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            qkv_bias=c.attention_bias,
            o_bias=c.o_proj_bias,
            qk_norm=c.qk_norm,
            eps=c.rms_norm_eps,
        )
        self.mlp = MLP(c.hidden_size, c.intermediate_size, c.hidden_act, bias=c.mlp_bias)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, h, cos, sin, plan, slot_mapping, k_cache, v_cache):
        a = self.self_attn(self.input_layernorm(h), cos, sin, plan, slot_mapping, k_cache, v_cache)
        h, x = self.post_attention_layernorm.add_forward(h, a)
        return h + self.mlp(x)


class DecoderStack(nn.Module):
    """Embedding, layers and final norm (transformers' ``model.*`` prefix)."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Paged-KV causal LM; see ``shared/model/api.py`` for the batch contract."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.num_layers = config.num_layers
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.hidden_size = config.hidden_size
        self._rotary: Rotary | None = None
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the LM head with the embedding when the checkpoint ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def rotary(self) -> Rotary:
        if self._rotary is None or self._rotary.inv_freq.device != self.device:
            c = self.config
            self._rotary = Rotary(c.head_dim, c.rope_theta, c.rope_scaling, self.device)
        return self._rotary

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, H]``."""
        return self.model.embed_tokens(input_ids)

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
        """Run the flat batch through every layer; returns final-normed hidden ``[T, H]``."""
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        h = h.to(self.dtype)
        cos, sin = self.rotary()(positions.to(self.device), self.dtype)
        plan = AttentionPlan.build(meta, kv_cache.block_size, self.device)
        slots = meta.slot_mapping.to(self.device)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, plan, slots, kv_cache.k[i], kv_cache.v[i])
            if layer_callback is not None:
                layer_callback(i)
        return self.model.norm(h)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head over ``[N, H]`` hidden states; float32 ``[N, V]``."""
        return project(self.lm_head, hidden).float()
