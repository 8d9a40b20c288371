"""Vision towers (CLIP and SigLIP ViTs) and the LLaVA projector.

Module names mirror transformers (``vision_model.embeddings.patch_embedding``,
``encoder.layers.N.self_attn.q_proj``, CLIP's ``pre_layrnorm`` spelling included) so the
weights load by name. The tower returns the hidden states LLaVA selects, never more layers
than needed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.config import VisionConfig
from shared.model.layers import activation


class VisionEmbeddings(nn.Module):
    """Patchify + (CLIP) class token + learned absolute positions."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.cls = c.has_cls_token
        self.patch_embedding = nn.Conv2d(
            c.num_channels, c.hidden_size, c.patch_size, stride=c.patch_size, bias=not self.cls
        )
        if self.cls:
            self.class_embedding = nn.Parameter(torch.zeros(c.hidden_size))
        self.position_embedding = nn.Embedding(c.num_patches + int(self.cls), c.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        w = self.patch_embedding.weight
        x = self.patch_embedding(pixels.to(w.dtype)).flatten(2).transpose(1, 2)
        if self.cls:
            cls = self.class_embedding.expand(x.shape[0], 1, -1)
            x = torch.cat([cls, x], dim=1)
        return x + self.position_embedding.weight[None]


class VisionAttention(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.num_heads = c.num_heads
        self.head_dim = c.hidden_size // c.num_heads
        self.q_proj = nn.Linear(c.hidden_size, c.hidden_size)
        self.k_proj = nn.Linear(c.hidden_size, c.hidden_size)
        self.v_proj = nn.Linear(c.hidden_size, c.hidden_size)
        self.out_proj = nn.Linear(c.hidden_size, c.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape

        def heads(p: nn.Linear) -> torch.Tensor:
            return p(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)

        o = F.scaled_dot_product_attention(
            heads(self.q_proj), heads(self.k_proj), heads(self.v_proj), scale=self.head_dim**-0.5
        )
        return self.out_proj(o.transpose(1, 2).reshape(b, t, -1))


class VisionMLP(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(c.hidden_size, c.intermediate_size)
        self.fc2 = nn.Linear(c.intermediate_size, c.hidden_size)
        self.act = activation(c.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.self_attn = VisionAttention(c)
        self.layer_norm2 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.mlp = VisionMLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(c) for _ in range(c.num_layers))


class VisionTransformer(nn.Module):
    """``vision_model`` of CLIPVisionModel / SiglipVisionModel (post-norm and heads unused)."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.config = c
        self.embeddings = VisionEmbeddings(c)
        if c.has_cls_token:
            self.pre_layrnorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.encoder = VisionEncoder(c)
        self.post_layernorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def hidden_states(self, pixels: torch.Tensor, wanted: list[int]) -> list[torch.Tensor]:
        """Hidden states at indices ``wanted`` (0 = embeddings, i = output of layer i; negative
        indices count from the end as in transformers' ``hidden_states`` tuple)."""
        n = len(self.encoder.layers)
        idx = [i % (n + 1) for i in wanted]
        x = self.embeddings(pixels)
        if self.config.has_cls_token:
            x = self.pre_layrnorm(x)
        states = {0: x}
        for i, layer in enumerate(self.encoder.layers[: max(idx)], start=1):
            x = layer(x)
            states[i] = x
        return [states[i] for i in idx]


class VisionTower(nn.Module):
    """Holds ``vision_model`` so parameter names match ``vision_tower.vision_model.*``."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.vision_model = VisionTransformer(c)


class MultiModalProjector(nn.Module):
    """LLaVA projector: ``linear_2(act(linear_1(features)))``."""

    def __init__(self, c: VisionConfig, text_hidden: int):
        super().__init__()
        n_layers = 1 if isinstance(c.feature_layer, int) else len(c.feature_layer)
        self.linear_1 = nn.Linear(c.hidden_size * n_layers, text_hidden, bias=c.projector_bias)
        self.act = activation(c.projector_act)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=c.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def select_image_features(tower: VisionTower, pixels: torch.Tensor) -> torch.Tensor:
    """LLaVA's feature selection: chosen layer(s), CLS dropped for the "default" strategy."""
    c = tower.vision_model.config
    layers = [c.feature_layer] if isinstance(c.feature_layer, int) else list(c.feature_layer)
    states = tower.vision_model.hidden_states(pixels, layers)
    if c.select_strategy == "default":  # transformers drops token 0 even without a CLS token
        states = [s[:, 1:] for s in states]
    return torch.cat(states, dim=-1)
