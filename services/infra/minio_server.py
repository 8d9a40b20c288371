"""MinIO (the SSD tier): found on PATH or in the cache, else built with `go install`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from dataclasses import dataclass

from services.infra.procs import cache_dir, free_port, preexec, stop_process, wait_until

ACCESS_KEY = "strata"
SECRET_KEY = "strata-secret-key"


def minio_binary(build: bool = True) -> str:
    """Path of a `minio` binary; builds it (minutes, with progress) only when none is found."""
    cached = os.path.join(cache_dir(), "bin", "minio")
    for cand in (os.environ.get("STRATA_MINIO_BIN"), shutil.which("minio"), cached):
        if cand and os.path.exists(cand):
            return cand
    if not build:
        raise RuntimeError("minio not found (set STRATA_MINIO_BIN or run scripts/setup.sh)")
    go = shutil.which("go") or "/usr/local/go/bin/go"
    if not os.path.exists(go):
        raise RuntimeError("minio not found and Go is not installed to build it")
    print("building MinIO with `go install github.com/minio/minio@latest` "
          "(first time only; takes several minutes)...", file=sys.stderr, flush=True)
    gocache = os.path.join(cache_dir(), "go")
    env = dict(os.environ, GOBIN=os.path.dirname(cached), GOPATH=gocache,
               GOMODCACHE=os.path.join(gocache, "mod"), GOCACHE=os.path.join(gocache, "build"))
    subprocess.run([go, "install", "-v", "github.com/minio/minio@latest"], env=env, check=True)
    return cached


@dataclass
class MinioServer:
    port: int
    data_dir: str
    proc: subprocess.Popen | None = None
    host: str = "127.0.0.1"
    die_with_parent: bool = False
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def healthy(self) -> bool:
        try:
            url = f"http://{self.endpoint}/minio/health/live"
            with urllib.request.urlopen(url, timeout=0.5) as r:
                return r.status == 200
        except OSError:
            return False

    def start(self, log_file=None, timeout: float = 60.0) -> MinioServer:
        os.makedirs(self.data_dir, exist_ok=True)
        env = dict(os.environ, MINIO_ROOT_USER=self.access_key,
                   MINIO_ROOT_PASSWORD=self.secret_key, MINIO_BROWSER="off")
        cmd = [minio_binary(), "server", self.data_dir, "--address", self.endpoint, "--quiet",
               "--console-address", f"{self.host}:{free_port()}"]
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=log_file or subprocess.DEVNULL, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=preexec(self.die_with_parent),
        )
        wait_until(self.healthy, timeout, "minio", self.proc)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None


def start_minio(
    port: int = 0, data_dir: str | None = None, log_file=None, die_with_parent: bool = False
) -> MinioServer:
    return MinioServer(
        port=port or free_port(), die_with_parent=die_with_parent,
        data_dir=data_dir or tempfile.mkdtemp(prefix="strata-minio-")
    ).start(log_file)
