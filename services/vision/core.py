"""Pure vision core: decode images, run the vision tower + projector, cache by content hash.

No NATS, no gRPC here. `VisionCore.encode` returns the bus reply; `VisionCore.get` hands the
cached embedding of one image hash to the gRPC handler (`services.vision.grpc`).
"""

from __future__ import annotations

import io
import threading
import time
from collections import OrderedDict
from pathlib import Path

import torch
from PIL import Image
from prometheus_client import Counter

from shared import metrics
from shared.model.config import parse_dtype
from shared.model.errors import CheckpointError
from shared.model.image import ImageProcessor, image_content_hash
from shared.model.loader import load_model
from shared.protocol.errors import StrataError
from shared.protocol.vision import ImageInfo, VisionEncodeReply, VisionEncodeRequest

CACHE_EVENTS = Counter("strata_vision_cache_total", "Vision embedding cache lookups", ["result"])
ENCODE_SECONDS = metrics.latency_histogram(
    "strata_vision_encode_seconds", "Vision tower time per request (cache misses only)"
)
IMAGES_ENCODED = Counter("strata_vision_images_encoded_total", "Images run through the tower")


class EmbeddingCache:
    """LRU of ``image hash -> [num_tokens, hidden]`` embeddings bounded by bytes."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._d: OrderedDict[str, torch.Tensor] = OrderedDict()

    def get(self, key: str) -> torch.Tensor | None:
        t = self._d.get(key)
        if t is not None:
            self._d.move_to_end(key)
        return t

    def put(self, key: str, t: torch.Tensor) -> None:
        if key in self._d:
            self._d.move_to_end(key)
            return
        size = t.numel() * t.element_size()
        self._d[key] = t
        self.bytes += size
        while self.bytes > self.max_bytes and len(self._d) > 1:
            _, old = self._d.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()

    def __len__(self) -> int:
        return len(self._d)


def decode_image(raw: bytes, max_pixels: int) -> Image.Image:
    """Bytes -> RGB-able PIL image; refuses undecodable data and decompression bombs."""
    try:
        img = Image.open(io.BytesIO(raw))
        w, h = img.size  # header only: checked before any pixel is decoded
        if w * h > max_pixels:
            raise StrataError("bad_request", f"image is {w}x{h}; at most {max_pixels} pixels")
        img.load()
    except StrataError:
        raise
    except Exception as exc:  # PIL raises many types (incl. DecompressionBombError)
        raise StrataError("bad_request", f"cannot decode image: {exc}") from None
    return img


class VisionCore:
    """One LLaVA checkpoint's image encoder with an embedding cache."""

    def __init__(
        self,
        model_dir: str | Path,
        device: str = "cpu",
        dtype: str = "",
        cache_bytes: int = 256 << 20,
        max_pixels: int = 4096 * 4096,
    ):
        torch_dtype = parse_dtype(dtype) if dtype else None
        self.loaded = load_model(model_dir, dtype=torch_dtype, device=device)
        if not self.loaded.config.is_multimodal:
            raise CheckpointError(f"{model_dir}: not a multimodal checkpoint (no vision tower)")
        self.processor = ImageProcessor.from_dir(model_dir)
        self.cache = EmbeddingCache(cache_bytes)
        self.max_pixels = max_pixels
        self.num_tokens = self.loaded.config.num_image_tokens
        self._lock = threading.Lock()  # one tower forward at a time; the cache is shared

    @property
    def fingerprint(self) -> str:
        return self.loaded.fingerprint

    def encode(
        self, req: VisionEncodeRequest, instance_id: str = "", source_addr: str = ""
    ) -> VisionEncodeReply:
        """Encode the images the cache lacks (one batched forward); reply with their hashes."""
        started = time.time()
        hashes = [image_content_hash(raw) for raw in req.images]
        images = [decode_image(raw, self.max_pixels) for raw in req.images]
        with self._lock:
            missing = {
                h: img for h, img in zip(hashes, images, strict=True) if self.cache.get(h) is None
            }
            hits = len(set(hashes)) - len(missing)
            CACHE_EVENTS.labels("hit").inc(hits)
            CACHE_EVENTS.labels("miss").inc(len(missing))
            if missing:
                t0 = time.perf_counter()
                pixels = self.processor.preprocess(list(missing.values()))
                embeds = self.loaded.model.encode_images(pixels).cpu()
                ENCODE_SECONDS.observe(time.perf_counter() - t0)
                IMAGES_ENCODED.inc(len(missing))
                for h, e in zip(missing, embeds, strict=True):
                    self.cache.put(h, e.clone())
        infos = [
            ImageInfo(hash=h, num_tokens=self.num_tokens, width=img.size[0], height=img.size[1])
            for h, img in zip(hashes, images, strict=True)
        ]
        return VisionEncodeReply(
            images=infos,
            instance_id=instance_id,
            source_addr=source_addr,
            cache_hits=hits,
            started_at=started,
            finished_at=time.time(),
        )

    def get(self, key: str) -> torch.Tensor | None:
        with self._lock:
            return self.cache.get(key)
