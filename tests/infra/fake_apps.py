"""Dummy `services.<role>.app` modules for launcher tests (no model, no NATS client).

`write_fake_apps(dir)` creates ``<dir>/fakeapps/<role>/app.py`` for every role; point
``STRATA_APP_PACKAGE=fakeapps`` and PYTHONPATH at ``dir`` and `strata serve <role>` runs them.
Each one writes its pid (and its grandchild's) under ``FAKE_PID_DIR``, prints the ready line,
and waits for SIGTERM; ``FAKE_CRASH=<role or instance>`` makes it fail before it is ready
(so does a file ``<FAKE_PID_DIR>/<instance>.crash``, for restarts that fail);
``FAKE_LOAD_CONFIG=1`` makes it read the common ``STRATA_*`` settings (a bad one stops it);
the gateway serves ``/health`` and ``/v1/models`` on ``STRATA_HOST:STRATA_PORT``.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from services.cluster_config import ROLES

APP = """
import json, os, signal, subprocess, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROLE = {role!r}


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = {{"/health": {{"status": "ok"}},
                 "/v1/models": {{"data": [{{"id": "fake-model"}}]}}}}.get(self.path)
        self.send_response(200 if body else 404)
        self.end_headers()
        self.wfile.write(json.dumps(body).encode())

    def log_message(self, *args):
        pass


def main(argv):
    if os.environ.get("FAKE_LOAD_CONFIG"):  # read STRATA_* settings as real services do
        from shared.config import ServiceConfig

        ServiceConfig.load([], role=ROLE)
    inst = os.environ.get("STRATA_INSTANCE_ID", ROLE)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    print(f"{{inst}} starting argv={{argv}} threads={{os.environ.get('STRATA_TORCH_THREADS', '-')}}",
          flush=True)
    pid_dir = os.environ.get("FAKE_PID_DIR")
    crash_file = os.path.join(pid_dir or ".", inst + ".crash")  # appears: later starts fail
    if os.environ.get("FAKE_CRASH") in (ROLE, inst) or (pid_dir and os.path.exists(crash_file)):
        print("loading weights...", flush=True)
        print("boom: fake failure in " + inst, flush=True)
        sys.exit(3)
    if pid_dir:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(os.path.join(pid_dir, inst + ".pids"), "a") as f:
            f.write(f"{{os.getpid()}} {{child.pid}}\\n")
    if ROLE == "gateway":
        server = ThreadingHTTPServer((os.environ["STRATA_HOST"], int(os.environ["STRATA_PORT"])),
                                     Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"STRATA_READY role={{ROLE}} instance={{inst}}", flush=True)
    while not stop.wait(0.05):
        pass
    print("bye from " + inst, flush=True)
"""


def write_fake_apps(root: str | os.PathLike) -> str:
    """Write the dummy apps under ``root/fakeapps``; returns ``root`` (add it to PYTHONPATH)."""
    pkg = Path(root) / "fakeapps"
    for role in ROLES:
        (pkg / role).mkdir(parents=True, exist_ok=True)
        (pkg / role / "app.py").write_text(APP.format(role=role))
    (pkg / "__init__.py").write_text("")
    return str(root)


def write_fake_checkpoint(model: str | os.PathLike, arch: str = "LlamaForCausalLM") -> str:
    """A checkpoint dir that passes `validate_checkpoint` (config.json naming ``arch``, an empty
    but well-formed model.safetensors, tokenizer.json) and holds no real weights."""
    d = Path(model)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"architectures": [arch]}))
    header = b"{}"
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    (d / "tokenizer.json").write_text("{}")
    return str(d)


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def recorded_pids(pid_dir: str | os.PathLike) -> list[int]:
    """Every pid the fake apps (and their grandchildren) recorded."""
    pids: list[int] = []
    for f in Path(pid_dir).glob("*.pids"):
        pids += [int(x) for x in f.read_text().split()]
    return pids
