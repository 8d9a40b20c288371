"""MinIO (the SSD tier): found on PATH or in the cache, else built with `go install`.

No fixed credentials: the root user and password are generated once per data dir and kept
beside it (``<data_dir>.credentials.json``, mode 0600), so a restart with the same data keeps
working; the kvstore gets its own user whose policy reaches only the KV bucket (it cannot list
or create other buckets). Tests and tools that administer MinIO use the root credentials.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass

from services.infra.procs import cache_dir, free_port, preexec, stop_process, wait_until
from shared.config import RuntimeSettings

KV_BUCKET = "strata-kv"
"""The kvstore's bucket (`KVStoreConfig.minio_bucket`'s default)."""
KV_USER = "strata-kvstore"
KV_POLICY = "strata-kv-bucket"


@dataclass(frozen=True)
class MinioCredentials:
    """One install's MinIO secrets: the root account and the kvstore's bucket-limited user."""

    root_user: str
    root_password: str
    kv_user: str
    kv_password: str

    @classmethod
    def load_or_create(cls, path: str) -> MinioCredentials:
        """The secrets stored at ``path``, else new random ones written there (0600)."""
        try:
            with open(path) as f:
                return cls(**json.load(f))
        except FileNotFoundError:
            pass
        creds = cls(
            root_user=f"strata-root-{secrets.token_hex(4)}",
            root_password=secrets.token_urlsafe(32),
            kv_user=KV_USER,
            kv_password=secrets.token_urlsafe(32),
        )
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(creds.__dict__, f)
        return creds


def bucket_policy(bucket: str) -> dict:
    """An IAM policy allowing object reads/writes and listing in ``bucket`` only."""
    return {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Effect": "Allow",
                "Action": [
                    "s3:GetBucketLocation",
                    "s3:ListBucket",
                    "s3:ListBucketMultipartUploads",
                ],
                "Resource": [f"arn:aws:s3:::{bucket}"],
            },
            {
                "Effect": "Allow",
                "Action": [
                    "s3:GetObject",
                    "s3:PutObject",
                    "s3:DeleteObject",
                    "s3:AbortMultipartUpload",
                    "s3:ListMultipartUploadParts",
                ],
                "Resource": [f"arn:aws:s3:::{bucket}/*"],
            },
        ],
    }


def provision_kv_user(
    endpoint: str, creds: MinioCredentials, bucket: str = KV_BUCKET, timeout: float = 30.0
) -> None:
    """With the root account of ``creds``: create ``bucket``, the policy `bucket_policy` and
    the user ``creds.kv_user`` holding only that policy (idempotent; a rerun resets the user's
    password to ``creds.kv_password``). Retries while MinIO is still starting, up to
    ``timeout`` seconds."""
    import urllib3
    from minio import Minio, MinioAdmin
    from minio.credentials import StaticProvider
    from minio.error import MinioAdminException, S3Error

    root = StaticProvider(creds.root_user, creds.root_password)
    # No retries inside urllib3: right after start MinIO answers 503 "server not initialized"
    # with a Retry-After that urllib3 would sleep out (60 s); the loop below retries at once.
    http = urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=5.0, read=30.0), retries=urllib3.Retry(total=0)
    )
    client = Minio(endpoint, credentials=root, secure=False, http_client=http)
    admin = MinioAdmin(endpoint=endpoint, credentials=root, secure=False, http_client=http)
    # Right after start (above all on a restart over an existing data dir) MinIO may still be
    # loading its IAM state: a just-added policy can be "not found" for a moment. Retry.
    deadline = time.monotonic() + timeout
    while True:
        try:
            if not client.bucket_exists(bucket):
                client.make_bucket(bucket)
            admin.policy_add(KV_POLICY, policy=bucket_policy(bucket))
            admin.user_add(creds.kv_user, creds.kv_password)
            admin.policy_set(KV_POLICY, user=creds.kv_user)
            return
        except (MinioAdminException, S3Error, urllib3.exceptions.HTTPError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


MINIO_VERSION = "v0.0.0-20260212201848-7aac2a2c5b7c"
"""The MinIO module version built when none is found: the same pin as scripts/setup.sh
(tests/infra/test_servers.py keeps the two equal); never @latest."""


def minio_binary(build: bool = True) -> str:
    """Path of a `minio` binary; builds it (minutes, with progress) only when none is found."""
    cached = os.path.join(cache_dir(), "bin", "minio")
    for cand in (RuntimeSettings.from_env().minio_bin, shutil.which("minio"), cached):
        if cand and os.path.exists(cand):
            return cand
    if not build:
        raise RuntimeError("minio not found (set STRATA_MINIO_BIN or run scripts/setup.sh)")
    go = shutil.which("go") or "/usr/local/go/bin/go"
    if not os.path.exists(go):
        raise RuntimeError("minio not found and Go is not installed to build it")
    print(
        f"building MinIO with `go install github.com/minio/minio@{MINIO_VERSION}` "
        "(first time only; takes several minutes)...",
        file=sys.stderr,
        flush=True,
    )
    gocache = os.path.join(cache_dir(), "go")
    env = dict(
        os.environ,
        GOBIN=os.path.dirname(cached),
        GOPATH=gocache,
        GOMODCACHE=os.path.join(gocache, "mod"),
        GOCACHE=os.path.join(gocache, "build"),
        GOTOOLCHAIN="auto",
        GOFLAGS="-modcacherw",
    )
    module = f"github.com/minio/minio@{MINIO_VERSION}"
    subprocess.run([go, "install", "-v", module], env=env, check=True)
    return cached


class KVUser:
    """The kvstore's MinIO user of a server whose `MinioCredentials` ``_creds()`` returns."""

    def _creds(self) -> MinioCredentials:
        raise NotImplementedError

    @property
    def kv_access_key(self) -> str:
        """The kvstore's user: reads, writes and lists ``kv_bucket``, nothing else."""
        return self._creds().kv_user

    @property
    def kv_secret_key(self) -> str:
        return self._creds().kv_password


@dataclass
class MinioServer(KVUser):
    """A MinIO process on ``host:port`` storing ``data_dir``; `start` also creates the KV bucket
    and the kvstore's user (``kv_access_key`` / ``kv_secret_key``)."""

    port: int
    data_dir: str
    proc: subprocess.Popen | None = None
    host: str = "127.0.0.1"
    die_with_parent: bool = False
    kv_bucket: str = KV_BUCKET
    creds: MinioCredentials | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def credentials_file(self) -> str:
        return os.path.abspath(self.data_dir).rstrip("/") + ".credentials.json"

    def _creds(self) -> MinioCredentials:
        if self.creds is None:
            self.creds = MinioCredentials.load_or_create(self.credentials_file)
        return self.creds

    @property
    def access_key(self) -> str:
        """Root user (administration and tests only; services get ``kv_access_key``)."""
        return self._creds().root_user

    @property
    def secret_key(self) -> str:
        return self._creds().root_password

    def healthy(self) -> bool:
        try:
            url = f"http://{self.endpoint}/minio/health/live"
            with urllib.request.urlopen(url, timeout=0.5) as r:
                return r.status == 200
        except OSError:
            return False

    def start(self, log_file=None, timeout: float = 60.0) -> MinioServer:
        os.makedirs(self.data_dir, exist_ok=True)
        env = dict(
            os.environ,
            MINIO_ROOT_USER=self.access_key,
            MINIO_ROOT_PASSWORD=self.secret_key,
            MINIO_BROWSER="off",
        )
        cmd = [
            minio_binary(),
            "server",
            self.data_dir,
            "--address",
            self.endpoint,
            "--quiet",
            "--console-address",
            f"{self.host}:{free_port()}",
        ]
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=log_file or subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=preexec(self.die_with_parent),
        )
        wait_until(self.healthy, timeout, "minio", self.proc)
        self._provision()
        return self

    def _provision(self) -> None:
        """Create the KV bucket and the kvstore's user limited to it (idempotent)."""
        provision_kv_user(self.endpoint, self._creds(), self.kv_bucket)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None


def start_minio(
    port: int = 0, data_dir: str | None = None, log_file=None, die_with_parent: bool = False
) -> MinioServer:
    return MinioServer(
        port=port or free_port(),
        die_with_parent=die_with_parent,
        data_dir=data_dir or tempfile.mkdtemp(prefix="strata-minio-"),
    ).start(log_file)
