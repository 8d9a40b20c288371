"""Strata services on namespace hosts, secured as deployed (NATS users per role, KV mTLS, an
API key on the gateway): nats-server on host 1, each role started with
``ip netns exec <ns> python -m services.cli serve <role>`` and the STRATA_* env a remote
deployment uses (every address routable: gRPC, HTTP and /metrics bind the host's own address,
which is also what they advertise). Nothing here assumes 127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.request

from services.infra import nats_auth
from services.infra.kv_pki import ensure_pki
from services.infra.nats_server import MAX_PAYLOAD, nats_binary
from services.infra.procs import repo_root
from services.shape import SERVICE_THREAD_ENV
from shared.service import FATAL_LINE, READY_LINE
from tests.multihost.netns import Net

NATS_HOST = 1
METRICS_PORT = 9100
GATEWAY_PORT = 8000
# The gateway binds a non-loopback address here, which it refuses without an API key.
API_KEY = "multihost-test-key"


class Service:
    """One service process; its output lines are kept (`ready_at`: when STRATA_READY came)."""

    def __init__(self, name: str, proc: subprocess.Popen) -> None:
        self.name, self.proc = name, proc
        self.lines: list[str] = []
        self.ready_at = 0.0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for raw in self.proc.stdout:  # type: ignore[union-attr]
            line = raw.decode(errors="replace").rstrip()
            self.lines.append(line)
            if line.startswith(READY_LINE) and not self.ready_at:
                self.ready_at = time.monotonic()

    def wait_ready(self, timeout: float = 120.0) -> float:
        end = time.monotonic() + timeout
        while time.monotonic() < end and not self.ready_at:
            if self.proc.poll() is not None or any(ln.startswith(FATAL_LINE) for ln in self.lines):
                break
            time.sleep(0.1)
        if not self.ready_at:
            tail = "\n".join(self.lines[-20:])
            raise AssertionError(f"{self.name} did not become ready:\n{tail}")
        return self.ready_at


class Deployment:
    """nats-server on host 1 and services placed on hosts by the test."""

    def __init__(self, net: Net, model_dir: str, tmp_path, env: dict[str, str] | None = None):
        self.net, self.model_dir, self.env = net, model_dir, env or {}
        self.services: dict[str, Service] = {}
        self.hosts: dict[str, int] = {}
        self.nats_url = f"nats://{net.addr(NATS_HOST)}:4222"
        # The secured deployment: NATS users per role (as `strata up` makes them), and the KV
        # plane on mutual TLS with a certificate per service naming its host's address.
        self.cred_dir = str(tmp_path / "nats-credentials")
        self.passwords = nats_auth.ensure_credentials(self.cred_dir)
        conf = tmp_path / "nats.conf"
        conf.write_text(
            f"max_payload: {MAX_PAYLOAD}\n" + nats_auth.authorization_block(self.passwords)
        )
        conf.chmod(0o600)
        self.pki_dir = str(tmp_path / "pki")
        log = open(tmp_path / "nats.log", "wb")  # noqa: SIM115 - lives as long as the server
        net.popen(
            NATS_HOST,
            [
                nats_binary(),
                "-js",
                "-a",
                net.addr(NATS_HOST),
                "-p",
                "4222",
                "-sd",
                str(tmp_path / "js"),
                "-c",
                str(conf),
            ],
            stdout=log,
            stderr=log,
        )
        self.kvstore_addrs: list[str] = []
        self.metrics_ports: dict[str, int] = {}

    def start(self, role: str, name: str, host: int, env: dict[str, str] | None = None) -> Service:
        addr = self.net.addr(host)
        e = dict(os.environ, **SERVICE_THREAD_ENV)
        e.update(
            STRATA_NATS_URL=self.nats_url,
            STRATA_INSTANCE_ID=name,
            STRATA_MODEL=self.model_dir,
            STRATA_GRPC_HOST=addr,
            STRATA_METRICS_HOST=addr,
            STRATA_METRICS_PORT=str(METRICS_PORT + len(self.services)),
            STRATA_TORCH_THREADS="1",
            PYTHONPATH=repo_root(),
            STRATA_NATS_USER=role,
            STRATA_NATS_PASSWORD_FILE=nats_auth.password_file(self.cred_dir, role),
        )
        e.update(ensure_pki(self.pki_dir, [name], [addr])[name].env())
        if role == "gateway":
            e.update(STRATA_HOST=addr, STRATA_PORT=str(GATEWAY_PORT), STRATA_MAX_IMAGES="0")
            e.update(STRATA_API_KEYS=API_KEY)
        if role in ("prefill", "decode") and self.kvstore_addrs:
            e["STRATA_KVSTORE_ADDRS"] = ",".join(self.kvstore_addrs)
        e.update(self.env)
        e.update(env or {})
        argv = [sys.executable, "-m", "services.cli", "serve", role]
        proc = self.net.popen(
            host, argv, env=e, cwd=repo_root(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        svc = Service(name, proc)
        self.services[name], self.hosts[name] = svc, host
        self.metrics_ports[name] = METRICS_PORT + len(self.metrics_ports)
        return svc

    @property
    def gateway_url(self) -> str:
        return f"http://{self.net.addr(self.hosts['gateway-0'])}:{GATEWAY_PORT}"

    def metric(self, name: str, metric: str, label: str = "") -> float:
        """Sum of the samples of ``metric`` at service ``name`` whose labels contain ``label``
        (call from a host's thread)."""
        url = f"http://{self.net.addr(self.hosts[name])}:{self.metrics_ports[name]}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        return sum(
            float(ln.rsplit(" ", 1)[1])
            for ln in text.splitlines()
            if (ln.startswith(metric + "{") or ln.startswith(metric + " ")) and label in ln
        )

    def wait_gateway_ready(self, timeout: float = 120.0) -> None:
        """Poll /health/ready until 200 (call from a host's thread)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                with urllib.request.urlopen(self.gateway_url + "/health/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise AssertionError("the gateway never reported ready")
