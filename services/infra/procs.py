"""Small process helpers shared by the infra launchers, the supervisor behind `strata up`
(`services.infra.supervisor`) and the tests: ports, polling, process-group signals, and the
atomic write of a file with its mode set from the first byte (keys, passwords, configs)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

from shared.config import RuntimeSettings


def write_file(path: str, data: bytes | str, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` atomically (a fresh temporary file beside it, then a rename),
    with ``mode`` from the first byte: a reader never sees a partial file or a wider mode."""
    tmp = f"{path}.{os.urandom(4).hex()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    os.chmod(tmp, mode)  # the umask may have narrowed it
    os.replace(tmp, path)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=timeout):
        return True
    return False


def wait_until(
    check: Callable[[], bool],
    timeout: float,
    what: str,
    proc=None,
    alive: Callable[[], None] | None = None,
) -> None:
    """Poll ``check`` until true; fail early with the process's exit code if ``proc`` died, or
    with whatever ``alive()`` raises (`Supervisor.check`: a supervised process died)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before becoming ready")
        if alive is not None:
            alive()
        time.sleep(0.05)
    raise TimeoutError(f"{what} not ready after {timeout:.0f}s")


def signal_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group led by ``pid`` (gone already: nothing to do)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left."""
    if proc.poll() is not None:
        return
    signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        signal_group(proc.pid, signal.SIGKILL)
        proc.wait(5)


def _pdeathsig(sig: int) -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG


def preexec(die_with_parent: bool, sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """`Popen(preexec_fn=...)` that makes Linux send ``sig`` (default SIGKILL) to the child when
    the launching thread dies (so a SIGKILLed `strata up` leaves nothing behind; SIGTERM lets a
    daemon stop what it started); None elsewhere or when off."""
    if not die_with_parent or sys.platform != "linux":
        return None
    return functools.partial(_pdeathsig, sig)


def repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cache_dir() -> str:
    """Ignored folder for binaries, models and data (``STRATA_CACHE`` overrides)."""
    return RuntimeSettings.from_env().cache_dir
