"""Granite over the paged KV cache: the Llama-family model with four scalars.

* token embeddings times ``embedding_multiplier``;
* attention scale ``attention_multiplier`` (in place of ``head_dim ** -0.5``);
* each layer's attention and MLP outputs times ``residual_multiplier`` before the residual add;
* logits divided by ``logits_scaling``.

The residual multiplier is folded into ``o_proj`` and ``down_proj`` (weight and bias) once the
checkpoint is loaded (`fold_constants`): ``h + m * (W x + b) == h + (m W) x + m b`` up to
rounding, so the layer is a plain Llama layer and runs as one native call (`layer.c`, which
takes the attention scale) where a Llama layer does. The embedding multiplier and the logits
divisor stay outside the layers (the LM head may be tied to the embedding).
"""

from __future__ import annotations

import torch

from shared.model.config import ModelConfig
from shared.model.layers import project
from shared.model.models.llama import DecoderLayer, LlamaForCausalLM


class GraniteDecoderLayer(DecoderLayer):
    """A Llama layer whose attention scale is ``attention_multiplier``."""

    def __init__(self, c: ModelConfig, index: int = 0):
        super().__init__(c, index)
        self.self_attn.scale = float(c.attention_multiplier or c.head_dim**-0.5)


class GraniteForCausalLM(LlamaForCausalLM):
    """Paged-KV Granite; the batch contract of ``shared/model/api.py``."""

    layer_class = GraniteDecoderLayer

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, H]`` times ``embedding_multiplier``."""
        return self.model.embed_tokens(input_ids) * self.config.embedding_multiplier

    def fold_constants(self) -> None:
        """Scale ``o_proj`` and ``down_proj`` by ``residual_multiplier`` (the loader runs this
        once, after the checkpoint's tensors are in)."""
        m = self.config.residual_multiplier
        if m == 1.0:
            return
        with torch.no_grad():
            for layer in self.model.layers:
                for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                    proj.weight.mul_(m)
                    if proj.bias is not None:
                        proj.bias.mul_(m)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head over ``[N, H]`` divided by ``logits_scaling``; float32 ``[N, V]``."""
        return (project(self.lm_head, hidden) / self.config.logits_scaling).float()
