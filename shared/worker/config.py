"""Configuration of a model instance (prefill or decode)."""

from __future__ import annotations

import os

from pydantic import Field, ValidationInfo, field_validator

from shared.config import ModelServiceConfig

LAYERWISE_SPARE_CORES = 2
"""Cores beyond its torch threads a CPU prefill process needs for `auto` layer-wise transfer."""


def layerwise_auto(device: str, torch_threads: int, cores: int) -> bool:
    """What ``layerwise_transfer=auto`` means on ``device`` for a process with ``torch_threads``
    that may run on ``cores`` cores. On CUDA the per-layer copy is a small gather on the device
    and the host work (device-to-host transfer, frame encoding, gRPC sends) runs on CPU cores
    while the GPU computes: on. On CPU the copies, the encoding and the sends compete with the
    forward for the same cores (measured on a quiet 2-core box: layer-wise gave a higher TTFT
    at every length, docs/benchmarks/pd.md), so: on only when ``LAYERWISE_SPARE_CORES`` cores
    are left beside the torch threads (a pinned `strata up` model process has none)."""
    if device.startswith("cuda"):
        return True
    return cores - torch_threads >= LAYERWISE_SPARE_CORES


_BOOL_WORDS = {"true", "false", "1", "0", "yes", "no", "on", "off"}


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class WorkerConfig(ModelServiceConfig):
    """A prefill or decode instance: the model, its engine and its KV transfer settings."""

    kv_cache_bytes: int = Field(256 << 20, gt=0, description="Engine KV pool byte budget")
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV block (cluster-wide)")
    max_num_seqs: int = Field(64, ge=1, description="Most sequences in a running batch")
    max_num_batched_tokens: int = Field(2048, ge=16, description="Per-step token budget")
    enable_chunked_prefill: bool = Field(True, description="Split long prompts across steps")
    enable_prefix_caching: bool = Field(True, description="Reuse cached prefix blocks")
    num_speculative_tokens: int = Field(0, ge=0, le=16, description="n-gram draft tokens (0 = off)")
    quantization: str = Field("", description="Weight quantization: '' or 'int8'")
    async_scheduling: str = Field(
        "auto",
        pattern="^(auto|true|false)$",
        description="Prepare the next decode step during the forward: auto = on for CUDA only",
    )
    transfer_timeout: float = Field(30.0, gt=0, description="Seconds to wait for a KV transfer")
    frame_merge_bytes: int = Field(
        256 << 10, ge=0, description="Merge layer frames below this size into one (direct mode)"
    )
    layerwise_transfer: bool = Field(
        "auto",  # type: ignore[assignment] - resolved to a bool by the validator below
        validate_default=True,
        description="Push KV layer by layer while computing (direct mode): true, false or auto = "
        "on for CUDA, on CPU only with spare cores (see layerwise_auto)",
    )
    kvstore_addrs: str = Field("", description="Comma-separated kvstore gRPC addresses (pool mode)")
    kv_int8: bool = Field(
        False,
        description="Send and store KV as int8 with per-row float32 scales (~3.8x fewer bytes)",
    )

    @field_validator("layerwise_transfer", mode="before")
    @classmethod
    def _resolve_layerwise(cls, v, info: ValidationInfo):
        if not isinstance(v, str):
            return v
        word = v.strip().lower()
        if word == "auto":
            d = info.data
            return layerwise_auto(d.get("device", "cpu"), d.get("torch_threads", 1), usable_cores())
        if word not in _BOOL_WORDS:
            raise ValueError("expected auto, true or false")
        return word

    def engine_config(self):
        from shared.engine.params import EngineConfig

        return EngineConfig(
            kv_cache_bytes=self.kv_cache_bytes,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=self.enable_chunked_prefill,
            enable_prefix_caching=self.enable_prefix_caching,
            num_speculative_tokens=self.num_speculative_tokens,
            quantization=self.quantization or None,
            device=self.device,
            dtype=self.dtype or None,
            collect_evicted_kv=bool(self.kvstore_addrs.strip()),
            async_scheduling=None
            if self.async_scheduling == "auto"
            else self.async_scheduling == "true",
        )
