"""`Cluster`'s checks before any process starts (`strata up`'s start-up errors): ports, TLS
files, the checkpoint, a joined NATS or MinIO, the MinIO binary. Each failure is one line."""

from __future__ import annotations

import os

from services.cluster_config import ROLES, ClusterConfig, check_autoscale, ensure_model
from services.infra.gateway_tls import check_pair
from services.infra.joined import JoinedMinio, JoinedNats
from services.infra.minio_server import minio_binary
from services.infra.procs import port_open
from shared.config import RuntimeSettings, comma_list


def preflight(cfg: ClusterConfig, port: int) -> tuple[str, JoinedNats | None, JoinedMinio | None]:
    """What can fail before any process starts, checked in well under a second: ports, the
    checkpoint (`validate_checkpoint`), the MinIO binary. Returns the checkpoint directory and
    the joined NATS and MinIO (None: the cluster starts its own, or has no MinIO). Raises
    one-line errors (RuntimeError, CheckpointError)."""
    check_autoscale(cfg)
    if port_open(cfg.host, port):
        raise RuntimeError(f"gateway port {port} is already in use (pass --port)")
    check_pair(cfg.tls_cert, cfg.tls_key)
    joined_minio = bool(cfg.minio and cfg.minio_endpoint)
    for what, p, flag, zero in (
        ("nats-server", 0 if cfg.nats_url else cfg.nats_port, "--nats-port", "any"),
        (
            "nats-server monitoring",
            0 if cfg.nats_url else cfg.nats_monitor_port,
            "--nats-monitor-port",
            "none",
        ),
        (
            "MinIO",
            cfg.minio_port if cfg.minio and not joined_minio else 0,
            "--minio-port",
            "any",
        ),
    ):
        if p and port_open(cfg.host, p):
            raise RuntimeError(
                f"{what} port {p} is already in use (pass {flag} with a free port, or 0 for {zero})"
            )
    model_dir = ensure_model(cfg.model)
    nats = minio = None
    try:
        if cfg.nats_url:
            nats = JoinedNats(
                comma_list(cfg.nats_url),
                cred_dir=cfg.nats_credentials if cfg.nats_auth else "",
                tls_ca=cfg.nats_tls_ca,
            )
            if cfg.nats_auth and not cfg.nats_credentials:
                raise RuntimeError(
                    "--nats-url needs --nats-credentials DIR (the joined cluster's "
                    "<data-dir>/nats/credentials), or --no-nats-auth if its NATS has no users"
                )
            nats.check(ROLES)
        if joined_minio:
            minio = JoinedMinio(comma_list(cfg.minio_endpoint), cfg.minio_credentials)
            minio.check()
    except ValueError as exc:
        raise RuntimeError(f"--nats-url / --minio-endpoint: {exc}") from None
    if cfg.minio and not joined_minio:
        given = RuntimeSettings.from_env().minio_bin
        if given and not os.path.isfile(given):
            raise RuntimeError(
                f"STRATA_MINIO_BIN={given}: no such file (fix the path, or "
                "pass --no-minio: the KV pool then stays in DRAM)"
            )
        try:
            minio_binary(build=False)
        except RuntimeError as exc:
            raise RuntimeError(
                f"{exc}; or pass --no-minio (the KV pool then stays in DRAM)"
            ) from None
    return model_dir, nats, minio
