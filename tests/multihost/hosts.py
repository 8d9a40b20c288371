"""Strata services on namespace hosts, secured as deployed (NATS users per role, KV mTLS, an
API key on the gateway): nats-server on host 1 (or a `NatsCluster`), each role started with
``ip netns exec <ns> python -m services.cli serve <role>`` and the STRATA_* env a remote
deployment uses (every address routable: gRPC, HTTP and /metrics bind the host's own address,
which is also what they advertise). Nothing here assumes 127.0.0.1.

Also the clustered servers of docs/DEPLOY.md: `NatsCluster` (JetStream over several nodes,
authenticated routes) and `MinioCluster` (distributed, erasure-coded MinIO, one drive a node)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence

import pytest

from services.infra import nats_auth
from services.infra.kv_pki import ensure_pki
from services.infra.minio_server import (
    KV_BUCKET,
    MinioCredentials,
    minio_binary,
    provision_kv_user,
)
from services.infra.nats_server import MAX_PAYLOAD, nats_binary
from services.infra.procs import repo_root
from services.kvstore.ssd import MinioTier
from services.shape import SERVICE_THREAD_ENV
from shared.service import FATAL_LINE, READY_LINE
from tests.multihost.netns import Net

NATS_HOST = 1
METRICS_PORT = 9100
GATEWAY_PORT = 8000
NATS_MONITOR_PORT = 8222
# The gateway binds a non-loopback address here, which it refuses without an API key.
API_KEY = "multihost-test-key"


class NatsCluster:
    """nats-server ``n<i>`` on each host ``i`` of ``hosts`` (client port 4222, routes on 6222,
    monitoring on 8222), secured as deployed: the per-role users and permissions `strata up`
    writes, routes authenticated with their own user and password, 8 MiB payloads."""

    def __init__(self, net: Net, tmp_path, hosts: Sequence[int] = (1, 2, 3)) -> None:
        self.net, self.tmp_path, self.hosts = net, tmp_path, tuple(hosts)
        self.cred_dir = str(tmp_path / "credentials")
        self.passwords = nats_auth.ensure_credentials(self.cred_dir)
        self.procs: dict[str, subprocess.Popen] = {}
        route_pw = secrets.token_urlsafe(24)
        for i in self.hosts:
            routes = ", ".join(
                f"nats-route://route:{route_pw}@{net.addr(j)}:6222" for j in self.hosts if j != i
            )
            conf = tmp_path / f"n{i}.conf"
            conf.write_text(
                f'server_name: n{i}\nlisten: "{net.addr(i)}:4222"\nmax_payload: {MAX_PAYLOAD}\n'
                f'http: "{net.addr(i)}:{NATS_MONITOR_PORT}"\n'
                f'jetstream {{ store_dir: "{tmp_path / f"js{i}"}" }}\n'
                f'cluster {{ name: strata, listen: "{net.addr(i)}:6222", routes: [{routes}],\n'
                f'  authorization {{ user: route, password: "{route_pw}" }} }}\n'
                + nats_auth.authorization_block(self.passwords)
            )
            conf.chmod(0o600)
            self.start(f"n{i}")

    @property
    def url(self) -> str:
        """The seed list every client gets (`STRATA_NATS_URL`)."""
        return ",".join(f"nats://{self.net.addr(i)}:4222" for i in self.hosts)

    def host(self, name: str) -> int:
        return int(name[1:])

    def start(self, name: str) -> None:
        """Start node ``name`` (again: the same config and JetStream store)."""
        log = open(self.tmp_path / f"{name}.log", "ab")  # noqa: SIM115 - lives with the server
        conf = str(self.tmp_path / f"{name}.conf")
        self.procs[name] = self.net.popen(
            self.host(name), [nats_binary(), "-c", conf], stdout=log, stderr=log
        )

    def kill(self, name: str) -> None:
        self.net.kill(self.procs[name])

    def wait_healthy(self, name: str, timeout: float = 60.0) -> None:
        """Until node ``name``'s /healthz answers 200: in the cluster, its JetStream assets
        current (call from a host's thread)."""
        url = f"http://{self.net.addr(self.host(name))}:{NATS_MONITOR_PORT}/healthz"
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        pytest.fail(f"nats-server {name} never reported healthy")

    def client_names(self, name: str) -> list[str]:
        """The connection names of node ``name``'s clients (call from a host's thread)."""
        url = f"http://{self.net.addr(self.host(name))}:{NATS_MONITOR_PORT}/connz?limit=1024"
        with urllib.request.urlopen(url, timeout=5) as r:
            return [c.get("name", "") for c in json.load(r).get("connections") or []]


class MinioCluster:
    """Distributed (erasure-coded) MinIO: one drive on each node ``k`` of ``nodes``, given as
    (host, port); several nodes may share a host (on different ports). Its console listens on
    port + 1."""

    def __init__(
        self, net: Net, tmp_path, creds: MinioCredentials, nodes: Sequence[tuple[int, int]]
    ) -> None:
        self.net, self.tmp_path, self.creds, self.nodes = net, tmp_path, creds, list(nodes)
        self.urls = [
            f"http://{net.addr(h)}:{port}{tmp_path}/m{k}/data"
            for k, (h, port) in enumerate(self.nodes)
        ]
        self.procs: dict[int, subprocess.Popen] = {}
        for k in range(len(self.nodes)):
            os.makedirs(tmp_path / f"m{k}" / "data")
            self.start(k)

    def endpoint(self, k: int) -> str:
        host, port = self.nodes[k]
        return f"{self.net.addr(host)}:{port}"

    @property
    def endpoints(self) -> str:
        """Every node, comma-separated (`STRATA_MINIO_ENDPOINT`)."""
        return ",".join(self.endpoint(k) for k in range(len(self.nodes)))

    def start(self, k: int) -> None:
        """Start node ``k`` (again: the same drive)."""
        # MINIO_CI_CD: distributed MinIO refuses drives on the root disk unless told it is a test.
        env = dict(
            os.environ,
            MINIO_ROOT_USER=self.creds.root_user,
            MINIO_CI_CD="on",
            MINIO_ROOT_PASSWORD=self.creds.root_password,
            MINIO_BROWSER="off",
        )
        host, port = self.nodes[k]
        addr = self.net.addr(host)
        log = open(self.tmp_path / f"minio{k}.log", "ab")  # noqa: SIM115 - lives with minio
        argv = [minio_binary(build=False), "server", "--quiet", "--address", f"{addr}:{port}"]
        argv += ["--console-address", f"{addr}:{port + 1}", *self.urls]
        self.procs[k] = self.net.popen(host, argv, env=env, stdout=log, stderr=log)

    def kill(self, k: int) -> None:
        self.net.kill(self.procs[k])

    def healthy(self, k: int) -> bool:
        """Node ``k`` reports the cluster able to serve (call from a host's thread)."""
        try:
            url = f"http://{self.endpoint(k)}/minio/health/cluster"
            with urllib.request.urlopen(url, timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_healthy(self, k: int = 0, timeout: float = 90.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.healthy(k):
                return
            time.sleep(0.5)
        pytest.fail("distributed MinIO never reported a healthy cluster")

    def provision(self) -> None:
        """The KV bucket and the kvstore's bucket-limited user, as `strata up` makes them."""
        provision_kv_user(self.endpoint(0), self.creds, KV_BUCKET)

    def tier(self, k: int | None = None, timeout: float = 5.0) -> MinioTier:
        """The kvstore's view: its user, node ``k`` only or (None) every node."""
        endpoint = self.endpoints if k is None else self.endpoint(k)
        c = self.creds
        return MinioTier(endpoint, c.kv_user, c.kv_password, KV_BUCKET, timeout=timeout)

    def wait_serving(self, timeout: float = 90.0) -> None:
        """Until every node answers the kvstore's user: a node reports the cluster healthy
        before its IAM is loaded, and answers 503 (XMinioIAMNotInitialized) to signed calls
        until then. Losing a node of a settled cluster is what the tests are about, so a kill
        waits for this (seen on CI: a node still without IAM 20 s after the kill of another,
        past the tier's busy waits)."""
        probes = {k: self.tier(k) for k in range(len(self.nodes))}
        end = time.monotonic() + timeout
        pending = set(probes)
        while pending and time.monotonic() < end:
            for k in sorted(pending):
                try:
                    if probes[k].client.bucket_exists(KV_BUCKET):
                        pending.discard(k)
                except Exception:  # noqa: BLE001 - 503 until IAM is loaded; retried below
                    pass
            if pending:
                time.sleep(0.5)
        if pending:
            pytest.fail(f"MinIO nodes {sorted(pending)} never served the kvstore's user")


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
    """Services placed on hosts by the test, on nats-server on host 1 or on ``nats``."""

    def __init__(
        self,
        net: Net,
        model_dir: str,
        tmp_path,
        env: dict[str, str] | None = None,
        nats: NatsCluster | None = None,
    ):
        self.net, self.model_dir, self.env = net, model_dir, env or {}
        self.services: dict[str, Service] = {}
        self.hosts: dict[str, int] = {}
        # The secured deployment: NATS users per role (as `strata up` makes them), and the KV
        # plane on mutual TLS with a certificate per service naming its host's address.
        self.pki_dir = str(tmp_path / "pki")
        self.kvstore_addrs: list[str] = []
        self.metrics_ports: dict[str, int] = {}
        if nats is not None:
            self.nats_url, self.cred_dir, self.passwords = nats.url, nats.cred_dir, nats.passwords
            return
        self.nats_url = f"nats://{net.addr(NATS_HOST)}:4222"
        self.cred_dir = str(tmp_path / "nats-credentials")
        self.passwords = nats_auth.ensure_credentials(self.cred_dir)
        conf = tmp_path / "nats.conf"
        conf.write_text(
            f"max_payload: {MAX_PAYLOAD}\n" + nats_auth.authorization_block(self.passwords)
        )
        conf.chmod(0o600)
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
