"""Mixture-of-experts families on the layer of their dense family, over the paged KV cache; every
sparse MLP is `shared.model.moe.SparseMoE` (its routing pluggable through ``ModelConfig.routing``,
`shared.model.config_moe.MoeRouting`), so the grouped expert forward, the expert counters,
expert parallelism (`shared.model.ep`) and EPLB are the ones Qwen-MoE and DeepSeek use.

* OLMoE (``OlmoeForCausalLM``): Llama's pre-norm layer; q/k RMSNorms over the whole q and k
  projections (``[T, heads * head_dim]``) before RoPE, as OLMo-2's attention
  (`Olmo2Attention`), but Llama's RMSNorm (``w * x.to(dtype)``); softmax top-k routing
  (``norm_topk_prob``) in every layer. Its q/k norm spans every head: tensor parallelism is
  refused (`shared.model.parallel.check_shardable`), expert parallelism alone works;
* GraniteMoE / GraniteMoeShared (``GraniteMoeForCausalLM`` / ``GraniteMoeSharedForCausalLM``):
  Granite's layer (`GraniteDecoderLayer`: attention scale ``attention_multiplier``) and
  multipliers, the router a softmax over the top-k float32 logits; the checkpoint's fused
  experts ``block_sparse_moe.input_linear`` ``[E, 2I, H]`` / ``output_linear`` ``[E, H, I]``
  and ``router.layer`` are the stacked ``mlp.experts.gate_up_proj`` / ``down_proj`` and
  ``mlp.gate`` (`our_name`); GraniteMoeShared's ``shared_mlp`` (``input_linear`` gate rows then
  up rows, ``output_linear``) is `SparseMoE`'s ungated ``shared_experts`` MLP, split at load
  (`fused_parts`). The attention and MoE outputs are multiplied by ``residual_multiplier``
  in the layer (`GraniteMoeDecoderLayer`), not folded into the weights as dense Granite's;
* PhiMoE (``PhimoeForCausalLM``): pre-LayerNorm blocks (`PreNormBlock` on ``nn.LayerNorm``,
  eps ``rms_norm_eps``), q/k/v/o bias ``attention_bias``, an LM head bias ``lm_head_bias``, the
  sparsemixer top-2 router (`shared.model.moe.route_sparsemixer`);
* ERNIE 4.5 MoE (``Ernie4_5_MoeForCausalLM``): ERNIE 4.5's model (interleaved RoPE reordered
  into Llama's at load, `rope_pairs.PairedRopeForCausalLM`; ``use_bias``), dense layers outside
  the MoE range, sparse ones routed by `moe.route_grouped` (float32 softmax, the choice on the
  scores plus ``mlp.gate.e_score_correction_bias`` ``[1, E]``, the chosen scores renormalised)
  with ungated shared experts; its LM head takes ``use_bias`` too (dense ERNIE 4.5's never).

Every family runs op by op: the one-call native layer (`layer.c`) has no router.
"""

from __future__ import annotations

import torch
from torch import nn

from shared.model.config import ModelConfig
from shared.model.layers import PreNormBlock, RMSNorm
from shared.model.models.granite import GraniteDecoderLayer, GraniteForCausalLM
from shared.model.models.llama import DecoderLayer, LlamaForCausalLM
from shared.model.models.olmo2 import Olmo2Attention
from shared.model.models.rope_pairs import PairedRopeForCausalLM
from shared.model.moe import SparseMoE


class OlmoeAttention(Olmo2Attention):
    """OLMo-2's attention (q/k norms over every head at once) on Llama's RMSNorm."""

    def __init__(self, c: ModelConfig):
        super().__init__(c)
        self.q_norm = RMSNorm(c.num_heads * c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.num_kv_heads * c.head_dim, c.rms_norm_eps)


class OlmoeDecoderLayer(DecoderLayer):
    """Llama's pre-norm layer with `OlmoeAttention` and a sparse MoE MLP."""

    def __init__(self, c: ModelConfig, index: int = 0):
        super().__init__(c, index)
        self.self_attn = OlmoeAttention(c)


class OlmoeForCausalLM(LlamaForCausalLM):
    """Paged-KV OLMoE; the batch contract of ``shared/model/api.py``."""

    layer_class = OlmoeDecoderLayer


# GraniteMoE's checkpoint names (after the loader's ``block_sparse_moe.`` -> ``mlp.``) -> ours
_GRANITE_NAMES = (
    (".mlp.input_linear.weight", ".mlp.experts.gate_up_proj"),
    (".mlp.output_linear.weight", ".mlp.experts.down_proj"),
    (".mlp.router.layer.weight", ".mlp.gate.weight"),
    (".mlp.router.weight", ".mlp.gate.weight"),  # transformers 5.x's in-memory name
    (".shared_mlp.input_linear.weight", ".mlp.shared_experts.input_linear.weight"),
    (".shared_mlp.output_linear.weight", ".mlp.shared_experts.down_proj.weight"),
)


class GraniteMoeDecoderLayer(GraniteDecoderLayer):
    """Granite's layer with the sparse block, the attention and MoE outputs times
    ``residual_multiplier`` before each residual add, as transformers does (not folded into
    the weights as dense Granite's: the layer runs op by op anyway, and a folded multiplier
    rounds every expert's output apart from transformers')."""

    def __init__(self, c: ModelConfig, index: int = 0):
        super().__init__(c, index)
        self.residual_multiplier = c.residual_multiplier

    def forward(self, h, cos, sin, plan, slot_mapping, k_cache, v_cache):
        a = self.self_attn(self.input_layernorm(h), cos, sin, plan, slot_mapping, k_cache, v_cache)
        h = h + a * self.residual_multiplier
        return h + self.mlp(self.post_attention_layernorm(h)) * self.residual_multiplier


class GraniteMoeForCausalLM(GraniteForCausalLM):
    """Paged-KV GraniteMoE; the batch contract of ``shared/model/api.py``."""

    layer_class = GraniteMoeDecoderLayer

    @staticmethod
    def our_name(name: str) -> str:
        """A checkpoint tensor's name in this model's tree (the loader's hook)."""
        for old, new in _GRANITE_NAMES:
            if name.endswith(old):
                return name[: -len(old)] + new
        return name

    def fused_parts(self, name: str) -> list[tuple[str, int]] | None:
        """The shared MLP's ``input_linear`` as its gate rows then its up rows (the loader's
        hook)."""
        fused = ".mlp.shared_experts.input_linear.weight"
        if not name.endswith(fused):
            return None
        pre, width = name[: -len(fused)] + ".mlp.shared_experts.", self.config.routing.shared_width
        return [(pre + "gate_proj.weight", width), (pre + "up_proj.weight", width)]

    def fold_constants(self) -> None:
        """Nothing to fold: the layers multiply by ``residual_multiplier`` themselves
        (`GraniteMoeDecoderLayer`)."""


class GraniteMoeSharedForCausalLM(GraniteMoeForCausalLM):
    """Paged-KV GraniteMoeShared: GraniteMoE plus a shared MLP in every layer."""


class PhimoeDecoderLayer(PreNormBlock):
    """Pre-LayerNorm block: ``h += attn(ln1(h)); h += moe(ln2(h))``."""

    def __init__(self, c: ModelConfig, index: int = 0):
        reason = "PhiMoE (LayerNorms, a sparse MoE MLP) runs op by op"
        super().__init__(c, SparseMoE(c, index), nn.LayerNorm, reason)


class BiasedHead:
    """Mixin for a Llama-family model whose LM head has a bias when ``lm_head_bias`` (PhiMoE,
    ERNIE 4.5 MoE with ``use_bias``); a tied head shares the weight, its bias its own."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=config.lm_head_bias)
        self.tie_weights()


class PhimoeForCausalLM(BiasedHead, LlamaForCausalLM):
    """Paged-KV PhiMoE; the batch contract of ``shared/model/api.py``."""

    layer_class = PhimoeDecoderLayer
    norm_class = nn.LayerNorm

    @staticmethod
    def our_name(name: str) -> str:
        """transformers 5.x's in-memory router name ``mlp.router`` is ``mlp.gate`` here."""
        return name.replace(".mlp.router.weight", ".mlp.gate.weight")


class Ernie4_5_MoeDecoderLayer(DecoderLayer):
    """Llama's layer (dense MLP with ``use_bias``, or the sparse block) whose router keeps the
    correction bias as the checkpoint holds it, ``[1, E]``."""

    def __init__(self, c: ModelConfig, index: int = 0):
        super().__init__(c, index)
        if isinstance(self.mlp, SparseMoE):
            bias = torch.zeros(1, c.num_experts)
            self.mlp.gate.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)


class Ernie4_5_MoeForCausalLM(BiasedHead, PairedRopeForCausalLM):
    """Paged-KV ERNIE 4.5 MoE; the batch contract of ``shared/model/api.py``."""

    layer_class = Ernie4_5_MoeDecoderLayer

    @staticmethod
    def our_name(name: str) -> str:
        """The checkpoint's ``mlp.moe_statics.e_score_correction_bias`` (and transformers 5.x's
        ``mlp.gate.moe_statics.``) is the router's ``mlp.gate.e_score_correction_bias``."""
        for old in (".mlp.gate.moe_statics.", ".mlp.moe_statics."):
            name = name.replace(old, ".mlp.gate.")
        return name


__all__ = [
    "OlmoeForCausalLM",
    "GraniteMoeForCausalLM",
    "GraniteMoeSharedForCausalLM",
    "PhimoeForCausalLM",
    "Ernie4_5_MoeForCausalLM",
]
