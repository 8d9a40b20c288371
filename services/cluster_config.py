"""What a local cluster is made of: its roles, its settings (`ClusterConfig`, from which
`strata up`'s flags are derived) and the checkpoint it serves (`ensure_model`: the user's
directory, validated, or the built-in default model). `services.launcher.Cluster` starts it.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from services.infra.procs import cache_dir
from shared.model.validate import text_only_reason, validate_checkpoint

ROLES = ("scheduler", "tokenizer", "vision", "kvstore", "prefill", "decode", "gateway")
"""Every role `strata serve` knows, in start-up order."""
MODEL_ROLES = ("vision", "prefill", "decode")
"""Roles that load model weights (they get ``STRATA_TORCH_THREADS``)."""
DTYPE_ROLES = ("tokenizer", *MODEL_ROLES)
"""Roles that read ``STRATA_DTYPE``: the model processes, and the tokenizer, whose block hashes
carry the model fingerprint (dtype included) that the engines' prefix blocks are keyed by."""
REQUIRED_ROLES = ("scheduler", "tokenizer", "decode", "gateway", "nats")
"""Roles without which nothing is served (`restart`: giving up on the last one is fatal)."""


class ClusterConfig(BaseModel):
    """Settings of a local cluster; `strata up`'s flags are derived from these fields
    (`services.cli.up_parser`: ``foo_bar`` -> ``--foo-bar``, help = the description)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field("", description="Checkpoint directory (default: the built-in model)")
    host: str = Field("127.0.0.1", description="Address every service binds")
    port: int = Field(0, ge=0, le=65535, description="Gateway HTTP port (0 = a free port)")
    nats_port: int = Field(0, ge=0, le=65535, description="nats-server port (0 = a free port)")
    nats_monitor_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="nats-server's HTTP monitoring port on --host (/varz, /jsz, /connz; 0 = off)",
    )
    minio_port: int = Field(0, ge=0, le=65535, description="MinIO port (0 = a free port)")
    minio: bool = Field(
        True, description="MinIO, the SSD tier of the KV pool (off: the pool stays in DRAM)"
    )
    data_dir: str = Field(
        "",
        description="NATS/MinIO data and service logs (Cluster(): '' = a temp dir, removed "
        "by stop())",
    )
    scheduler: int = Field(1, ge=1, le=16, description="Scheduler replicas")
    tokenizer: int = Field(1, ge=1, le=64, description="Tokenizer replicas (queue group)")
    vision: int = Field(1, ge=0, le=64, description="Vision encoder replicas (0 = text only)")
    kvstore: int = Field(1, ge=0, le=64, description="kvstore instances (0 = no KV pool)")
    prefill: int | None = Field(
        None,
        ge=0,
        le=64,
        description="Prefill instances (0 = decode prefills; unset = from the machine: "
        "0 below 8 cores, else 1, see services.shape)",
    )
    decode: int = Field(1, ge=1, le=64, description="Decode instances")
    dp: int = Field(
        1,
        ge=1,
        le=64,
        description="Data parallelism: N replicas of the model, as N times the prefill and "
        "decode instances (each its own instance, on its share of the cores), routed by the "
        "scheduler's prefix_aware policy (prefix and load) unless a --policy is given; composes "
        "with --tp (N groups of --tp ranks)",
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        le=256,
        description="torch threads per prefill/decode process (unset = its share of the "
        "cores, from the shape)",
    )
    tp: int = Field(
        1,
        ge=1,
        le=64,
        description="Tensor-parallel ranks per prefill/decode instance (each instance's process "
        "is rank 0 and starts the others; its torch threads are split among them; on CUDA one "
        "GPU per rank)",
    )
    ep: int = Field(
        1,
        ge=1,
        le=64,
        description="Expert-parallel ranks per prefill/decode instance of a MoE checkpoint "
        "(started like --tp's; experts split in contiguous blocks, attention replicated, or split "
        "by --tp when it equals --ep)",
    )
    device: str = Field("cpu", description="torch device of model processes: cpu or cuda[:N]")
    dtype: Literal["", "float32", "bfloat16", "float16"] = Field(
        "",
        description="Weights, activations and KV of the model processes: float32 | bfloat16 | "
        "float16 (default: the checkpoint's)",
    )
    log_level: str = Field("INFO", description="Log level of every service")
    metrics_port_base: int = Field(
        0, ge=0, le=65000, description="First Prometheus port, +1 per process (0 = free)"
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="Extra env for every service (repeatable flag)"
    )
    role_args: dict[str, list[str]] = Field(
        default_factory=dict, description="Extra `strata serve` flags per role"
    )
    ready_timeout: float = Field(300.0, gt=0, description="Seconds to wait for readiness")
    stop_timeout: float = Field(10.0, gt=0, description="Seconds between SIGTERM and SIGKILL")
    die_with_parent: bool = Field(False, description="Children die if the launcher is killed")
    fork_model_processes: bool = Field(
        True,
        description="Start the model processes (prefill, decode, vision) by forking a server "
        "that imported torch once (services.infra.zygote) instead of a fresh interpreter each",
    )
    autoscale_max_decode: int = Field(
        0,
        ge=0,
        le=64,
        description="Autoscaling: the most decode instances; above --decode, the scheduler "
        "sizes the decode fleet from its load (SLO targets) and the launcher starts instances "
        "up to that need, while the scheduler drains and retires those beyond it, down to "
        "--decode (0 = a fixed fleet; services/scheduler/autoscale.py)",
    )
    restart: bool = Field(
        False,
        description="Restart crashed services, nats-server and MinIO "
        "with backoff (services.infra.restart)",
    )
    restart_backoff: float = Field(
        0.5,
        gt=0,
        le=30,
        description="With restart: seconds before a crashed process is started again; the "
        "wait doubles per crash in a row, up to 30 s",
    )
    launcher_metrics_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="With restart: port of strata_launcher_restarts_total (0 = a free port)",
    )
    nats_auth: bool = Field(
        True,
        description="Per-role NATS users and permissions (anonymous "
        "clients refused); credentials in <data-dir>/nats/credentials",
    )
    kv_tls: bool = Field(
        True,
        description="Mutual TLS on every gRPC channel of the KV plane (prefill, decode, "
        "kvstore, vision), with a CA and per-service certificates made in <data-dir>/pki",
    )
    rotate_certs: bool = Field(
        False, description="With kv_tls: issue new service certificates (same CA) at start"
    )
    rotate_ca: bool = Field(
        False, description="With kv_tls: make a new CA and re-issue every service certificate"
    )
    nats_tls_cert: str = Field("", description="nats-server TLS certificate ('' = no TLS)")
    nats_tls_key: str = Field("", description="nats-server TLS key")
    nats_tls_ca: str = Field("", description="CA of the server certificate, given to clients")
    nats_tls_verify: bool = Field(
        False,
        description="Clients must present a certificate signed by the nats_tls_ca CA "
        "(give services theirs with STRATA_NATS_TLS_CERT/KEY)",
    )
    tls_cert: str = Field("", description="Gateway HTTPS certificate, PEM ('' = plain HTTP)")
    tls_key: str = Field("", description="Private key of tls_cert, PEM")
    nats_url: str = Field(
        "",
        description="Join this running NATS (a URL, or a comma-separated seed list of a NATS "
        "cluster) instead of starting nats-server",
    )
    nats_credentials: str = Field(
        "",
        description="With nats_url: the directory of the joined NATS's <user>.password files "
        "(<data-dir>/nats/credentials of the cluster that owns it; not needed with nats_auth off)",
    )
    minio_endpoint: str = Field(
        "",
        description="Join this running MinIO (host:port, or a comma-separated list of one "
        "distributed MinIO's nodes) as the SSD tier instead of starting one",
    )
    minio_credentials: str = Field(
        "",
        description="With minio_endpoint: the owning cluster's <data-dir>/minio.credentials.json",
    )
    instance_prefix: str = Field(
        "",
        pattern=r"^[A-Za-z0-9_.-]*$",
        description="Prefix of every instance id, which must be unique among the clusters "
        "sharing a NATS ('' = none; when joining a NATS: '<hostname>-<4 hex>-')",
    )
    color: bool | None = Field(
        None,
        description="Colored [name] log prefixes (unset: on a terminal; NO_COLOR / "
        "FORCE_COLOR also work)",
    )


def check_autoscale(cfg: ClusterConfig) -> None:
    """RuntimeError (one line) for an autoscaling bound below the fleet it starts with."""
    if cfg.autoscale_max_decode and cfg.autoscale_max_decode < cfg.decode:
        raise RuntimeError(
            f"--autoscale-max-decode {cfg.autoscale_max_decode} is below --decode {cfg.decode} "
            "(the decode instances it starts with, and the fewest it keeps)"
        )


def default_model_dir() -> str:
    return os.path.join(cache_dir(), "models", "default")


def ensure_model(path: str = "", benchmark: bool = False) -> str:
    """The checkpoint to serve: ``path`` as given, else the default model (built once)."""
    if path:
        validate_checkpoint(path)  # CheckpointError: one line naming file, problem and fix
        return os.path.abspath(path)
    try:
        from shared.model import default_model
    except ImportError as exc:
        raise RuntimeError(f"cannot build the default model ({exc}); pass --model DIR") from exc
    out = os.path.join(cache_dir(), "models", "benchmark" if benchmark else "default")
    build = default_model.build_benchmark_model if benchmark else default_model.build_default_model
    return os.path.abspath(str(build(out)))


def vision_replicas(model_dir: str, requested: int) -> tuple[int, str]:
    """Vision replicas to start for the checkpoint in ``model_dir``, and why (one line) when
    that is not ``requested``: a checkpoint without a vision tower gets none."""
    if requested == 0:
        return 0, ""
    why = text_only_reason(model_dir)
    if why is None:
        return requested, ""
    return 0, f"vision role off: {why}; requests with images get a 400"
