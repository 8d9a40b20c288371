"""Process supervisor behind `strata up`: one OS process (own process group) per service,
prefixed and colored log lines, readiness by the ``STRATA_READY`` line, and stop-everything.

Stdlib only (no NATS/model imports), so it is tested directly with tiny dummy children.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import IO

from services.infra.procs import preexec, signal_group
from services.infra.zygote import ZygoteError, ZygoteProcess, forkable, zygote
from services.infra.zygote import failure as zygote_failure

READY_LINE = "STRATA_READY"  # same constant as shared.service.READY_LINE (kept import-free)
RETIRED_EXIT = 75  # shared.protocol.sched.RETIRED_EXIT: drained and retired by the autoscaler
FATAL_LINE = "STRATA_FATAL"  # same as shared.service.FATAL_LINE: a service's one-line reason
COLORS = (36, 33, 32, 35, 34, 91, 92, 93, 94, 95, 96)  # ANSI foreground codes, cycled
TAIL_LINES = 40


class ServiceFailed(RuntimeError):
    """A supervised process exited (or never became ready); carries its last log lines.

    When the process printed a ``STRATA_FATAL`` line (a start-up error it understood), the
    message is that one line (``fatal``); otherwise it shows the last log lines."""

    def __init__(self, name: str, reason: str, tail: list[str], fatal: str = ""):
        self.name, self.reason, self.tail, self.fatal = name, reason, tail, fatal
        if fatal:  # "decode: <why>" from decode-0 reads "decode-0: <why>"
            role = name.rsplit("-", 1)[0] + ": "
            super().__init__(f"{name}: {fatal.removeprefix(role)}")
            return
        lines = "\n".join(f"  | {line}" for line in tail) or "  | (no output)"
        super().__init__(f"{name} {reason}; last log lines:\n{lines}")


@dataclass(frozen=True)
class ProcSpec:
    """How to start one supervised process."""

    name: str
    """Log prefix and handle, e.g. ``decode-0``."""
    argv: list[str]
    """Command line (``argv[0]`` is looked up on PATH)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment on top of the launcher's own."""
    ready: bool = True
    """Wait for a ``STRATA_READY`` line; False = ready as soon as it started."""
    cwd: str | None = None
    """Working directory (default: the launcher's)."""
    die_with_parent: bool = False
    """Linux: SIGKILL the child if the launching thread dies (PR_SET_PDEATHSIG)."""
    fork: bool = False
    """Fork it from this process's zygote (`services.infra.zygote`: torch imported once) when
    ``argv`` is ``[sys.executable, "-m", module, ...]``; started as usual where that fails."""


class LogSink:
    """Serialises prefixed lines from many reader threads onto one stream (and optional files)."""

    def __init__(self, stream: IO[str] | None = None, color: bool | None = None):
        self.stream = stream
        self.color = _want_color(stream) if color is None else color
        self._lock = threading.Lock()
        self._next = 0
        self._colors: dict[str, int] = {}

    def prefix(self, name: str) -> str:
        with self._lock:
            if name not in self._colors:
                self._colors[name] = COLORS[self._next % len(COLORS)]
                self._next += 1
            code = self._colors[name]
        return f"\x1b[{code}m[{name}]\x1b[0m" if self.color else f"[{name}]"

    def write(self, name: str, line: str) -> None:
        if self.stream is None:
            return
        text = f"{self.prefix(name)} {line}\n"
        with self._lock, contextlib.suppress(ValueError, OSError):
            self.stream.write(text)
            self.stream.flush()


def _want_color(stream: IO[str] | None) -> bool:
    if stream is None or os.environ.get("NO_COLOR"):
        return False
    if os.environ.get("FORCE_COLOR"):
        return True
    return bool(getattr(stream, "isatty", lambda: False)())


class Supervised:
    """One running child: its output is read by a thread, prefixed, kept as a tail, and scanned
    for the readiness line."""

    def __init__(self, spec: ProcSpec, sink: LogSink, log_dir: str | None = None):
        self.spec = spec
        self.sink = sink
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.ready = threading.Event()
        self.ready_detail = ""
        self.fatal = ""  # the text after the process's STRATA_FATAL line, if it printed one
        self._eof = threading.Event()
        self._finished = False
        env = dict(os.environ, PYTHONUNBUFFERED="1", **spec.env)
        self._log = open(os.path.join(log_dir, f"{spec.name}.log"), "a") if log_dir else None
        self.forked = False  # started by the zygote
        self.proc: subprocess.Popen | ZygoteProcess = self._fork(env) or subprocess.Popen(
            spec.argv,
            env=env,
            cwd=spec.cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            bufsize=1,
            start_new_session=True,
            preexec_fn=preexec(spec.die_with_parent),
        )
        if not spec.ready:
            self.ready.set()
        self._reader = threading.Thread(target=self._read, name=f"log-{spec.name}", daemon=True)
        self._reader.start()

    def _fork(self, env: dict[str, str]) -> ZygoteProcess | None:
        """The process forked from the zygote, or None (not asked for, or it failed: said)."""
        if not self.spec.fork or not forkable(self.spec.argv):
            return None
        z = zygote()
        if z is None:
            self.sink.write(self.name, f"started without the zygote: {zygote_failure()}")
            return None
        try:
            proc = z.spawn(self.spec.argv, env, self.spec.cwd, self.spec.die_with_parent)
        except ZygoteError as exc:
            self.sink.write(self.name, f"started without the zygote: {exc}")
            return None
        self.forked = True
        return proc

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def retired(self) -> bool:
        """It exited because the autoscaler retired it (drained first): an exit on purpose."""
        return self.proc.poll() == RETIRED_EXIT

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.rstrip("\n")
            self.tail.append(line)
            if self._log is not None:
                with contextlib.suppress(ValueError, OSError):
                    self._log.write(line + "\n")
                    self._log.flush()
            if line.startswith(FATAL_LINE) and not self.fatal:
                self.fatal = line[len(FATAL_LINE) :].strip()
            if line.startswith(READY_LINE) and not self.ready.is_set():
                self.ready_detail = line[len(READY_LINE) :].strip()
                self.ready.set()
            self.sink.write(self.name, line)
        self._eof.set()

    def wait_ready(self, timeout: float) -> None:
        """Block until ready; ServiceFailed if the child exits first or the timeout passes."""
        deadline = time.monotonic() + timeout
        while not self.ready.wait(0.05):
            if self.proc.poll() is not None:
                self._eof.wait(2.0)  # let the reader collect the last lines
                if self.ready.is_set():
                    break
                raise ServiceFailed(
                    self.name,
                    f"exited with code {self.proc.returncode} before it was ready",
                    list(self.tail),
                    self.fatal,
                )
            if time.monotonic() > deadline:
                raise ServiceFailed(self.name, f"not ready after {timeout:.0f}s", list(self.tail))

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the child's whole process group."""
        signal_group(self.proc.pid, sig)

    def finish(self) -> None:
        """After exit: reap stragglers of the group, join the reader, close the log file."""
        if self._finished:
            return
        self._finished = True
        self.signal(signal.SIGKILL)
        self._eof.wait(2.0)
        if self._log is not None:
            self._log.close()
            self._log = None


def stop_all(procs: list[Supervised], timeout: float = 10.0) -> None:
    """SIGTERM every process group at once, wait up to ``timeout`` s, then SIGKILL the rest."""
    for p in procs:
        if p.alive():
            p.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.proc.wait(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.alive():
            p.signal(signal.SIGKILL)
            p.proc.wait(5)
        p.finish()


class Supervisor:
    """Starts named processes and stops them all; ``watch`` reports unexpected exits."""

    def __init__(self, sink: LogSink | None = None, log_dir: str | None = None):
        self.sink = sink or LogSink(None)
        self.log_dir = log_dir
        self.procs: dict[str, Supervised] = {}
        self._expected_exit: set[str] = set()
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)

    def start(self, spec: ProcSpec) -> Supervised:
        old = self.procs.get(spec.name)
        if old is not None and old.alive():
            raise ValueError(f"{spec.name} is already running (pid {old.pid})")
        self._expected_exit.discard(spec.name)
        proc = Supervised(spec, self.sink, self.log_dir)
        self.procs[spec.name] = proc
        return proc

    def wait_ready(self, names: list[str], timeout: float) -> None:
        """Wait for all ``names``; fails fast (ServiceFailed) when any supervised process dies."""
        deadline = time.monotonic() + timeout
        pending = list(names)
        while pending:
            self.check()
            pending = [n for n in pending if not self.procs[n].ready.is_set()]
            if pending and time.monotonic() > deadline:
                p = self.procs[pending[0]]
                raise ServiceFailed(p.name, f"not ready after {timeout:.0f}s", list(p.tail))
            if pending:
                self.procs[pending[0]].ready.wait(0.05)

    def check(self) -> None:
        """ServiceFailed for the first process that exited without being asked to."""
        for p in self.procs.values():
            if p.name not in self._expected_exit and not p.alive() and not p.retired:
                p._eof.wait(2.0)
                raise ServiceFailed(
                    p.name, f"exited with code {p.returncode}", list(p.tail), p.fatal
                )

    def exited(self) -> list[Supervised]:
        """Processes that died unexpectedly (each reported once)."""
        dead = [
            p
            for p in self.procs.values()
            if p.name not in self._expected_exit and not p.alive() and not p.retired
        ]
        for p in dead:
            self._expected_exit.add(p.name)
            p.finish()
        return dead

    def wanted(self, name: str) -> bool:
        """False once ``name`` was stopped, killed or retired on purpose (until it is started
        again)."""
        return name not in self._expected_exit and not self.procs[name].retired

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal one process group (a crash, for failure tests); it is then expected to exit."""
        self._expected_exit.add(name)
        self.procs[name].signal(sig)

    def stop(self, names: list[str], timeout: float = 10.0) -> None:
        self._expected_exit.update(names)
        stop_all([self.procs[n] for n in names], timeout)

    def stop_all(self, timeout: float = 10.0) -> None:
        self.stop(list(self.procs), timeout)
