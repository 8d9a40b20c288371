"""Configuration of the kvstore service (``STRATA_*`` env vars or ``--flags``)."""

from __future__ import annotations

from pydantic import Field

from shared.config import ServiceConfig


class KVStoreConfig(ServiceConfig):
    """One kvstore instance: a DRAM tier, optionally backed by a MinIO bucket."""

    dram_bytes: int = Field(1 << 30, gt=0, description="DRAM tier budget in bytes")
    spill_buffer_bytes: int = Field(
        0,
        ge=0,
        description="Max bytes of evicted blocks held while MinIO is slow or down "
        "(0 = same as dram_bytes); beyond it the oldest are dropped",
    )
    minio_endpoint: str = Field("", description="MinIO host:port of the SSD tier ('' = DRAM only)")
    minio_access_key: str = Field("strata", description="MinIO access key")
    minio_secret_key: str = Field("strata-secret-key", description="MinIO secret key")
    minio_bucket: str = Field(
        "strata-kv", description="Bucket of block objects (created if missing)"
    )
    minio_secure: bool = Field(False, description="Use HTTPS to reach MinIO")
    minio_timeout: float = Field(5.0, gt=0, description="Seconds before a MinIO call is failed")
    spill_concurrency: int = Field(8, ge=1, le=256, description="MinIO writes in flight")
    retry_interval: float = Field(1.0, gt=0, description="Seconds between spill retries when down")
    grpc_host: str = Field("127.0.0.1", description="Address the gRPC server binds and advertises")
    grpc_port: int = Field(0, ge=0, le=65535, description="gRPC port (0 = pick a free port)")
    load_interval: float = Field(0.5, gt=0, description="Seconds between load reports")
