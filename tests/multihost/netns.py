"""Hosts for multi-host tests on one machine: Linux network namespaces on a private bridge.

Every name carries a per-run prefix ``smh<pid hex>``; `sweep_leftovers` removes the namespaces
and links of earlier runs whose process is gone (a killed run cannot clean up after itself).
The bridge lives in its own "switch" namespace, so nothing is added to the machine's own
network namespace and no address of the test exists outside the namespaces it creates.
Host ``i`` gets 10.77.0.<i+1>/24 on interface ``eth0``; its bridge port is ``<prefix>p<i>``
in the switch namespace (`Net.link_down` takes it down to isolate the host, `Net.kill_host`
also kills what runs there: a machine that lost power, whose peers get no FIN or RST).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

PREFIX_ROOT = "smh"
SUBNET = "10.77.0"
T = TypeVar("T")


CLONE_NEWNET = 0x40000000


def _setns_net(fd: int) -> None:
    """setns(2) for the calling thread (``os.setns`` only exists from Python 3.12)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def netns_unusable() -> str:
    """Why network namespaces cannot be used here ('' when they can)."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"{PREFIX_ROOT}{os.getpid():x}-probe"
    res = _ip("netns", "add", probe, check=False)
    _ip("netns", "del", probe, check=False)
    return "" if res.returncode == 0 else f"ip netns add failed: {res.stderr.strip()}"


def sweep_leftovers() -> list[str]:
    """Delete namespaces named by earlier runs whose process no longer exists; returns them."""
    gone = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX_ROOT):
            continue
        pid_hex = name[len(PREFIX_ROOT) :].split("-", 1)[0]
        with contextlib.suppress(ValueError):
            if not os.path.exists(f"/proc/{int(pid_hex, 16)}"):
                _ip("netns", "del", name, check=False)
                gone.append(name)
    return gone


@dataclass
class Net:
    """A private network of ``hosts`` namespaces; `close` (also at exit and on SIGTERM)
    kills the processes started with `popen` and deletes every namespace."""

    hosts: int
    prefix: str = field(default_factory=lambda: f"{PREFIX_ROOT}{os.getpid():x}")
    procs: list[subprocess.Popen] = field(default_factory=list)
    proc_hosts: dict[int, int] = field(default_factory=dict)  # pid -> the host it runs on
    namespaces: list[str] = field(default_factory=list)

    def ns(self, i: int) -> str:
        return f"{self.prefix}-h{i}"

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def up(self) -> Net:
        atexit.register(self.close)
        with contextlib.suppress(ValueError):  # not the main thread: atexit still covers it
            prev = signal.getsignal(signal.SIGTERM)

            def on_term(signum, frame):  # noqa: ANN001
                self.close()
                if callable(prev):
                    prev(signum, frame)
                raise SystemExit(128 + signum)

            signal.signal(signal.SIGTERM, on_term)
        self._add_ns(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i in range(1, self.hosts + 1):
            ns, port = self.ns(i), f"{self.prefix}p{i}"
            self._add_ns(ns)
            _ip(
                "link",
                "add",
                port,
                "netns",
                self.switch,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                ns,
            )
            _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
        return self

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self.namespaces.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def link_down(self, i: int) -> None:
        """Cut host ``i`` off the network (its bridge port down)."""
        _ip("-n", self.switch, "link", "set", f"{self.prefix}p{i}", "down")

    def kill(self, proc: subprocess.Popen) -> None:
        """SIGKILL ``proc``'s process group (started by `popen`) and reap it."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)

    def kill_host(self, i: int) -> list[subprocess.Popen]:
        """Host ``i`` dies: its link goes down first (peers see no FIN or RST, as when a machine
        loses power), then every process `popen` started there is killed; returns them."""
        self.link_down(i)
        dead = [p for p in self.procs if self.proc_hosts.get(p.pid) == i and p.poll() is None]
        for proc in dead:
            self.kill(proc)
        return dead

    def popen(self, i: int, argv: list[str], **kw) -> subprocess.Popen:
        """Start ``argv`` inside host ``i``'s namespace (killed by `close`)."""
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns(i), *argv], start_new_session=True, **kw
        )
        self.procs.append(proc)
        self.proc_hosts[proc.pid] = i
        return proc

    def run_in(self, i: int, fn: Callable[[], T]) -> T:
        """Call ``fn`` in a thread that entered host ``i``'s network namespace, so the sockets
        it opens (e.g. an asyncio.run of a NATS client) live on that host."""
        out: dict[str, object] = {}

        def body() -> None:
            try:
                with open(f"/var/run/netns/{self.ns(i)}") as fd:
                    _setns_net(fd.fileno())
                out["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                out["error"] = exc

        t = threading.Thread(target=body, daemon=True)
        t.start()
        t.join()
        if "error" in out:
            raise out["error"]  # type: ignore[misc]
        return out["value"]  # type: ignore[return-value]

    def close(self) -> None:
        for proc in self.procs:
            self.kill(proc)
        self.procs.clear()
        for name in reversed(self.namespaces):
            _ip("netns", "del", name, check=False)
        self.namespaces.clear()
