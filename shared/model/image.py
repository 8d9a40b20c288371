"""Image preprocessing for LLaVA-style checkpoints, following the checkpoint's image processor.

The settings come from ``processor_config.json`` (its nested ``"image_processor"``, as
transformers 5 writes) or ``preprocessor_config.json`` (older layout), in transformers' order.

Matches transformers' PIL-backend image processors: optional RGB conversion, resize with PIL
(CLIP: shortest edge to ``size.shortest_edge`` keeping aspect ratio; SigLIP: to
``size.height x size.width``), center crop, rescale (``x * rescale_factor`` in float64 then
float32) and per-channel normalisation.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

from shared.model.errors import CheckpointError

if TYPE_CHECKING:
    import torch

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def image_content_hash(raw_bytes: bytes) -> str:
    """sha256 hex of the encoded image bytes (part of a multimodal KV block's identity)."""
    return hashlib.sha256(raw_bytes).hexdigest()


def expand_image_placeholders(
    token_ids: list[int], image_token_id: int, num_image_tokens: int
) -> tuple[list[int], list[tuple[int, int]]]:
    """Repeat each image placeholder ``num_image_tokens`` times.

    Returns the expanded ids and one ``(offset, length)`` span per image, in order.
    """
    out: list[int] = []
    spans: list[tuple[int, int]] = []
    for t in token_ids:
        if t == image_token_id:
            spans.append((len(out), num_image_tokens))
            out.extend([image_token_id] * num_image_tokens)
        else:
            out.append(t)
    return out, spans


@dataclass(frozen=True)
class ImageProcessor:
    """Preprocessing settings of a checkpoint's image processor (see `image_processor_dict`)."""

    resize_shortest_edge: int | None  # CLIP style: scale so the short side has this length
    resize_hw: tuple[int, int] | None  # SigLIP style: resize to exactly (height, width)
    crop_hw: tuple[int, int] | None  # center crop size, None when do_center_crop is false
    resample: int  # PIL resampling filter id (3 = bicubic)
    rescale_factor: float | None  # None when do_rescale is false
    mean: tuple[float, ...] | None  # None when do_normalize is false
    std: tuple[float, ...] | None
    convert_rgb: bool

    @classmethod
    def from_dict(cls, cfg: dict) -> ImageProcessor:
        size = cfg.get("size", {"shortest_edge": 224})
        if isinstance(size, int):
            size = {"shortest_edge": size}
        shortest = size.get("shortest_edge")
        hw = (size["height"], size["width"]) if "height" in size else None
        crop = cfg.get("crop_size", {"height": 224, "width": 224})
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        do_resize = cfg.get("do_resize", True)
        return cls(
            resize_shortest_edge=shortest if do_resize else None,
            resize_hw=hw if do_resize else None,
            crop_hw=(crop["height"], crop["width"]) if cfg.get("do_center_crop", False) else None,
            resample=int(cfg.get("resample", 3)),
            rescale_factor=cfg.get("rescale_factor", 1 / 255)
            if cfg.get("do_rescale", True)
            else None,
            mean=tuple(cfg.get("image_mean", _CLIP_MEAN))
            if cfg.get("do_normalize", True)
            else None,
            std=tuple(cfg.get("image_std", _CLIP_STD)) if cfg.get("do_normalize", True) else None,
            convert_rgb=bool(cfg.get("do_convert_rgb", True)),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ImageProcessor:
        """Settings of the checkpoint in ``path``; `CheckpointError` when it has none."""
        return cls.from_dict(image_processor_dict(path))

    def _resize(self, img: Image.Image) -> Image.Image:
        w, h = img.size
        if self.resize_hw is not None:
            return img.resize(
                (self.resize_hw[1], self.resize_hw[0]), self.resample, reducing_gap=None
            )
        if self.resize_shortest_edge is not None:
            s = self.resize_shortest_edge
            short, long = (w, h) if w <= h else (h, w)
            new_short, new_long = s, int(s * long / short)
            size = (new_short, new_long) if w <= h else (new_long, new_short)
            return img.resize(size, self.resample, reducing_gap=None)
        return img

    def _one(self, img: Image.Image) -> np.ndarray:
        if self.convert_rgb:
            img = img.convert("RGB")
        img = self._resize(img)
        x = np.asarray(img)
        if self.crop_hw is not None:
            ch, cw = self.crop_hw
            top, left = (x.shape[0] - ch) // 2, (x.shape[1] - cw) // 2
            x = x[max(top, 0) : max(top, 0) + ch, max(left, 0) : max(left, 0) + cw]
        x = x.astype(np.float32)
        if self.rescale_factor is not None:
            x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.mean is not None:
            x = (x - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
        return x.transpose(2, 0, 1)

    def preprocess(self, images: list[Image.Image]) -> torch.Tensor:
        """PIL images -> float32 pixel values ``[N, 3, H, W]``."""
        import torch  # here: the tokenizer imports this module for placeholders, runs no model

        return torch.from_numpy(np.stack([self._one(im) for im in images]))


def _read_json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: invalid JSON ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object")
    return data


def image_processor_dict(path: str | Path) -> dict:
    """The image processor settings of a checkpoint directory, in transformers' order: the
    ``"image_processor"`` nested in ``processor_config.json`` (what ``save_pretrained`` of a
    transformers 5 processor writes), else ``preprocessor_config.json``."""
    path = Path(path)
    processor = path / "processor_config.json"
    if processor.is_file():
        nested = _read_json(processor).get("image_processor")
        if isinstance(nested, dict):
            return nested
    legacy = path / "preprocessor_config.json"
    if legacy.is_file():
        return _read_json(legacy)
    raise CheckpointError(
        f"{path}: no image processor settings (neither processor_config.json "
        "with an 'image_processor' entry nor preprocessor_config.json)"
    )
