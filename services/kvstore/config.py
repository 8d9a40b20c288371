"""Configuration of the kvstore service (``STRATA_*`` env vars or ``--flags``)."""

from __future__ import annotations

from pydantic import Field, ValidationInfo, field_validator

from shared.config import KVEventStreamConfig


class KVStoreConfig(KVEventStreamConfig):
    """One kvstore instance: a DRAM tier, optionally backed by a MinIO bucket."""

    dram_bytes: int = Field(1 << 30, gt=0, description="DRAM tier budget in bytes")
    spill_buffer_bytes: int = Field(
        0,
        ge=0,
        description="Max bytes of evicted blocks held while MinIO is slow or down "
        "(0 = same as dram_bytes); beyond it the oldest are dropped",
    )
    minio_endpoint: list[str] = Field(
        [],
        description="MinIO host:port of the SSD tier, or a "
        "comma-separated list of one distributed MinIO's nodes ('' = DRAM only)",
    )
    minio_access_key: str = Field(
        "", description="MinIO access key (`strata up`: a user limited to the KV bucket)"
    )
    minio_secret_key: str = Field(
        "", validate_default=True, description="MinIO secret key (no default credentials)"
    )
    minio_bucket: str = Field(
        "strata-kv", description="Bucket of block objects (created if missing)"
    )
    ssd_bytes: int = Field(
        64 << 30,
        ge=0,
        description="SSD tier budget: bytes of the block objects this instance wrote or "
        "listed; beyond it the least recently used objects are deleted (0 = unbounded)",
    )
    minio_secure: bool = Field(False, description="Use HTTPS to reach MinIO")
    minio_timeout: float = Field(5.0, gt=0, description="Seconds before a MinIO call is failed")
    spill_concurrency: int = Field(8, ge=1, le=256, description="MinIO writes in flight")
    retry_interval: float = Field(1.0, gt=0, description="Seconds between spill retries when down")
    write_behind: bool = Field(
        True,
        description="Also write every block committed to DRAM to MinIO in the background, so a "
        "restart keeps the pool and evicting it needs no spill",
    )
    write_behind_blocks: int = Field(
        65536,
        ge=1,
        description="Bound of the write-behind queue in blocks (beyond it the oldest queued "
        "blocks are skipped; they still spill when evicted)",
    )
    chunk_bytes: int = Field(
        4 << 20,
        ge=0,
        description="Max bytes of a chunk object batching small blocks (0 = one object per block)",
    )
    chunk_block_max_bytes: int = Field(
        1 << 20, ge=1, description="Blocks of at least this size get their own object"
    )
    write_linger: float = Field(
        0.02, ge=0, description="Seconds to gather blocks into one chunk before writing it"
    )
    refresh_interval: float = Field(
        1.0,
        ge=0,
        description="Min seconds between bucket listings of one model on a miss (blocks written "
        "by other instances or before a restart)",
    )
    negative_ttl: float = Field(
        1.0, ge=0, description="Seconds a block still missing after a listing is not looked for"
    )
    flush_timeout: float = Field(
        5.0, ge=0, description="Seconds a graceful stop waits for SSD writes and events"
    )
    grpc_host: str = Field("127.0.0.1", description="Address the gRPC server binds and advertises")
    grpc_port: int = Field(0, ge=0, le=65535, description="gRPC port (0 = pick a free port)")
    load_interval: float = Field(0.5, gt=0, description="Seconds between load reports")

    @field_validator("minio_secret_key")
    @classmethod
    def _credentials_with_endpoint(cls, v: str, info: ValidationInfo) -> str:
        if info.data.get("minio_endpoint") and not (v and info.data.get("minio_access_key")):
            raise ValueError(
                "STRATA_MINIO_ENDPOINT needs STRATA_MINIO_ACCESS_KEY and "
                "STRATA_MINIO_SECRET_KEY (MinIO has no default credentials)"
            )
        return v
