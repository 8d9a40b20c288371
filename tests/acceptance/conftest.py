"""`strata up` as a user runs it: a subprocess of the real command line, read until its banner."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque

import pytest

from services.infra.procs import free_port, repo_root

UP_LINE = re.compile(r"Strata is up at (http://\S+)")


class Up:
    """A running ``strata up`` (or ``scripts/up.sh``) process; ``url`` once its banner printed."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, timeout: float = 300):
        self.lines: deque[str] = deque(maxlen=400)
        self.proc = subprocess.Popen(
            argv,
            cwd=repo_root(),
            env=dict(os.environ, **(env or {})),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self._up = threading.Event()
        self.url = ""
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not self._up.wait(0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(
                    f"{' '.join(argv)} did not come up (rc={self.proc.returncode}):\n"
                    + "\n".join(list(self.lines)[-60:])
                )

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            m = UP_LINE.search(line)
            if m:
                self.url = m.group(1)
                self._up.set()

    def output(self) -> str:
        return "\n".join(self.lines)

    def stop(self) -> int:
        """Ctrl-C, as a user stops it; returns the exit code."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode


def strata_up(model_dir: str, tmp_path) -> Up:
    """``strata up --model DIR`` with no other flag than a free port and a private data dir
    (so that tests can run beside a cluster a user left on :8000)."""
    return Up(
        [
            sys.executable,
            "-m",
            "services.cli",
            "up",
            "--model",
            str(model_dir),
            "--port",
            str(free_port()),
            "--data-dir",
            str(tmp_path / "data"),
            "--no-color",
        ]
    )
