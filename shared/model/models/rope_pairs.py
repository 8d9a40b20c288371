"""GLM, GLM-4, ERNIE 4.5 and Helium: Llama-family decoders whose RoPE rotates interleaved pairs.

transformers rotates dims ``(2i, 2i + 1)`` of each q / k head by frequency ``i`` (GLM only the
first ``int(head_dim * partial_rotary_factor)`` dims, the rest passed through); Llama's RoPE,
which every Strata kernel computes, rotates ``(j, j + head_dim / 2)``. Attention scores are dot
products of a q head with a k head, unchanged when both are permuted alike, so once the
checkpoint's tensors are in (`fold_constants`) the q_proj and k_proj rows (and biases) of every
head are reordered: rotated pair ``i`` goes to ``(i, i + head_dim / 2)``, the passed-through dims
fill the rest of both halves. The RoPE tables (`PairedRotary`) carry frequency 0 there, so
``cos = 1``, ``sin = 0`` and ``x * 1 - y * 0 == x`` exactly. The forward is then Llama's: fused
q/k/v GEMM, the fused norm + RoPE kernel, the native attention kernels and, for GLM, ERNIE 4.5 and
Helium, the one-call native layer. Each rotated value is computed with transformers' operations
(``x * cos - y * sin``); only the order of the q.k sums over a head differs. K is cached in the
permuted order (the KV hand-off and the pool move Strata's own layout).

* GLM (``GlmForCausalLM``): q/k/v bias (``attention_bias``, default on), none on o_proj,
  ``gate_up_proj`` fused in the checkpoint (split at load as Phi-3's), partial RoPE (default half);
* GLM-4 (``Glm4ForCausalLM``): GLM's attention and MLP with two more norms, on the attention
  output (``post_self_attn_layernorm``) and the MLP output (``post_mlp_layernorm``) before each
  residual add; it runs op by op (`layer.c` has no post-norms);
* ERNIE 4.5 (``Ernie4_5ForCausalLM``): RoPE on the whole head, ``use_bias`` on every projection,
  tied embeddings by default; transformers rotates in float32 whatever the model dtype (the same
  numbers in a float32 model);
* Helium (``HeliumForCausalLM``): RoPE on the whole head, q/k/v bias ``attention_bias``, its
  RMSNorm multiplies by the weight in float32 before the cast (`HeliumRMSNorm`: the same
  numbers as Llama's in a float32 model).
"""

from __future__ import annotations

import torch

from shared.model.config import ModelConfig
from shared.model.layers import MLP, PreNormBlock, RMSNorm, Rotary, rope_inv_freq
from shared.model.models.llama import DecoderLayer, LlamaForCausalLM


def pair_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """``order[new] = old``: the dims of a head as Strata keeps them. Rotated pair ``i`` (dims
    ``2i``, ``2i + 1``) lands at ``i`` and ``i + head_dim / 2``; the ``head_dim - rotary_dim``
    passed-through dims fill positions ``rotary_dim / 2 .. head_dim / 2`` of each half."""
    half, rot = head_dim // 2, rotary_dim // 2
    passed = list(range(rotary_dim, head_dim))
    first = [2 * i for i in range(rot)] + passed[: half - rot]
    second = [2 * i + 1 for i in range(rot)] + passed[half - rot :]
    return torch.tensor(first + second)


class PairedRotary(Rotary):
    """Llama's RoPE tables for `pair_order`'s layout: the rotated part's frequencies (computed
    over ``rotary_dim`` dims as transformers does), then frequency 0 (``cos = 1``, ``sin = 0``)
    for the passed-through dims of each half."""

    def __init__(self, head_dim: int, rotary_dim: int, theta: float, scaling, device):
        inv = rope_inv_freq(rotary_dim, theta, scaling)
        pad = torch.zeros(head_dim // 2 - inv.numel(), dtype=inv.dtype)
        self.inv_freq = torch.cat([inv, pad]).to(device)


class PairedRopeForCausalLM(LlamaForCausalLM):
    """The Llama-family model for checkpoints with interleaved RoPE (see the module doc)."""

    def rotary_dim(self) -> int:
        c = self.config
        return int(c.head_dim * c.partial_rotary_factor)

    def rotary(self) -> Rotary:
        if self._rotary is None or self._rotary.inv_freq.device != self.device:
            c = self.config
            self._rotary = PairedRotary(
                c.head_dim, self.rotary_dim(), c.rope_theta, c.rope_scaling, self.device
            )
        return self._rotary

    def fold_constants(self) -> None:
        """Reorder each head's q_proj / k_proj rows (and biases) into `pair_order` (the loader
        runs this once, after the checkpoint's tensors are in)."""
        d = self.config.head_dim
        order = pair_order(d, self.rotary_dim())
        with torch.no_grad():
            for layer in self.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                    heads = proj.out_features // d
                    rows = (torch.arange(heads)[:, None] * d + order[None, :]).reshape(-1)
                    rows = rows.to(proj.weight.device)
                    proj.weight.copy_(proj.weight[rows])
                    if proj.bias is not None:
                        proj.bias.copy_(proj.bias[rows])


class GlmForCausalLM(PairedRopeForCausalLM):
    """Paged-KV GLM: Llama's layer (one native call on CPU) with GLM's biases and RoPE."""


class Ernie4_5ForCausalLM(PairedRopeForCausalLM):
    """Paged-KV ERNIE 4.5: Llama's layer with ``use_bias`` and interleaved RoPE."""


class HeliumRMSNorm(RMSNorm):
    """``(weight * x / rms(x)).to(dtype)`` with the product in float32 (transformers'
    HeliumRMSNorm): Llama's numbers (and its native kernel) in a float32 model."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return super().forward(x)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


class HeliumDecoderLayer(DecoderLayer):
    """Llama's layer on `HeliumRMSNorm`s (the one-call native layer in float32)."""

    def __init__(self, c: ModelConfig, index: int = 0):
        super().__init__(c, index)
        self.input_layernorm = HeliumRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = HeliumRMSNorm(c.hidden_size, c.rms_norm_eps)


class HeliumForCausalLM(PairedRopeForCausalLM):
    """Paged-KV Helium: Llama's layer with interleaved RoPE and `HeliumRMSNorm`."""

    layer_class = HeliumDecoderLayer
    norm_class = HeliumRMSNorm


class Glm4DecoderLayer(PreNormBlock):
    """GLM's block with the attention and MLP outputs normed before the residual adds:
    ``h += post_self_attn(attn(in(h)))``, ``h += post_mlp(mlp(post_attention(h)))``."""

    def __init__(self, c: ModelConfig, index: int = 0):
        mlp = MLP(c.hidden_size, c.intermediate_size, c.hidden_act, bias=c.mlp_bias)
        reason = "GLM-4 (norms on the attention and MLP outputs) runs op by op"
        super().__init__(c, mlp, RMSNorm, reason)
        self.post_self_attn_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_mlp_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, h, cos, sin, plan, slot_mapping, k_cache, v_cache):
        a = self.self_attn(self.input_layernorm(h), cos, sin, plan, slot_mapping, k_cache, v_cache)
        h = h + self.post_self_attn_layernorm(a)
        return h + self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(h)))


class Glm4ForCausalLM(PairedRopeForCausalLM):
    """Paged-KV GLM-4; the batch contract of ``shared/model/api.py``."""

    layer_class = Glm4DecoderLayer


__all__ = ["GlmForCausalLM", "Glm4ForCausalLM", "Ernie4_5ForCausalLM", "HeliumForCausalLM"]
