"""StableLM (``StableLmForCausalLM``: StableLM-3B-4E1T, StableLM-2) over the paged KV cache,
built from Phi's general pieces (`models/phi.py`):

* ``nn.LayerNorm``s with bias (``layer_norm_eps``): ``input_layernorm``, the final ``norm`` and,
  unless ``use_parallel_residual``, ``post_attention_layernorm``. With ``use_parallel_residual``
  attention and MLP run side by side on the one input norm, ``h = h + attn(x) + mlp(x)``
  (transformers' order of the sum), else in sequence (the default);
* RoPE on the first ``int(head_dim * partial_rotary_factor)`` dims of each head (default a
  quarter), the rest passed through (`PartialRotaryAttention`);
* q/k/v bias ``use_qkv_bias`` (none on o_proj), GQA, Llama's gated SiLU MLP without bias;
* optional ``qk_layernorm``: a bias-free LayerNorm of its own for every q and every k head
  (``q_layernorm.norms.N`` / ``k_layernorm.norms.N``), before RoPE (`HeadLayerNorms`).

The layers run op by op (LayerNorms, partial RoPE: ``decoder_layer`` and ``qk_norm_rope``
fallbacks, reason ``unsupported``) on the fused q/k/v and gate/up GEMMs and the native attention
kernels. Tensor parallelism splits the heads as Llama's, each rank keeping its heads' q/k norms
(`StableLmAttention.shard_head_norms`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.config import ModelConfig
from shared.model.layers import MLP
from shared.model.models.phi import ParallelBlock, PartialRotaryAttention, PartialRotaryForCausalLM


def head_layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A bias-free LayerNorm over the last dim of ``x [T, heads, D]`` with a weight per head
    (``weight [heads, D]``), in float32 (a float64 model's in float64) and cast back once
    (StableLM's per-head norms, Cohere's q/k norm)."""
    wide = torch.promote_types(x.dtype, torch.float32)
    h = F.layer_norm(x.to(wide), x.shape[-1:], eps=eps)
    return h.mul_(weight.to(wide)).to(x.dtype)


class HeadLayerNorms(nn.Module):
    """One bias-free ``nn.LayerNorm`` per head (``norms.N``: the checkpoint's names), applied to
    ``[T, heads, D]`` at once (`head_layer_norm`)."""

    def __init__(self, heads: int, dim: int, eps: float):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(dim, eps, bias=False) for _ in range(heads))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = torch.stack([n.weight for n in self.norms])
        return head_layer_norm(x, weight, self.eps)

    def keep(self, lo: int, hi: int) -> None:
        """Keep heads ``lo .. hi - 1`` (a tensor-parallel rank's)."""
        self.norms = nn.ModuleList(list(self.norms)[lo:hi])


class StableLmAttention(PartialRotaryAttention):
    """q/k/v (bias ``use_qkv_bias``), o_proj without bias, optional per-head q/k LayerNorms,
    RoPE on part of each head."""

    def __init__(self, c: ModelConfig):
        norms = None
        if c.qk_norm:
            d, eps = c.head_dim, c.rms_norm_eps
            norms = (HeadLayerNorms(c.num_heads, d, eps), HeadLayerNorms(c.num_kv_heads, d, eps))
        super().__init__(c, qkv_bias=c.attention_bias, o_bias=False, qk_norms=norms)

    def shard_head_norms(self, q_lo: int, q_hi: int, kv_lo: int, kv_hi: int) -> None:
        """Keep the q/k norms of a tensor-parallel rank's heads (`shard_model`)."""
        if self.q_layernorm is not None:
            self.q_layernorm.keep(q_lo, q_hi)
            self.k_layernorm.keep(kv_lo, kv_hi)


class StableLmDecoderLayer(ParallelBlock):
    """StableLM's layer (see the module doc)."""

    residual_first = True  # transformers sums residual + attn + mlp

    def __init__(self, c: ModelConfig, index: int = 0):
        post = None if c.parallel_residual else nn.LayerNorm(c.hidden_size, c.rms_norm_eps)
        super().__init__(
            StableLmAttention(c),
            MLP(c.hidden_size, c.intermediate_size, c.hidden_act),
            nn.LayerNorm(c.hidden_size, c.rms_norm_eps),
            post,
            c.parallel_residual,
            "StableLM (LayerNorms, partial RoPE) runs op by op",
        )


class StableLmForCausalLM(PartialRotaryForCausalLM):
    """Paged-KV StableLM; the batch contract of ``shared/model/api.py``."""

    layer_class = StableLmDecoderLayer
    norm_class = nn.LayerNorm
