"""Cohere (``CohereForCausalLM``: Command-R, Aya) over the paged KV cache:

* one bias-free LayerNorm per layer (``layer_norm_eps``) feeds attention and a gated SiLU MLP
  in parallel, ``h = h + attn(x) + mlp(x)`` (Phi's `ParallelBlock`, transformers' order of the
  sum); the final ``norm`` is bias-free too;
* RoPE rotates interleaved pairs ``(2i, 2i + 1)`` of the whole head: the q_proj / k_proj rows
  (and biases, and the q/k norm weights) of every head are reordered once at load into Llama's
  ``(i, i + head_dim / 2)`` pairs (`models/rope_pairs.py`'s `pair_order`), after which the fused
  q/k/v GEMM, the fused RoPE kernel and the native attention kernels run as Llama's;
* ``attention_bias`` on q/k/v/o (default off); optional ``use_qk_norm``: a bias-free LayerNorm
  over each q and k head with a weight per head (``q_norm.weight [heads, head_dim]``), before
  RoPE (`head_layer_norm`);
* the logits are multiplied by ``logit_scale`` (default 0.0625); tied embeddings by default.

The layers run op by op (``decoder_layer`` fallback, reason ``unsupported``: LayerNorms, the
parallel block). Tensor parallelism splits the heads as Llama's, each rank keeping its heads'
q/k norm rows (`CohereAttention.shard_head_norms`).
"""

from __future__ import annotations

import torch
from torch import nn

from shared.model.config import ModelConfig
from shared.model.layers import MLP, Attention, attention_args
from shared.model.models.phi import ParallelBlock
from shared.model.models.rope_pairs import PairedRopeForCausalLM, pair_order
from shared.model.models.stablelm import head_layer_norm


class BiasFreeLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm(dim, eps)`` without a bias (Cohere's norms)."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps, bias=False)


class HeadNormWeights(nn.Module):
    """Cohere's q/k norm: a bias-free LayerNorm over each head, ``weight [heads, head_dim]``."""

    def __init__(self, heads: int, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(heads, dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return head_layer_norm(x, self.weight, self.eps)


class CohereAttention(Attention):
    """Llama's attention (interleaved RoPE already reordered into its layout) with optional
    per-head q/k LayerNorms, normed in torch and rotated by the fused RoPE kernel."""

    kernel_qk_norm = False

    def __init__(self, c: ModelConfig):
        super().__init__(**attention_args(c))
        if c.qk_norm:
            self.q_norm = HeadNormWeights(c.num_heads, c.head_dim, c.rms_norm_eps)
            self.k_norm = HeadNormWeights(c.num_kv_heads, c.head_dim, c.rms_norm_eps)

    def shard_head_norms(self, q_lo: int, q_hi: int, kv_lo: int, kv_hi: int) -> None:
        """Keep the q/k norm rows of a tensor-parallel rank's heads (`shard_model`)."""
        for norm, lo, hi in ((self.q_norm, q_lo, q_hi), (self.k_norm, kv_lo, kv_hi)):
            if norm is not None:
                norm.weight = nn.Parameter(norm.weight.data[lo:hi].clone(), requires_grad=False)


class CohereDecoderLayer(ParallelBlock):
    """Cohere's layer (see the module doc)."""

    residual_first = True  # transformers sums residual + attn + mlp

    def __init__(self, c: ModelConfig, index: int = 0):
        super().__init__(
            CohereAttention(c),
            MLP(c.hidden_size, c.intermediate_size, c.hidden_act),
            BiasFreeLayerNorm(c.hidden_size, c.rms_norm_eps),
            None,
            True,
            "Cohere (LayerNorm, parallel attention and MLP) runs op by op",
        )


class CohereForCausalLM(PairedRopeForCausalLM):
    """Paged-KV Cohere; the batch contract of ``shared/model/api.py``."""

    layer_class = CohereDecoderLayer
    norm_class = BiasFreeLayerNorm

    def fold_constants(self) -> None:
        """`PairedRopeForCausalLM.fold_constants` (q/k rows into Llama's RoPE layout), and the
        q/k norm weights' dims in the same order (the loader runs this once)."""
        super().fold_constants()
        order = pair_order(self.config.head_dim, self.rotary_dim())
        with torch.no_grad():
            for layer in self.model.layers:
                a = layer.self_attn
                for norm in (a.q_norm, a.k_norm):
                    if norm is not None:
                        norm.weight.copy_(norm.weight[:, order.to(norm.weight.device)])

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head times ``logit_scale``; float32 ``[N, V]``."""
        return super().compute_logits(hidden) * self.config.logit_scale
