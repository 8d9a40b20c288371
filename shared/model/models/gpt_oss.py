"""OpenAI's gpt-oss (``GptOssForCausalLM``) over the paged KV cache: Llama's pre-norm layer with

* attention sinks (`SinkAttention`): q/k/v/o with biases, and one learned logit per head
  (``self_attn.sinks``) in every softmax's denominator, a key whose value is zero: a row's
  weights sum to less than 1. On CPU float32 the native decode and prefill attention kernels
  take the sink term (`shared.model.softcap.sink_attention`); elsewhere the attention runs in
  torch (`softcap_attention` with ``sinks``); the projections run on the native GEMMs;
* YaRN RoPE (`YarnRotary`: `deepseek.yarn_inv_freq`, cos / sin times YaRN's attention factor);
* sliding layers (``layer_types``, every other one from 0): the served context is capped at the
  window (`shared.model.archs.sliding_window_of`), so they attend as the full layers do;
* every MLP a `shared.model.moe.SparseMoE` with GPT-OSS's routing (`config_gpt_oss.SinkRouting`:
  ``mlp.router`` with a bias, a softmax over the top-k logits) and experts with biases gated by
  the clamped SwiGLU (`moe.clamped_swiglu`). The checkpoint stores ``gate_up_proj``
  ``[E, H, 2I]`` with gate and up interleaved column by column (and its bias likewise) and
  ``down_proj`` ``[E, I, H]``; the experts are built in that layout for the loader and turned
  into `moe.Experts`' (``[E, 2I, H]`` gate rows first, ``[E, H, I]``) by `fold_constants`.

The layers run op by op (the one-call native layer has neither sinks nor a router): counted as a
``decoder_layer`` fallback, reason ``unsupported``. Tensor parallel: each rank keeps its heads'
sinks (`SinkAttention.shard_head_norms`); the experts go by expert parallelism (``--tp N --ep
N``)."""

from __future__ import annotations

import torch
from torch import nn

from shared.model.config import ModelConfig
from shared.model.layers import Attention, RMSNorm, attention_args
from shared.model.models.deepseek import YarnRotary
from shared.model.models.llama import LlamaForCausalLM
from shared.model.moe import SparseMoE
from shared.model.softcap import sink_attention


class SinkAttention(Attention):
    """Llama's GQA attention with biased q/k/v/o and GPT-OSS's per-head sink logits."""

    def __init__(self, c: ModelConfig):
        super().__init__(**attention_args(c))
        self.sinks = nn.Parameter(torch.empty(c.num_heads))

    def attend(self, q, k, v, plan, slot_mapping, k_cache, v_cache) -> torch.Tensor:
        return sink_attention(q, k, v, k_cache, v_cache, slot_mapping, plan, self.scale, self.sinks)

    def shard_head_norms(self, q_lo: int, q_hi: int, kv_lo: int, kv_hi: int) -> None:
        """`shared.model.parallel.shard_model`'s per-head hook: keep this rank's heads' sinks."""
        self.sinks = nn.Parameter(self.sinks.data[q_lo:q_hi].clone(), requires_grad=False)


class GptOssDecoderLayer(nn.Module):
    """Pre-norm block ``h += attn(norm(h)); h += moe(norm(h))`` with `SinkAttention`."""

    def __init__(self, c: ModelConfig, index: int = 0):
        super().__init__()
        self.self_attn = SinkAttention(c)
        self.mlp = SparseMoE(c, index)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.native_reason = "gpt-oss (attention sinks, a sparse MoE) runs op by op"
        ex = self.mlp.experts  # the checkpoint's layout until `GptOssForCausalLM.fold_constants`
        e, h, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
        ex.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i))
        ex.down_proj = nn.Parameter(torch.empty(e, i, h))

    def forward(self, h, cos, sin, plan, slot_mapping, k_cache, v_cache):
        a = self.self_attn(self.input_layernorm(h), cos, sin, plan, slot_mapping, k_cache, v_cache)
        h, x = self.post_attention_layernorm.add_forward(h, a)
        return h + self.mlp(x)

    def native(self) -> None:
        return None

    def fold_experts(self) -> None:
        """The checkpoint's expert layout into `moe.Experts`': ``gate_up_proj`` ``[E, H, 2I]``
        (gate in the even columns, up in the odd ones; its bias likewise) becomes ``[E, 2I, H]``
        gate rows first, ``down_proj`` ``[E, I, H]`` becomes ``[E, H, I]``."""
        ex = self.mlp.experts
        with torch.no_grad():
            gu = ex.gate_up_proj.data.transpose(1, 2)  # [E, 2I, H], rows interleaved
            gu = torch.cat([gu[:, 0::2], gu[:, 1::2]], dim=1).contiguous()
            b = ex.gate_up_proj_bias.data
            b = torch.cat([b[:, 0::2], b[:, 1::2]], dim=1).contiguous()
            down = ex.down_proj.data.transpose(1, 2).contiguous()
        ex.gate_up_proj = nn.Parameter(gu, requires_grad=False)
        ex.gate_up_proj_bias = nn.Parameter(b, requires_grad=False)
        ex.down_proj = nn.Parameter(down, requires_grad=False)
        ex._gemms = None


class GptOssForCausalLM(LlamaForCausalLM):
    """Paged-KV gpt-oss; the batch contract of ``shared/model/api.py``. Checkpoint names:
    ``mlp.router`` is `SparseMoE`'s ``mlp.gate`` (`our_name`)."""

    layer_class = GptOssDecoderLayer

    @staticmethod
    def our_name(name: str) -> str:
        return name.replace(".mlp.router.", ".mlp.gate.")

    def fold_constants(self) -> None:
        """Run once by the loader after the tensors are in: the experts' layout (see
        `GptOssDecoderLayer.fold_experts`)."""
        for layer in self.model.layers:
            layer.fold_experts()

    def rotary(self) -> YarnRotary:
        if self._rotary is None or self._rotary.inv_freq.device != self.device:
            self._rotary = YarnRotary.whole_head(self.config, self.device)
        return self._rotary
