"""The whole cluster on one machine: nats-server, MinIO and one OS process per service instance.

`strata up` and the end-to-end tests start it through the same entry point::

    with Cluster(model_dir, prefill=1, decode=2) as c:
        httpx.get(c.gateway_url + "/health")
        c.kill("decode-0"); c.restart("decode-0")

Every service is started as ``python -m services.cli serve <role>`` with its settings in
``STRATA_*`` env vars (services ignore settings they do not declare, so one set fits all).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import urllib.request
from typing import IO, Any

from services.cluster_config import (
    DTYPE_ROLES,
    MODEL_ROLES,
    REQUIRED_ROLES,
    ROLES,
    ClusterConfig,
    vision_replicas,
)
from services.infra.gateway_tls import local_context
from services.infra.joined import JoinedMinio, JoinedNats
from services.infra.kv_pki import ServiceCert, ensure_pki
from services.infra.minio_server import MinioServer
from services.infra.nats_auth import password_file
from services.infra.nats_server import NatsServer
from services.infra.procs import (
    free_port,
    repo_root,
    signal_group,
    wait_until,
)
from services.infra.restart import (
    RestartPolicy,
    ServerUnit,
    ServiceUnit,
    Watchdog,
    serve_restart_metrics,
)
from services.infra.scaler import LocalScaler
from services.infra.supervisor import LogSink, ProcSpec, Supervisor
from services.preflight import preflight
from services.serving_dtype import checkpoint_dtype, serving_dtype, weight_bytes
from services.shape import (
    AFFINITY_ENV,
    SERVICE_THREAD_ENV,
    Shape,
    choose_shape,
    format_cpus,
    usable_cores,
)
from shared.nats_auth import NatsAuth
from shared.worker.kv_budget import host_memory


class Cluster:
    """A local cluster: `start()` / `stop()`, `gateway_url`, `kill()` / `restart()` a service."""

    def __init__(
        self,
        model_dir: str = "",
        config: ClusterConfig | None = None,
        *,
        log_stream: IO[str] | None = None,
        color: bool | None = None,
        **overrides: Any,
    ):
        base = (config or ClusterConfig()).model_dump()
        base.update(overrides)
        if model_dir:
            base["model"] = model_dir
        cfg = ClusterConfig.model_validate(base)
        # --dp N: N data-parallel replicas of each model-serving instance, as instances of
        # their own that the scheduler balances (load, prefix affinity) like any others
        dp = cfg.dp
        cores, accel = usable_cores(), _accelerators(cfg.device)
        self.shape: Shape = choose_shape(
            cores,
            accel,
            prefill=None if cfg.prefill is None else cfg.prefill * dp,
            decode=cfg.decode * dp,
            torch_threads=cfg.torch_threads,
        )
        if cfg.prefill is None and dp > 1 and self.shape.prefill:  # the machine chose PD
            self.shape = choose_shape(
                cores,
                accel,
                prefill=self.shape.prefill * dp,
                decode=cfg.decode * dp,
                torch_threads=cfg.torch_threads,
            )
        role_args = cfg.role_args
        sched = role_args.get("scheduler", [])
        if dp > 1 and not any(a.startswith("--policy") for a in sched):
            # replicas with caches of their own: route by prefix as well as load
            role_args = {**role_args, "scheduler": [*sched, "--policy", "prefix_aware"]}
        self.cfg = cfg.model_copy(
            update={
                "prefill": self.shape.prefill,
                "decode": self.shape.decode,
                "torch_threads": self.shape.torch_threads,
                "dp": 1,  # applied: the counts above are the instances
                "role_args": role_args,
            }
        )
        self._own_data = not self.cfg.data_dir
        self.instance_prefix = self.cfg.instance_prefix
        if self.cfg.nats_url and not self.instance_prefix:
            host = socket.gethostname().split(".")[0] or "host"
            self.instance_prefix = f"{host}-{secrets.token_hex(2)}-"
        self.data_dir = os.path.abspath(self.cfg.data_dir) if self.cfg.data_dir else ""
        self.sup = Supervisor(LogSink(log_stream, cfg.color if color is None else color))
        self.nats: NatsServer | JoinedNats | None = None
        self.minio: MinioServer | JoinedMinio | None = None
        self.port = self.cfg.port or free_port(self.cfg.host)
        self.specs: dict[str, ProcSpec] = {}
        self._next_metrics = self.cfg.metrics_port_base
        self._metrics_given: set[int] = set()
        self._kvstore_addrs: list[str] = []
        self._infra_logs: list[IO[str]] = []
        self.watchdog: Watchdog | None = None
        self.scaler: LocalScaler | None = None
        self.launcher_metrics_port = 0
        self.dtype = self.cfg.dtype  # what the model processes run: `serving_dtype` at start
        self.certs: dict[str, ServiceCert] = {}  # KV-plane mTLS: one per process, "client" too

    # ---- addresses ----
    @property
    def gateway_url(self) -> str:
        scheme = "https" if self.cfg.tls_cert else "http"
        return f"{scheme}://{self.cfg.host}:{self.port}"

    @property
    def nats_url(self) -> str:
        assert self.nats is not None, "cluster not started"
        return self.nats.url

    @property
    def log_dir(self) -> str:
        """One ``<name>.log`` per process (also nats.log, minio.log) under the data dir."""
        return os.path.join(self.data_dir, "logs") if self.data_dir else ""

    def names(self, role: str | None = None) -> list[str]:
        """Service names (``<role>-<i>``, also their instance ids), optionally of one role."""
        return [n for n in self.specs if role is None or n.rsplit("-", 1)[0] == role]

    # ---- lifecycle ----
    def start(self) -> Cluster:
        """Start infra and every service; wait for readiness and the gateway's /health.

        On any failure everything started so far is stopped and the error re-raised
        (`ServiceFailed` names the service and carries its last log lines)."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        self.model_dir, self.nats, self.minio = preflight(self.cfg, self.port)
        if not self.data_dir:
            self.data_dir = tempfile.mkdtemp(prefix="strata-cluster-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.sup.log_dir = self.log_dir
        if self.nats is None:
            self.nats = NatsServer(
                self.cfg.nats_port or free_port(),
                os.path.join(self.data_dir, "nats"),
                host=self.cfg.host,
                die_with_parent=self.cfg.die_with_parent,
                auth=self.cfg.nats_auth,
                tls_cert=self.cfg.nats_tls_cert,
                tls_key=self.cfg.nats_tls_key,
                tls_ca=self.cfg.nats_tls_ca,
                tls_verify=self.cfg.nats_tls_verify,
                monitor_port=self.cfg.nats_monitor_port,
            )
            self.nats.start(self._infra_log("nats"))
        if self.cfg.minio and self.minio is None:
            self.minio = MinioServer(
                self.cfg.minio_port or free_port(),
                os.path.join(self.data_dir, "minio"),
                host=self.cfg.host,
                die_with_parent=self.cfg.die_with_parent,
            )
            self.minio.start(self._infra_log("minio"))
        self.sup.sink.write("strata", self.shape.line)
        from shared.model.cpu_kernels import native_half

        ck = checkpoint_dtype(self.model_dir)
        self.dtype, why = serving_dtype(
            ck,
            self.cfg.dtype,
            self.cfg.device,
            native_half(ck),
            weight_bytes(self.model_dir),
            host_memory().total,
        )
        if why:
            self.sup.sink.write("strata", why)
        counts = {r: getattr(self.cfg, r) for r in ROLES if r != "gateway"}
        counts["vision"], why = vision_replicas(self.model_dir, self.cfg.vision)
        if why:
            self.sup.sink.write("strata", why)
        self._kvstore_addrs = [f"{self.cfg.host}:{free_port()}" for _ in range(counts["kvstore"])]
        counts["gateway"] = 1
        self._kv_tls([f"{r}-{i}" for r in ROLES for i in range(counts[r])])
        for role in ROLES:  # all at once: each needs only NATS to become ready
            for i in range(counts[role]):
                self.start_service(role, index=i, wait=False)
        self.sup.wait_ready(list(self.specs), self.cfg.ready_timeout)
        self.wait_healthy(self.cfg.ready_timeout)
        if self.cfg.restart:
            self._start_watchdog()
        if self.autoscaled:
            self.scaler = LocalScaler(
                self,
                self.cfg.autoscale_max_decode,
                lambda line: self.sup.sink.write("strata", line),
            ).start()

    @property
    def autoscaled(self) -> bool:
        """Autoscaling of decode instances between ``decode`` and ``autoscale_max_decode``."""
        return self.cfg.autoscale_max_decode > self.cfg.decode

    @property
    def pki_dir(self) -> str:
        return os.path.join(self.data_dir, "pki")

    def _kv_tls(self, names: list[str]) -> None:
        """Make or reuse the KV plane's CA and one certificate per process (`kv_pki`), or say
        loudly why the gRPC channels stay plaintext."""
        say = self.sup.sink.write
        if any(k.startswith("STRATA_GRPC_TLS_") for k in self.cfg.env):
            say("strata", "KV plane: TLS from the STRATA_GRPC_TLS_* settings given with --env")
            return
        if not self.cfg.kv_tls:
            say(
                "strata",
                "WARNING: KV plane without TLS (--no-kv-tls): anything that reaches a gRPC "
                "port can read and write KV blocks; use it only on a network you trust",
            )
            return
        if self.cfg.nats_url:
            say(
                "strata",
                "WARNING: KV plane without TLS: joining another host's cluster needs one CA "
                "for all hosts; give each host's processes STRATA_GRPC_TLS_CERT/KEY/CA and "
                "STRATA_GRPC_TLS_VERIFY_CLIENTS=true with --env",
            )
            return
        self.certs = ensure_pki(
            self.pki_dir,
            [*names, "client"],
            [self.cfg.host],
            rotate=self.cfg.rotate_certs,
            rotate_ca=self.cfg.rotate_ca,
        )
        say("strata", f"KV plane: mutual TLS, CA and service certificates in {self.pki_dir}")

    def client_tls(self):
        """`GrpcTls` for a tool or test dialing this cluster's KV plane (plaintext if off)."""
        from shared.kvtransfer.tls import GrpcTls

        c = self.certs.get("client")
        return GrpcTls.from_files(c.cert, c.key, c.ca) if c else GrpcTls()

    def _start_watchdog(self) -> None:
        units: list = []  # a joined NATS or MinIO is supervised by whoever started it
        if isinstance(self.nats, NatsServer):
            units.append(ServerUnit("nats", self.nats, self._infra_log("nats"), True))
        if isinstance(self.minio, MinioServer):
            units.append(ServerUnit("minio", self.minio, self._infra_log("minio"), False))
        units += [
            ServiceUnit(self.sup, spec, name.rsplit("-", 1)[0] in REQUIRED_ROLES)
            for name, spec in self.specs.items()
        ]
        self.watchdog = Watchdog(
            units,
            RestartPolicy(initial_backoff=self.cfg.restart_backoff),
            say=lambda line: self.sup.sink.write("strata", line),
        )
        self.launcher_metrics_port = serve_restart_metrics(
            self.watchdog, self.cfg.host, self.cfg.launcher_metrics_port
        )
        self.watchdog.start()

    def _infra_log(self, name: str) -> IO[str]:
        f = open(os.path.join(self.log_dir, f"{name}.log"), "a")  # closed in stop()
        self._infra_logs.append(f)
        return f

    def healthy(self) -> bool:
        """The gateway's /health answers 200: the cluster is ready to serve (see readiness)."""
        try:
            ctx = local_context(self.cfg.tls_cert) if self.cfg.tls_cert else None
            with urllib.request.urlopen(
                self.gateway_url + "/health", timeout=1.0, context=ctx
            ) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_healthy(self, timeout: float = 60.0) -> None:
        """Wait until the gateway's /health answers 200 (tokenizer, scheduler and a live decode
        instance answer; vision too for a model that takes images)."""
        wait_until(
            self.healthy, timeout, f"gateway {self.gateway_url}/health", alive=self.sup.check
        )

    def stop(self) -> None:
        """Stop every service (SIGTERM, then SIGKILL after stop_timeout), then NATS and MinIO.
        Model instances stop first, while the kvstores still run: they hand the pool the cached
        KV it lacks (``kv_pool_flush_s``), which a kvstore writes behind to MinIO as it stops."""
        if self.scaler is not None:
            self.scaler.stop()
        if self.watchdog is not None:
            self.watchdog.stop()
        models = self.names("prefill") + self.names("decode")
        if models:
            self.sup.stop(models, self.cfg.stop_timeout)
        self.sup.stop_all(self.cfg.stop_timeout)
        for server in (self.minio, self.nats):
            if server is not None:
                server.stop()
        for f in self._infra_logs:
            f.close()
        self._infra_logs.clear()
        if self._own_data and self.data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- one service ----
    def service_spec(
        self,
        role: str,
        index: int,
        args: list[str] | tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> ProcSpec:
        """The command and env of instance ``<role>-<index>`` (ports chosen here)."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r} (one of {', '.join(ROLES)})")
        name = f"{role}-{index}"
        assert self.nats is not None, "start() the cluster first"
        e = {
            "STRATA_NATS_URL": self.nats.url,
            "STRATA_INSTANCE_ID": self.instance_prefix + name,
            "STRATA_LOG_LEVEL": self.cfg.log_level,
            "STRATA_MODEL": self.model_dir,
            "STRATA_METRICS_PORT": str(self._metrics_port()),
            "STRATA_DEVICE": self.cfg.device,
            "STRATA_GRPC_HOST": self.cfg.host,
            "PYTHONPATH": _pythonpath(),
        }
        e.update(
            self.nats_credentials(role).env(
                password_file(self.nats.cred_dir, role) if self.nats.auth else ""
            )
        )
        cpus = self.shape.model_cpus.get(name) if role in ("prefill", "decode") else None
        if self.dtype and role in DTYPE_ROLES:
            e["STRATA_DTYPE"] = self.dtype
        if role in ("prefill", "decode"):
            e["STRATA_TORCH_THREADS"] = str(self.cfg.torch_threads)
            e["STRATA_TP"] = str(self.cfg.tp)
            e["STRATA_EP"] = str(self.cfg.ep)
            # the auto KV budget is a share of this machine's memory, split among its engines
            most = max(self.cfg.decode, self.cfg.autoscale_max_decode)
            e["STRATA_HOST_ENGINES"] = str(self.cfg.prefill + most)
        else:  # services (vision too) stay single-threaded, on the spare cores if any
            e.update(SERVICE_THREAD_ENV)
            if role == "vision":
                e["STRATA_TORCH_THREADS"] = "1"
            cpus = self.shape.service_cpus
        if cpus:
            e[AFFINITY_ENV] = format_cpus(cpus)
        if role in ("prefill", "decode", "gateway") and self._kvstore_addrs:
            e["STRATA_KVSTORE_ADDRS"] = ",".join(self._kvstore_addrs)
        if role == "kvstore":
            e["STRATA_GRPC_PORT"] = self._kvstore_addrs[index].rsplit(":", 1)[1]
            if self.minio is not None:
                e.update(
                    STRATA_MINIO_ENDPOINT=self.minio.endpoint,
                    STRATA_MINIO_ACCESS_KEY=self.minio.kv_access_key,
                    STRATA_MINIO_SECRET_KEY=self.minio.kv_secret_key,
                )
        if role == "scheduler" and index == 0 and self.autoscaled:  # one replica decides
            e.update(
                STRATA_AUTOSCALE="true",
                STRATA_AUTOSCALE_MIN_DECODE=str(self.cfg.decode),
                STRATA_AUTOSCALE_MAX_DECODE=str(self.cfg.autoscale_max_decode),
            )
        if role == "gateway":
            e.update(STRATA_HOST=self.cfg.host, STRATA_PORT=str(self.port))
            if self.cfg.tls_cert:
                e.update(
                    STRATA_TLS_CERT=os.path.abspath(self.cfg.tls_cert),
                    STRATA_TLS_KEY=os.path.abspath(self.cfg.tls_key),
                )
            if not self.cfg.vision:  # text only: refuse images, readiness needs no vision
                e["STRATA_MAX_IMAGES"] = "0"
            if self.log_dir:  # one JSON line per API request (services/gateway/audit.py)
                e["STRATA_AUDIT_FILE"] = os.path.join(self.log_dir, f"audit-{name}.jsonl")
        if self.certs:
            cert = self.certs.get(name) or ensure_pki(self.pki_dir, [name], [self.cfg.host])[name]
            e.update(cert.env())
        e.update(self.cfg.env)
        e.update(env or {})
        argv = [
            sys.executable,
            "-m",
            "services.cli",
            "serve",
            role,
            *self.cfg.role_args.get(role, []),
            *args,
        ]
        return ProcSpec(
            name,
            argv,
            e,
            cwd=repo_root(),
            die_with_parent=self.cfg.die_with_parent,
            fork=self.cfg.fork_model_processes and role in MODEL_ROLES,
        )

    def nats_credentials(self, user: str) -> NatsAuth:
        """Credentials of NATS user ``user`` (a role, or ``api``) for `shared.bus.connect`;
        anonymous when ``nats_auth`` is off."""
        assert self.nats is not None, "start() the cluster first"
        return self.nats.client_auth(user)

    def _metrics_port(self) -> int:
        if not self.cfg.metrics_port_base:
            # a port free now may be the one just handed to another service (the kernel
            # reuses freed ephemeral ports): never give the same one twice
            port = free_port()
            for _ in range(50):
                if port not in self._metrics_given:
                    break
                port = free_port()
            self._metrics_given.add(port)
            return port
        self._next_metrics += 1
        return self._next_metrics - 1

    def start_service(
        self,
        role: str,
        index: int | None = None,
        args: list[str] | tuple = (),
        env: dict[str, str] | None = None,
        wait: bool = True,
    ) -> str:
        """Start one more instance (``index`` default: the next free one); returns its name."""
        if index is None:
            index = len(self.names(role))
            while f"{role}-{index}" in self.specs:
                index += 1
        if role == "kvstore" and index >= len(self._kvstore_addrs):
            self._kvstore_addrs.append(f"{self.cfg.host}:{free_port()}")
        spec = self.service_spec(role, index, args, env)
        self.specs[spec.name] = spec
        self.sup.start(spec)
        if self.watchdog is not None and spec.name not in self.watchdog.restarts():
            self.watchdog.units.append(ServiceUnit(self.sup, spec, role in REQUIRED_ROLES))
        if wait:
            self.sup.wait_ready([spec.name], self.cfg.ready_timeout)
        return spec.name

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Crash a service (default SIGKILL to its process group); the rest keeps running."""
        self.sup.kill(name, sig)
        with contextlib.suppress(Exception):
            self.sup.procs[name].proc.wait(10)

    def crash(self, name: str) -> None:
        """SIGKILL a service (or ``nats`` / ``minio``) as a crash would (not marked as on
        purpose: with ``restart`` the watchdog starts it again)."""
        server = {"nats": self.nats, "minio": self.minio}.get(name)
        proc = server.proc if server is not None else self.sup.procs[name].proc
        if proc is None:
            return
        signal_group(proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            proc.wait(10)

    def stop_service(self, name: str) -> None:
        """Graceful stop of one service (SIGTERM, then SIGKILL)."""
        self.sup.stop([name], self.cfg.stop_timeout)

    def restart(self, name: str, wait: bool = True) -> None:
        """Stop (if alive) and start the same instance again: same id, ports and settings."""
        if self.sup.procs[name].alive():
            self.stop_service(name)
        self.sup.procs[name].finish()
        self.sup.start(self.specs[name])
        if wait:
            self.sup.wait_ready([name], self.cfg.ready_timeout)

    def alive(self, name: str) -> bool:
        return self.sup.procs[name].alive()

    def logs(self, name: str) -> list[str]:
        """The last lines a service printed."""
        return list(self.sup.procs[name].tail)

    def check(self) -> None:
        """Raise ServiceFailed if a service died without being asked to."""
        self.sup.check()


def _accelerators(device: str) -> int:
    """Accelerators the model processes can use: 0 on CPU, else the visible CUDA devices."""
    if device == "cpu":
        return 0
    import torch

    return torch.cuda.device_count() if device.startswith("cuda") else 1


def _pythonpath() -> str:
    parts = [repo_root(), os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(p for p in parts if p)
