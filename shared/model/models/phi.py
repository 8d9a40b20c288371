"""Phi (Phi-1 / 1.5 / 2, ``PhiForCausalLM``) over the paged KV cache.

* one LayerNorm (with bias, ``layer_norm_eps``) per layer feeds attention and MLP in parallel:
  ``h = attn(ln(h)) + mlp(ln(h)) + h``;
* RoPE on the first ``int(head_dim * partial_rotary_factor)`` dims of each q / k head (default
  half), the rest passed through;
* biases on q/k/v, the output projection (``dense``), ``fc1`` / ``fc2`` and the LM head;
* an ungated ``gelu_new`` MLP, a final ``final_layernorm``;
* optional ``qk_layernorm``: a LayerNorm over each q and k head before RoPE.

The attention writes and reads Strata's paged KV cache (`paged_attention`, its native kernels
on CPU float32), the projections run on the fused q/k/v and packed GEMMs; RoPE on part of the
head runs in torch (the fused norm + RoPE kernel rotates whole heads: counted as a
``qk_norm_rope`` fallback, reason ``unsupported``), and the one-call native layer (`layer.c`)
does not apply (counted as a ``decoder_layer`` fallback, reason ``unsupported``).

Its pieces are general: `PartialRotaryAttention` (any output projection name, optional q/k
norms, RoPE on part of the head), `ParallelBlock` (parallel or sequential residual on one or two
LayerNorms) and `PartialRotaryForCausalLM` (RoPE tables over the rotated part) also build
GPT-NeoX and StableLM (`models/gpt_neox.py`, `models/stablelm.py`) and Cohere's block.
"""

from __future__ import annotations

import torch
from torch import nn

from shared.model import cpu_kernels
from shared.model.attention import paged_attention
from shared.model.config import ModelConfig
from shared.model.layers import Attention, Rotary, apply_rope, project
from shared.model.models.llama import LlamaForCausalLM
from shared.model.models.starcoder2 import PlainMLP


def rope_part(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int) -> torch.Tensor:
    """RoPE on the first ``rot`` dims of ``x [T, heads, D]`` (``cos``/``sin [T, rot]``), in place
    on ``x`` (a fresh projection); the other dims unchanged, as transformers' Phi does."""
    if rot == x.shape[-1]:
        return apply_rope(x, cos, sin)
    x[..., :rot] = apply_rope(x[..., :rot], cos, sin)
    return x


class PartialRotaryAttention(Attention):
    """q/k/v, an output projection named ``o_name`` (Phi's and GPT-NeoX's ``dense``), optional
    q/k norms (``qk_norms``: modules over ``[T, heads, D]``, Phi's one LayerNorm for every head,
    StableLM's one per head) before RoPE on the first ``rotary_dim`` dims of each head."""

    o_name = "o_proj"  # the output projection's name (`shared.model.parallel.shard_model`)

    def __init__(
        self,
        c: ModelConfig,
        qkv_bias: bool,
        o_bias: bool,
        o_name: str = "o_proj",
        qk_norms: tuple[nn.Module, nn.Module] | None = None,
    ):
        super().__init__(
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, qkv_bias=qkv_bias, o_bias=o_bias
        )
        if o_name != "o_proj":
            self.o_name = o_name
            setattr(self, o_name, self._modules.pop("o_proj"))
        self.rotary_dim = int(c.head_dim * c.partial_rotary_factor)
        self.q_layernorm, self.k_layernorm = qk_norms or (None, None)

    def forward(self, x, cos, sin, plan, slot_mapping, k_cache, v_cache) -> torch.Tensor:
        t, nh, nkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        gemm = self._fused_qkv()
        if gemm is not None:  # one GEMM over q/k/v; q, k, v are views of its fresh output
            qkv = gemm(x).view(t, nh + 2 * nkv, d)
            q, k, v = qkv[:, :nh], qkv[:, nh : nh + nkv], qkv[:, nh + nkv :]
        else:  # projections that do not stack (int8 on CUDA, tensor-parallel ones)
            q = project(self.q_proj, x).view(t, nh, d)
            k = project(self.k_proj, x).view(t, nkv, d)
            v = project(self.v_proj, x).view(t, nkv, d)
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if x.device.type == "cpu" and x.dtype == torch.float32:
            cpu_kernels.fallback("qk_norm_rope", "unsupported")  # the kernel rotates whole heads
        q = rope_part(q, cos, sin, self.rotary_dim)
        k = rope_part(k, cos, sin, self.rotary_dim)
        o = paged_attention(q, k, v, k_cache, v_cache, slot_mapping, plan, self.scale)
        return project(getattr(self, self.o_name), o.reshape(t, nh * d))


class PhiAttention(PartialRotaryAttention):
    """Biased q/k/v and ``dense`` projections, optional LayerNorms (one for every head) on q and
    k, RoPE on ``rotary_dim`` dims of each head."""

    def __init__(self, c: ModelConfig):
        norms = None
        if c.qk_norm:  # transformers sizes them hidden_size // num_attention_heads
            dim = c.hidden_size // c.num_heads
            norms = (nn.LayerNorm(dim, c.rms_norm_eps), nn.LayerNorm(dim, c.rms_norm_eps))
        super().__init__(c, qkv_bias=True, o_bias=True, o_name="dense", qk_norms=norms)


class ParallelBlock(nn.Module):
    """Attention and MLP side by side on LayerNorms (Phi, GPT-NeoX, StableLM, Cohere), run op by
    op (`native_reason` says why). ``parallel``: ``h + attn(ln1(h)) + mlp(ln(h))``, the MLP on
    ``ln1(h)`` when there is no ``post_norm`` (Phi, StableLM, Cohere), else on ``post_norm(h)``
    (GPT-NeoX); otherwise in sequence, ``h += attn(ln1(h)); h += mlp(post_norm(h))``. The sum
    of three runs in the order transformers adds them: ``(attn + mlp) + h``, or with
    ``residual_first`` ``(h + attn) + mlp``. Submodules keep the checkpoints' names
    (``self_attn``, ``mlp``, ``input_layernorm``, ``post_attention_layernorm``)."""

    residual_first = False

    def __init__(
        self,
        attn: nn.Module,
        mlp: nn.Module,
        norm: nn.Module,
        post_norm: nn.Module | None,
        parallel: bool,
        native_reason: str,
    ):
        super().__init__()
        self.self_attn, self.mlp, self.input_layernorm = attn, mlp, norm
        self.post_attention_layernorm = post_norm
        self.parallel = parallel
        self.native_reason = native_reason

    def forward(self, h, cos, sin, plan, slot_mapping, k_cache, v_cache):
        x = self.input_layernorm(h)
        a = self.self_attn(x, cos, sin, plan, slot_mapping, k_cache, v_cache)
        post = self.post_attention_layernorm
        if not self.parallel:
            h = a + h
            return self.mlp(post(h)) + h
        m = self.mlp(x if post is None else post(h))
        return h + a + m if self.residual_first else a + m + h

    def native(self) -> None:
        return None


class PhiDecoderLayer(ParallelBlock):
    """Parallel block on one LayerNorm: ``x = ln(h); h = attn(x) + mlp(x) + h``."""

    def __init__(self, c: ModelConfig, index: int = 0):
        super().__init__(
            PhiAttention(c),
            PlainMLP(c, ("fc1", "fc2")),
            nn.LayerNorm(c.hidden_size, c.rms_norm_eps),
            None,
            True,
            "Phi (parallel attention and MLP, LayerNorm, partial RoPE) runs op by op",
        )


class PartialRotaryForCausalLM(LlamaForCausalLM):
    """The Llama-family model whose RoPE tables span the rotated part of the head,
    ``int(head_dim * partial_rotary_factor)`` dims (`PartialRotaryAttention.rotary_dim`)."""

    def rotary(self) -> Rotary:
        if self._rotary is None or self._rotary.inv_freq.device != self.device:
            c = self.config
            dim = int(c.head_dim * c.partial_rotary_factor)
            self._rotary = Rotary(dim, c.rope_theta, c.rope_scaling, self.device)
        return self._rotary


class PhiForCausalLM(PartialRotaryForCausalLM):
    """Paged-KV Phi; the batch contract of ``shared/model/api.py``."""

    layer_class = PhiDecoderLayer
    norm_class = nn.Identity  # Phi's final norm is ``model.final_layernorm``, applied in forward

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.model.final_layernorm = nn.LayerNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=True)
        self.tie_weights()

    @torch.inference_mode()
    def forward(self, *args, **kwargs) -> torch.Tensor:
        """The Llama-family forward (its final norm the identity), then ``final_layernorm``."""
        return self.model.final_layernorm(super().forward(*args, **kwargs))
