"""Llama-family decoders (Llama, Mistral, Qwen2, Qwen3, Phi-3, Qwen3-MoE, Mixtral) over the
paged KV cache.

One class covers the family; ``ModelConfig`` flags select qkv bias (Qwen2), q/k norm (Qwen3),
RoPE scaling, tied embeddings and which layers' MLP is a sparse MoE block (`shared.model.moe`).
Module names mirror transformers so checkpoints load by name.
"""

from __future__ import annotations

import torch
from torch import nn

from shared.config import RuntimeSettings
from shared.model import cpu_kernels
from shared.model.api import AttentionMetadata, KVCache, LayerCallback
from shared.model.attention import AttentionPlan
from shared.model.config import ModelConfig
from shared.model.layers import (
    MLP,
    Attention,
    RMSNorm,
    Rotary,
    attention_args,
    native_linear,
    project,
)
from shared.model.moe import SparseMoE

# Each decoder layer in one native call on CPU (`cpu_kernels.decoder_layer`) instead of ~30 torch
# ops and kernel calls with Python between them; STRATA_CPU_LAYER=0 turns it off. A float32
# model's, and a bf16 model's with its hidden state in float32 between the layers (the KV cache
# stays bf16); docs/ENGINE.md.
NATIVE_LAYER = RuntimeSettings.from_env().cpu_layer


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h += attn(norm(h)); h += mlp(norm(h))``."""

    def __init__(self, c: ModelConfig, index: int = 0):
        super().__init__()
        self.self_attn = Attention(**attention_args(c, qk_norm=c.qk_norm, eps=c.rms_norm_eps))
        if index in c.moe_layers:
            self.mlp: MLP | SparseMoE = SparseMoE(c, index)
        else:
            self.mlp = MLP(c.hidden_size, c.intermediate_size, c.hidden_act, bias=c.mlp_bias)
        # why `native` returns None for this layer (None: it may run natively); layer.c has no
        # router, so a sparse MoE layer (and with it the whole model) runs op by op
        self.native_reason: str | None = None
        if isinstance(self.mlp, SparseMoE):
            self.native_reason = "a sparse MoE MLP (grouped experts run op by op)"
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, h, cos, sin, plan, slot_mapping, k_cache, v_cache):
        a = self.self_attn(self.input_layernorm(h), cos, sin, plan, slot_mapping, k_cache, v_cache)
        h, x = self.post_attention_layernorm.add_forward(h, a)
        return h + self.mlp(x)

    def native(self) -> cpu_kernels.NativeLayer | None:
        """This layer for `cpu_kernels.decoder_layer`: every projection a plain linear on the
        native float32 (or every one on the bf16) GEMM, or every one an int8 linear on the native
        int8 GEMM, SiLU gating; rebuilt when a weight changes, ``None`` when it cannot run
        (`native_reason` then says why)."""
        a, m = self.self_attn, self.mlp
        if isinstance(m, SparseMoE):
            return None
        if getattr(a.o_proj, "all_reduces", False):  # tensor parallel: reason set by the shard
            return None
        parts = (a.native_qkv(), native_linear(a.o_proj), m.native_gate_up())
        parts += (native_linear(m.down_proj),)
        if any(p is None for p in parts) or len({type(p[0]) for p in parts}) != 1:
            self.native_reason = "a projection on no native GEMM, or float32, bf16, int8 mixed"
            self.__dict__["_native"] = None
            return None
        norms = (self.input_layernorm, self.post_attention_layernorm, a.q_norm, a.k_norm)
        key = (
            *(id(p[0]) for p in parts),
            *((n.weight.data_ptr(), n.weight._version, n.eps) for n in norms if n is not None),
        )
        cached = self.__dict__.get("_native")
        if cached is not None and cached.key == key:
            return cached
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        layer = cpu_kernels.native_layer(
            (ln1.weight, ln1.eps),
            parts[0],
            None if a.q_norm is None else (a.q_norm.weight, a.k_norm.weight, a.q_norm.eps),
            parts[1],
            (ln2.weight, ln2.eps),
            parts[2],
            parts[3],
            a.num_heads,
            a.num_kv_heads,
            a.head_dim,
            a.scale,
        )
        if layer is not None:
            layer.key = key
        self.__dict__["_native"] = layer
        return layer


class DecoderStack(nn.Module):
    """Embedding, layers and final norm (transformers' ``model.*`` prefix)."""

    def __init__(self, c: ModelConfig, layer=DecoderLayer, norm=RMSNorm):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(layer(c, i) for i in range(c.num_layers))
        self.norm = norm(c.hidden_size, c.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Paged-KV causal LM; see ``shared/model/api.py`` for the batch contract."""

    layer_class: type[nn.Module] = DecoderLayer  # a subclass's decoder layer and norm
    norm_class: type[nn.Module] = RMSNorm

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderStack(config, self.layer_class, self.norm_class)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.num_layers = config.num_layers
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.hidden_size = config.hidden_size
        self._rotary: Rotary | None = None
        self._local: Rotary | None = None
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the LM head with the embedding when the checkpoint ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def rotary(self) -> Rotary:
        if self._rotary is None or self._rotary.inv_freq.device != self.device:
            c = self.config
            self._rotary = Rotary(c.head_dim, c.rope_theta, c.rope_scaling, self.device)
        return self._rotary

    def local_rotary(self) -> Rotary:
        """The sliding layers' RoPE (`ModelConfig.rope_local`: Gemma-3, OLMo-3)."""
        if self._local is None or self._local.inv_freq.device != self.device:
            theta, scaling = self.config.rope_local or (self.config.rope_theta, None)
            self._local = Rotary(self.config.head_dim, theta, scaling, self.device)
        return self._local

    def layer_ropes(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's RoPE tables ``(cos, sin)`` ``[T, head_dim]``: the global RoPE's, but
        `ModelConfig.sliding_layers`' on `local_rotary` when ``rope_local`` is set (Gemma-3,
        OLMo-3) and `ModelConfig.nope_layers`' the identity, ``cos = 1``, ``sin = 0`` (SmolLM3:
        ``x * 1 + rotate_half(x) * 0 == x`` exactly, so the native layer and the fused RoPE
        kernel take a NoPE layer as they are). Layers on the same RoPE share one pair."""
        c = self.config
        full = self.rotary()(positions, dtype)
        ropes = [full] * self.num_layers
        if c.rope_local is not None and c.sliding_layers:
            local = self.local_rotary()(positions, dtype)
            for i in c.sliding_layers:
                ropes[i] = local
        if c.nope_layers:
            none = (torch.ones_like(full[0]), torch.zeros_like(full[1]))
            for i in c.nope_layers:
                ropes[i] = none
        return ropes

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, H]``."""
        return self.model.embed_tokens(input_ids)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        inputs_embeds: torch.Tensor | None = None,
        layer_callback: LayerCallback | None = None,
    ) -> torch.Tensor:
        """Run the flat batch through every layer; returns final-normed hidden ``[T, H]``."""
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        h = h.to(self.dtype)
        positions = positions.to(self.device)
        plan = AttentionPlan.build(meta, kv_cache.block_size, self.device)
        slots = meta.slot_mapping.to(self.device)
        native = self._native_forward(h, positions, plan, slots, kv_cache, inputs_embeds)
        if native is not None:
            layers, batches, h = native
            for i, layer in enumerate(layers):
                cpu_kernels.decoder_layer(layer, batches[i], h, kv_cache.k[i], kv_cache.v[i])
                if layer_callback is not None:
                    layer_callback(i)
            return self.model.norm(h)
        ropes = self.layer_ropes(positions, self.dtype)
        for i, layer in enumerate(self.model.layers):
            cos, sin = ropes[i]
            h = layer(h, cos, sin, plan, slots, kv_cache.k[i], kv_cache.v[i])
            if layer_callback is not None:
                layer_callback(i)
        return self.model.norm(h)

    def _native_forward(self, h, positions, plan, slots, kv_cache, inputs_embeds):
        """``(native layers, each one's batch, h to update in place)`` when every layer runs as
        one native call (CPU, `NATIVE_LAYER`), else ``None``. ``h`` is float32 for the layers: a
        bf16 model's embeddings are widened (and RoPE's cos/sin are float32). Layers on the same
        RoPE tables (`layer_ropes`) share one batch."""
        if h.device.type != "cpu":
            return None  # no native layer off the CPU
        why = self._native_why(h, kv_cache)
        layers = []
        for layer in self.model.layers if not why else ():
            layers.append(layer.native())
            if layers[-1] is None:
                why = "unsupported"  # layer.native_reason says what
                break
        if not why and not layers:
            return None
        if why:
            return cpu_kernels.fallback("decoder_layer", why)
        decode = None
        if plan.decodes:
            decode = (plan.decode_tables, plan.decode_ctx, plan.decode_rows)
        made: dict[int, cpu_kernels.LayerBatch | None] = {}
        batches = []
        for cos, sin in self.layer_ropes(positions, torch.float32):
            if id(cos) not in made:
                made[id(cos)] = cpu_kernels.layer_batch(
                    layers, cos, sin, slots, plan.prefill, decode
                )
            batches.append(made[id(cos)])
        if any(b is None for b in batches):
            return cpu_kernels.fallback("decoder_layer", "shape")
        # the layers update h in place: never the caller's embeddings
        fresh = inputs_embeds is None or h.data_ptr() != inputs_embeds.data_ptr()
        if h.dtype != torch.float32:
            h = h.float()  # a new tensor
        elif fresh:
            h = h.contiguous()
        else:
            h = h.clone(memory_format=torch.contiguous_format)
        return layers, batches, h

    def _native_why(self, h: torch.Tensor, kv_cache: KVCache) -> str:
        """Why this forward cannot run one native call per layer (a `cpu_kernels.fallback`
        reason), "" when it can as far as the batch goes."""
        if not NATIVE_LAYER:
            return "disabled"
        kinds = (torch.float32, torch.bfloat16)  # a bf16 model's h runs in float32
        if h.dtype not in kinds or kv_cache.k.dtype not in kinds:
            return "dtype"
        if not cpu_kernels.available():
            return cpu_kernels.off_reason()
        if not (kv_cache.k.is_contiguous() and kv_cache.v.is_contiguous()):
            return "layout"
        if self.config.moe_layers:  # layer.c has no router (see DecoderLayer.native_reason)
            return "unsupported"
        return ""

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head over ``[N, H]`` hidden states; float32 ``[N, V]``."""
        return project(self.lm_head, hidden).float()
