"""Configuration of a model instance (prefill or decode)."""

from __future__ import annotations

from pydantic import Field

from shared.config import ModelServiceConfig


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
    layerwise_transfer: bool = Field(True, description="Push KV layer by layer while computing")
    kvstore_addrs: str = Field("", description="Comma-separated kvstore gRPC addresses (pool mode)")
    kv_int8: bool = Field(
        False, description="Send and store KV as int8 with per-row float32 scales (~3.8x fewer bytes)"
    )

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
            async_scheduling=None if self.async_scheduling == "auto" else self.async_scheduling == "true",
        )
