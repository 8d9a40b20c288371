"""The secrets of compose/docker-compose.yml, generated once into its env file (0600).

`write_env_file` keeps every value already in the file and adds what is missing: the NATS
password of each role (`services.infra.nats_auth.write_env_file`), the password NATS cluster
routes authenticate with, the MinIO root password, the kvstore's MinIO password (its user may
only use the KV bucket: `provision_from_env` creates it in the ``minio-setup`` container) and
the gateway's API key. Nothing secret is in the compose file itself; docs/security.md says how
to rotate each one.
"""

from __future__ import annotations

import os
import secrets

from services.infra import nats_auth
from services.infra.minio_server import KV_BUCKET, MinioCredentials, provision_kv_user

SECRET_VARS = {
    "STRATA_API_KEY": "the gateway's API key (Authorization: Bearer <key>)",
    "STRATA_NATS_ROUTE_PASSWORD": "NATS cluster routes (user 'route') between the nodes",
    "STRATA_MINIO_ROOT_PASSWORD": "MinIO's root account (only minio-setup uses it)",
    "STRATA_MINIO_KV_PASSWORD": "the kvstore's MinIO user, limited to the KV bucket",
}
ROUTE_USER = "route"
MINIO_ROOT_USER = "strata-root"


def read_env(path: str) -> dict[str, str]:
    out: dict[str, str] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                key, sep, value = line.strip().partition("=")
                if sep and not key.startswith("#"):
                    out[key] = value
    return out


def write_env_file(path: str) -> dict[str, str]:
    """Every compose secret in ``path`` (mode 0600), new ones random, existing ones kept."""
    nats_auth.write_env_file(path)
    env = read_env(path)
    for var in SECRET_VARS:
        if not env.get(var):
            env[var] = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("".join(f"{k}={v}\n" for k, v in env.items()))
    os.chmod(path, 0o600)
    return env


class SetupError(RuntimeError):
    """minio-setup cannot run: one line naming the missing setting."""


def provision_from_env() -> str:
    """In the ``minio-setup`` container: with the root account (``MINIO_ROOT_USER`` /
    ``MINIO_ROOT_PASSWORD``, as the MinIO containers get it), create the KV bucket and the
    kvstore's user (its settings ``STRATA_MINIO_ACCESS_KEY`` / ``STRATA_MINIO_SECRET_KEY``,
    ``STRATA_MINIO_ENDPOINT``, ``STRATA_MINIO_BUCKET``) holding only the bucket's policy.
    Returns the user name."""
    from services.kvstore.config import KVStoreConfig

    cfg = KVStoreConfig.load([], role="minio-setup")
    root_user = os.environ.get("MINIO_ROOT_USER", "")
    root_password = os.environ.get("MINIO_ROOT_PASSWORD", "")
    given = {
        "STRATA_MINIO_ENDPOINT": bool(cfg.minio_endpoint),
        "MINIO_ROOT_USER": bool(root_user),
        "MINIO_ROOT_PASSWORD": bool(root_password),
        "STRATA_MINIO_ACCESS_KEY": bool(cfg.minio_access_key),
        "STRATA_MINIO_SECRET_KEY": bool(cfg.minio_secret_key),
    }
    missing = [name for name, ok in given.items() if not ok]
    if missing:
        raise SetupError(f"minio-setup needs {', '.join(missing)}")
    creds = MinioCredentials(
        root_user=root_user,
        root_password=root_password,
        kv_user=cfg.minio_access_key,
        kv_password=cfg.minio_secret_key,
    )
    if creds.kv_user == creds.root_user:
        raise SetupError("the kvstore's MinIO user must not be the root user")
    provision_kv_user(cfg.minio_endpoint[0], creds, cfg.minio_bucket or KV_BUCKET, timeout=120.0)
    return creds.kv_user
