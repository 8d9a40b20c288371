"""A running NATS and MinIO that `strata up` joins instead of starting its own.

`JoinedNats` and `JoinedMinio` answer what the launcher asks of `NatsServer` / `MinioServer`
(URLs, client credentials, the kvstore's MinIO user) but start, stop and supervise nothing: the
servers belong to whoever started them, on this host or another. Credentials come from what that
cluster wrote: the NATS users' ``<user>.password`` files (``<data-dir>/nats/credentials/`` of the
`strata up` that owns the server, copied to this host) and the MinIO credentials JSON
(``<data-dir>/minio.credentials.json``). `check` fails in well under a second with one line
naming what is wrong: an unreachable server, a missing credentials file.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from services.infra import nats_auth
from services.infra.minio_server import KVUser, MinioCredentials
from shared.nats_auth import NatsAuth


def _reachable(host: str, port: int, timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


@dataclass
class JoinedNats:
    """The NATS server(s) at ``urls``; per-role passwords from ``cred_dir`` ('' = no users)."""

    urls: list[str]
    cred_dir: str = ""
    tls_ca: str = ""
    proc: None = None  # nothing of ours to supervise

    @property
    def url(self) -> str:
        return ",".join(self.urls)

    @property
    def auth(self) -> bool:
        return bool(self.cred_dir)

    def client_auth(self, user: str) -> NatsAuth:
        password = ""
        if self.auth:
            with open(nats_auth.password_file(self.cred_dir, user)) as f:
                password = f.read().strip()
        return NatsAuth(user=user if self.auth else "", password=password, tls_ca=self.tls_ca)

    def check(self, users: tuple[str, ...]) -> None:
        """Raise one-line errors: no server of the list answers, or a role's password file is
        missing."""
        addrs = []
        for u in self.urls:
            parts = urlsplit(u if "://" in u else "nats://" + u)
            addrs.append((parts.hostname or "", parts.port or 4222))
        if not any(_reachable(h, p) for h, p in addrs):
            raise RuntimeError(f"--nats-url {self.url}: no NATS server answers there")
        if self.auth:
            missing = [
                u for u in users if not os.path.isfile(nats_auth.password_file(self.cred_dir, u))
            ]
            if missing:
                raise RuntimeError(
                    f"--nats-credentials {self.cred_dir}: no password file for "
                    f"{', '.join(missing)} (copy <data-dir>/nats/credentials/ of the cluster "
                    "that runs this NATS, or pass --no-nats-auth if it has no users)"
                )

    def start(self, log_file=None) -> JoinedNats:
        return self

    def stop(self) -> None:
        pass


@dataclass
class JoinedMinio(KVUser):
    """The MinIO node(s) at ``endpoints``; the kvstore's user from ``credentials_file``."""

    endpoints: list[str]
    credentials_file: str
    proc: None = None

    @property
    def endpoint(self) -> str:
        return ",".join(self.endpoints)

    def _creds(self) -> MinioCredentials:
        with open(self.credentials_file) as f:
            return MinioCredentials(**json.load(f))

    def check(self) -> None:
        if not os.path.isfile(self.credentials_file):
            raise RuntimeError(
                f"--minio-credentials {self.credentials_file or '(none)'}: no such file (copy "
                "<data-dir>/minio.credentials.json of the cluster that runs this MinIO)"
            )
        try:
            self._creds()
        except (ValueError, TypeError) as exc:
            raise RuntimeError(
                f"--minio-credentials {self.credentials_file}: not a MinIO credentials file ({exc})"
            ) from None
        hosts = []
        for e in self.endpoints:
            host, _, port = e.rpartition(":")
            hosts.append((host.strip("[]"), int(port) if port.isdigit() else 9000))
        if not any(_reachable(h, p) for h, p in hosts):
            raise RuntimeError(f"--minio-endpoint {self.endpoint}: no MinIO answers there")

    def start(self, log_file=None) -> JoinedMinio:
        return self

    def stop(self) -> None:
        pass
