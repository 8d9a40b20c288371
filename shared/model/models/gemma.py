"""Gemma (1) over the paged KV cache: Gemma-2's model (`models/gemma2.py`) without its additions.

* RMSNorm scales by ``1 + w``, in float32 before the cast (`GemmaRMSNorm`);
* embeddings are multiplied by ``sqrt(hidden_size)`` (cast to the weight dtype);
* Llama's pre-norm layer, ``h += attn(in(h))``, ``h += mlp(post_attn(h))``: no pre/post
  feed-forward norms, no soft-capping, attention scale ``head_dim ** -0.5``, no window;
* GELU-tanh gating (a legacy ``hidden_act: "gelu"`` means it too), ``head_dim`` from the config,
  tied embeddings by default.

The one-call native layer does not apply (its norm is ``w * x``, its gating SiLU): the model
runs op by op (fused q/k/v and gate/up GEMMs, native RoPE and attention kernels), as Gemma-2's.
"""

from __future__ import annotations

from shared.model.config import ModelConfig
from shared.model.layers import MLP, PreNormBlock
from shared.model.models.gemma2 import Gemma2ForCausalLM, GemmaRMSNorm


class GemmaDecoderLayer(PreNormBlock):
    """Llama's pre-norm block on `GemmaRMSNorm` (see the module doc)."""

    def __init__(self, c: ModelConfig, index: int = 0):
        mlp = MLP(c.hidden_size, c.intermediate_size, c.hidden_act)
        super().__init__(c, mlp, GemmaRMSNorm, "Gemma ((1 + w) norms, GELU) runs op by op")


class GemmaForCausalLM(Gemma2ForCausalLM):
    """Paged-KV Gemma; the batch contract of ``shared/model/api.py``. Gemma-2's embedding
    scale, final norm and op-by-op forward; ``final_logit_softcapping`` is None, so its
    `compute_logits` caps nothing."""

    layer_class = GemmaDecoderLayer
