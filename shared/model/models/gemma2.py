"""Gemma-2 over the paged KV cache: the Llama-family model with Gemma's differences.

* RMSNorm scales by ``1 + w`` (the checkpoint stores ``w``), in float32 before the cast;
* embeddings are multiplied by ``sqrt(hidden_size)`` (cast to the weight dtype);
* each layer norms the attention and MLP outputs too: ``h += post_attn(attn(in(h)))``,
  ``h += post_ff(mlp(pre_ff(h)))``;
* attention scale ``query_pre_attn_scalar ** -0.5`` and scores soft-capped
  (`shared.model.softcap`); final logits soft-capped: ``cap * tanh(logits / cap)``;
* tied embeddings by default, GELU-tanh gating.

Every other layer uses a sliding window in transformers; Strata serves such a checkpoint with
its context capped at the window (`ModelConfig.max_model_len`), where full attention is exact.
The one-call native layer does not apply (no cap, other norms): the model runs op by op.
"""

from __future__ import annotations

import torch
from torch import nn

from shared.model.config import ModelConfig
from shared.model.layers import MLP, Attention, attention_args, project
from shared.model.models.llama import LlamaForCausalLM


class GemmaRMSNorm(nn.Module):
    """``(1 + weight) * x / rms(x)`` in float32, cast back (transformers' Gemma2RMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class Gemma2DecoderLayer(nn.Module):
    """Sandwich-normed block (see the module doc)."""

    def __init__(self, c: ModelConfig, index: int = 0):
        super().__init__()
        self.self_attn = self.attention(c)
        self.mlp = MLP(c.hidden_size, c.intermediate_size, c.hidden_act)
        for name in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            setattr(self, f"{name}_layernorm", GemmaRMSNorm(c.hidden_size, c.rms_norm_eps))
        self.native_reason = "Gemma-2 (soft-capped attention, sandwich norms) runs op by op"

    def attention(self, c: ModelConfig) -> Attention:
        """Gemma-2's: scale ``query_pre_attn_scalar ** -0.5``, scores capped."""
        scale = (c.query_pre_attn_scalar or c.head_dim) ** -0.5
        over = dict(o_bias=c.attention_bias, softcap=c.attn_logit_softcapping, scale=scale)
        return Attention(**attention_args(c, **over))

    def forward(self, h, cos, sin, plan, slot_mapping, k_cache, v_cache):
        a = self.self_attn(self.input_layernorm(h), cos, sin, plan, slot_mapping, k_cache, v_cache)
        h = h + self.post_attention_layernorm(a)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))

    def native(self) -> None:
        return None


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Paged-KV Gemma-2; the batch contract of ``shared/model/api.py``."""

    layer_class = Gemma2DecoderLayer
    norm_class = GemmaRMSNorm

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, H]`` times ``sqrt(hidden_size)``."""
        e = self.model.embed_tokens(input_ids)
        return e * torch.tensor(self.config.hidden_size**0.5, dtype=e.dtype)

    def _native_forward(self, *args):
        return None  # layer.c has no soft-cap nor Gemma's norms

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head over ``[N, H]``, soft-capped; float32 ``[N, V]``."""
        logits = project(self.lm_head, hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
