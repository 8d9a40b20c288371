"""Nemotron (``NemotronForCausalLM``: Nemotron-4, Minitron) over the paged KV cache, built from
Phi's general pieces (`models/phi.py`):

* LayerNorm1p everywhere (``input_layernorm``, ``post_attention_layernorm``, the final
  ``norm``): a LayerNorm with bias whose scale is ``1 + weight`` (`LayerNorm1P`), eps
  ``norm_eps``;
* pre-norm blocks in sequence, ``h += attn(ln1(h)); h += mlp(ln2(h))`` (`ParallelBlock` with
  ``parallel`` off);
* RoPE on the first ``int(head_dim * partial_rotary_factor)`` dims of each head (default half),
  the rest passed through (`PartialRotaryAttention`); ``attention_bias`` on q/k/v and o_proj;
* the ungated ``relu2`` MLP ``down_proj(relu(up_proj(x)) ** 2)`` (`PlainMLP`, ``mlp_bias``).

The layers run op by op (LayerNorms, partial RoPE: ``decoder_layer`` and ``qk_norm_rope``
fallbacks, reason ``unsupported``) on the fused q/k/v GEMM, the packed GEMMs and the native
attention kernels. Tensor parallelism splits the heads and the MLP as Phi's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.config import ModelConfig
from shared.model.models.phi import ParallelBlock, PartialRotaryAttention, PartialRotaryForCausalLM
from shared.model.models.starcoder2 import PlainMLP


class LayerNorm1P(nn.LayerNorm):
    """``nn.LayerNorm`` (with bias) scaled by ``1 + weight`` (the checkpoint stores the offset
    from 1), computed as transformers' NemotronLayerNorm1P: ``F.layer_norm`` in the input dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1.0, self.bias, self.eps)


class NemotronDecoderLayer(ParallelBlock):
    """Nemotron's layer (see the module doc)."""

    def __init__(self, c: ModelConfig, index: int = 0):
        super().__init__(
            PartialRotaryAttention(c, c.attention_bias, c.o_proj_bias),
            PlainMLP(c, ("up_proj", "down_proj")),
            LayerNorm1P(c.hidden_size, c.rms_norm_eps),
            LayerNorm1P(c.hidden_size, c.rms_norm_eps),
            False,
            "Nemotron (LayerNorm1p, partial RoPE, ungated relu2 MLP) runs op by op",
        )


class NemotronForCausalLM(PartialRotaryForCausalLM):
    """Paged-KV Nemotron; the batch contract of ``shared/model/api.py``."""

    layer_class = NemotronDecoderLayer
    norm_class = LayerNorm1P
