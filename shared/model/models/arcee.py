"""Arcee (``ArceeForCausalLM``: AFM-4.5B) over the paged KV cache: Llama's pre-norm layer with an
ungated MLP.

* the MLP is ``down_proj(relu2(up_proj(x)))`` (`PlainMLP` with Nemotron's names, ``mlp_bias``),
  ``relu2`` being ``relu(x) ** 2``;
* Llama's attention: ``attention_bias`` on q/k/v and o_proj, GQA, whole-head RoPE;
* RoPE default, linear, llama3 or YaRN (AFM-4.5B's): YaRN's blended inverse frequencies
  (`models.deepseek.yarn_inv_freq`) with cos / sin times its attention factor (`YarnRotary`),
  ``original_max_position_embeddings`` defaulting to ``max_position_embeddings`` as
  transformers standardises it.

The one-call native layer (`layer.c`: SiLU gating) does not apply: the layers run op by op on the
fused q/k/v GEMM, the native RoPE and attention kernels. Tensor parallelism splits the heads as
Llama's and the MLP as StarCoder2's (``up_proj`` rows, ``down_proj`` columns).
"""

from __future__ import annotations

from shared.model.config import ModelConfig
from shared.model.layers import PreNormBlock, RMSNorm
from shared.model.models.deepseek import YarnRotary
from shared.model.models.llama import LlamaForCausalLM
from shared.model.models.starcoder2 import PlainMLP


class ArceeDecoderLayer(PreNormBlock):
    """Llama's pre-norm block with the ungated ``relu2`` MLP."""

    def __init__(self, c: ModelConfig, index: int = 0):
        mlp = PlainMLP(c, ("up_proj", "down_proj"))
        super().__init__(c, mlp, RMSNorm, "Arcee (ungated relu2 MLP) runs op by op")


class ArceeForCausalLM(LlamaForCausalLM):
    """Paged-KV Arcee; the batch contract of ``shared/model/api.py``."""

    layer_class = ArceeDecoderLayer

    def rotary(self) -> YarnRotary:
        if self._rotary is None or self._rotary.inv_freq.device != self.device:
            self._rotary = YarnRotary.whole_head(self.config, self.device)
        return self._rotary
