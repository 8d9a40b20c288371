"""LLaVA-style VLM: vision tower + projector + a Llama-family decoder.

Parameter names follow the layout transformers writes to disk (``language_model.model.*``,
``vision_tower.vision_model.*``, ``multi_modal_projector.*``); the loader also accepts the
``model.language_model.*`` layout. Image embeddings are merged by the caller: it calls
``encode_images`` and ``merge_image_embeds`` and passes the result as ``inputs_embeds``.
"""

from __future__ import annotations

import torch
from torch import nn

from shared.model.api import AttentionMetadata, KVCache, LayerCallback
from shared.model.config import ModelConfig
from shared.model.models.llama import LlamaForCausalLM
from shared.model.vision import MultiModalProjector, VisionTower, select_image_features


class LlavaForConditionalGeneration(nn.Module):
    """Paged-KV LLaVA; same forward contract as the text models plus ``encode_images``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        assert config.vision is not None
        self.config = config
        self.language_model = LlamaForCausalLM(config)
        self.vision_tower = VisionTower(config.vision)
        self.multi_modal_projector = MultiModalProjector(config.vision, config.hidden_size)
        self.num_layers = config.num_layers
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.hidden_size = config.hidden_size

    def tie_weights(self) -> None:
        self.language_model.tie_weights()

    @property
    def dtype(self) -> torch.dtype:
        return self.language_model.dtype

    @property
    def device(self) -> torch.device:
        return self.language_model.device

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_tokens(input_ids)

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, 3, H, W]`` pixels -> ``[N, num_image_tokens, hidden]`` projected embeddings."""
        pixels = pixel_values.to(
            self.device, self.vision_tower.vision_model.embeddings.patch_embedding.weight.dtype
        )
        return self.multi_modal_projector(select_image_features(self.vision_tower, pixels))

    def merge_image_embeds(
        self, input_ids: torch.Tensor, image_embeds: torch.Tensor | None
    ) -> torch.Tensor:
        """Token embeddings with image placeholder rows replaced, in order, by ``image_embeds``
        (``[N, num_image_tokens, H]`` or already flattened ``[M, H]``)."""
        h = self.embed_tokens(input_ids)
        if image_embeds is None:
            return h
        rows = image_embeds.reshape(-1, h.shape[-1]).to(h.dtype)
        mask = input_ids == self.config.image_token_id
        if int(mask.sum()) != rows.shape[0]:
            raise ValueError(
                f"{int(mask.sum())} image placeholder tokens but {rows.shape[0]} image embeddings"
            )
        h = h.clone()
        h[mask] = rows
        return h

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        inputs_embeds: torch.Tensor | None = None,
        layer_callback: LayerCallback | None = None,
    ) -> torch.Tensor:
        return self.language_model(
            input_ids, positions, meta, kv_cache, inputs_embeds, layer_callback
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)
