"""A warm start for the model processes: forked from a server that imported torch once.

A model process (prefill, decode, vision) started as ``python -m services.cli serve <role>``
spends the first seconds of its life importing torch: two thirds of the CPU time its app's
import takes (3.7 of 5.8 CPU-s on a busy 2-core AMD EPYC), before it loads a weight. `strata up` starts two or more
of them at once on the same cores, and restarts one after a crash. The zygote imports
`PRELOAD` once, in a process of its own, and forks each model process from there. The child
then becomes the service a fresh ``python -m`` would have been:

- its own session and process group (the supervisor signals groups), stdin from /dev/null,
  stdout and stderr to the supervisor's pipe;
- the environment, working directory and ``sys.argv`` it was given, the module run as
  ``__main__`` (`runpy`); its command line set to the one it would have had (`setproctitle`),
  so ``ps`` and ``/proc/<pid>/cmdline`` name the service;
- non-daemon threads joined and ``atexit`` handlers run on the way out, and its exit status
  (a code, or minus the signal that killed it, as `subprocess` reports them) sent to the
  launcher, which sees it through `ZygoteProcess` (`poll`, `wait`, ``returncode``).

What a fork cannot give: what torch and libgomp read when they are imported (``OMP_*`` and
``MKL_*`` variables, the CPU affinity libgomp counts) is the zygote's. Strata's model processes
set their thread count (``STRATA_TORCH_THREADS``) and pin themselves (``STRATA_CPU_AFFINITY``)
after they start, so neither depends on it. Nothing in the zygote touches CUDA, which a forked
child could not use then.

Lifetime: one zygote per launching process, started on its first use (`zygote`). It exits
when that process exits (the write end of a pipe only the launcher holds reaches EOF), first
SIGKILLing the process groups of the children started with ``die_with_parent``, which also get
SIGKILL if the zygote itself dies (``PR_SET_PDEATHSIG``). Where it cannot start, the launcher
starts every process as before (``Supervised`` falls back to `subprocess.Popen`).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO

PRELOAD = ("torch", "numpy")
"""What the zygote imports before it serves (nothing of Strata's: a module that read its
settings at import would keep the zygote's)."""
READY = "STRATA_ZYGOTE_READY"
START_TIMEOUT_S = 120.0
_HEADER = 8  # bytes of the request's length prefix
_setproctitle = None  # the zygote's `setproctitle.setproctitle`, where installed


class ZygoteError(RuntimeError):
    """The zygote could not start a process (the caller starts it the usual way)."""


# ---- the server -------------------------------------------------------------------------------


def _exit_code(exc: SystemExit) -> int:
    """The status ``sys.exit(x)`` gives a process: None -> 0, an int as is, else 1 (printed)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr, flush=True)
    return 1


def _become(req: dict, out_fd: int, keep_closed: list[int]) -> int:
    """In the forked child: turn into the process ``req`` describes, run it; its exit code."""
    import atexit
    import runpy
    import traceback

    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.setsid()
    for fd in keep_closed:
        with contextlib.suppress(OSError):
            os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    argv = req["argv"]
    if _setproctitle is not None:  # before the env changes: it needs the env's memory as found
        _setproctitle(" ".join(argv))
    cwd = req.get("cwd") or os.getcwd()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(req["env"])
    if req.get("die_with_parent"):  # imported now: nothing of Strata's before the env is set
        from services.infra.procs import _pdeathsig

        _pdeathsig(signal.SIGKILL)
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [cwd, *[p for p in extra if p not in sys.path], *sys.path[1:]]
    sys.argv = [argv[2], *argv[3:]]  # runpy puts the module's file in argv[0]
    code = 0
    try:
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = _exit_code(exc)
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter does at exit
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    return code


def _read_request(conn: socket.socket) -> tuple[dict, int]:
    """One request: its JSON and the stdout fd that came with its first bytes."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 1)
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ValueError("a request carries exactly one file descriptor")
    try:
        while len(data) < _HEADER:
            more = conn.recv(1 << 16)
            if not more:
                raise ValueError("request cut short")
            data += more
        size = int(data[:_HEADER])
        body = data[_HEADER:]
        while len(body) < size:
            more = conn.recv(max(1 << 16, size - len(body)))
            if not more:
                raise ValueError("request cut short")
            body += more
        return json.loads(body), fds[0]
    except BaseException:
        os.close(fds[0])
        raise


def serve(path: str, alive_fd: int) -> None:
    """The zygote: import `PRELOAD`, listen on ``path``, fork a child per request, report each
    child's exit status on its request's connection; exit (killing the ``die_with_parent``
    children's groups) when ``alive_fd`` reaches EOF."""
    import importlib

    global _setproctitle
    for name in PRELOAD:
        importlib.import_module(name)
    with contextlib.suppress(ImportError):  # imported here: it finds argv's memory at import
        from setproctitle import setproctitle

        _setproctitle = setproctitle
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sig_r, sig_w = os.pipe()
    os.set_blocking(sig_r, False)
    os.set_blocking(sig_w, False)
    signal.set_wakeup_fd(sig_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, tuple[socket.socket, bool]] = {}  # pid -> (connection, die_with_parent)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(sig_r, selectors.EVENT_READ, "child")
    sel.register(alive_fd, selectors.EVENT_READ, "alive")
    print(READY, flush=True)
    while True:
        for key, _ in sel.select():
            if key.data == "alive" and not os.read(alive_fd, 1):
                for pid, (_, dwp) in children.items():
                    if dwp:
                        with contextlib.suppress(OSError):
                            os.killpg(pid, signal.SIGKILL)
                with contextlib.suppress(OSError):  # the launcher cannot clean up after it
                    os.unlink(path)
                    os.rmdir(os.path.dirname(path))
                return
            if key.data == "child":
                with contextlib.suppress(OSError):
                    while os.read(sig_r, 512):
                        pass
                while children:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    conn, _ = children.pop(pid, (None, False))
                    if conn is not None:
                        code = os.waitstatus_to_exitcode(status)
                        with contextlib.suppress(OSError):
                            conn.sendall(json.dumps({"exit": code}).encode() + b"\n")
                        conn.close()
            if key.data == "accept":
                conn, _ = listener.accept()
                try:
                    req, out_fd = _read_request(conn)
                except (ValueError, OSError) as exc:
                    with contextlib.suppress(OSError):
                        conn.sendall(json.dumps({"error": str(exc)}).encode() + b"\n")
                    conn.close()
                    continue
                open_fds = [
                    sel.fileno(),
                    listener.fileno(),
                    sig_r,
                    sig_w,
                    alive_fd,
                    conn.fileno(),
                    *(c.fileno() for c, _ in children.values()),
                ]
                pid = os.fork()
                if pid == 0:
                    code = 1
                    try:
                        code = _become(req, out_fd, open_fds)
                    finally:
                        os._exit(code)
                os.close(out_fd)
                children[pid] = (conn, bool(req.get("die_with_parent")))
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")


# ---- the launcher's side ----------------------------------------------------------------------


def forkable(argv: list[str]) -> bool:
    """Whether the zygote can start ``argv``: ``[sys.executable, "-m", module, ...]``."""
    return len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m"


class ZygoteProcess:
    """A process the zygote forked, as the supervisor uses a `subprocess.Popen`: ``pid``,
    ``stdout`` (text, its stdout and stderr), ``poll()``, ``wait(timeout)``, ``returncode``."""

    def __init__(
        self, args: list[str], pid: int, conn: socket.socket, stdout: IO[str], buf: bytes = b""
    ):
        self.args = args
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._conn = conn
        self._buf = b""
        self._lock = threading.Lock()
        if self._add(buf):  # what came after the pid line: the status, if it exited at once
            conn.close()

    def _add(self, chunk: bytes) -> bool:
        """Take bytes of the status line; True once it is whole (``returncode`` set)."""
        self._buf += chunk
        if b"\n" not in self._buf:
            return False
        self.returncode = int(json.loads(self._buf.split(b"\n", 1)[0])["exit"])
        return True

    def _take(self, timeout: float | None) -> None:
        """Read the exit status if it arrives within ``timeout`` s (None: wait for it)."""
        with self._lock:
            deadline = None if timeout is None else time.monotonic() + timeout
            while self.returncode is None:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                self._conn.settimeout(left)
                try:
                    chunk = self._conn.recv(256)
                except (TimeoutError, BlockingIOError):
                    return
                if not chunk:  # the zygote is gone: nothing can report or supervise it now
                    with contextlib.suppress(OSError):
                        os.killpg(self.pid, signal.SIGKILL)
                    self.returncode = -signal.SIGKILL
                    break
                self._add(chunk)
            self._conn.close()

    def poll(self) -> int | None:
        if self.returncode is None:
            self._take(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._take(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode


class Zygote:
    """The launcher's handle on its zygote: `spawn` forks one process there."""

    def __init__(self) -> None:
        from services.infra.procs import repo_root

        self.dir = tempfile.mkdtemp(prefix="strata-zygote-")
        self.path = os.path.join(self.dir, "sock")
        alive_r, self._alive_w = os.pipe()  # both close-on-exec: no other child holds them
        root = repo_root()
        self.tail: list[str] = []
        pythonpath = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "services.infra.zygote", self.path, str(alive_r)],
                env=dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=pythonpath),
                cwd=root,
                pass_fds=(alive_r,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                start_new_session=True,
            )
        except OSError:
            os.close(self._alive_w)
            raise
        finally:
            os.close(alive_r)
        ready = threading.Event()
        threading.Thread(target=self._drain, args=(ready,), name="zygote-log", daemon=True).start()
        if not ready.wait(START_TIMEOUT_S) or self.proc.poll() is not None:
            self.close()
            raise ZygoteError("the zygote did not start: " + " | ".join(self.tail[-5:]))

    def _drain(self, ready: threading.Event) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(READY):
                ready.set()
            self.tail = [*self.tail[-19:], line.rstrip("\n")]
        ready.set()  # it exited: the waiter sees poll() set

    def alive(self) -> bool:
        return self.proc.poll() is None

    def spawn(
        self, argv: list[str], env: dict[str, str], cwd: str | None, die_with_parent: bool
    ) -> ZygoteProcess:
        """Fork ``argv`` (``[sys.executable, "-m", module, *args]``) from the zygote."""
        if not forkable(argv):
            raise ZygoteError(f"not a `python -m` command of this interpreter: {argv[:3]}")
        body = json.dumps(
            {"argv": argv, "env": env, "cwd": cwd, "die_with_parent": die_with_parent}
        ).encode()
        read_fd, write_fd = os.pipe()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            data = b"%08d" % len(body) + body
            sent = socket.send_fds(conn, [data], [write_fd])
            conn.sendall(data[sent:])
            os.close(write_fd)
            write_fd = -1
            buf = b""
            while b"\n" not in buf:
                chunk = conn.recv(256)
                if not chunk:
                    break
                buf += chunk
            line, _, rest = buf.partition(b"\n")
            reply = json.loads(line) if line else {"error": "the zygote closed the connection"}
        except (OSError, ValueError) as exc:
            reply = {"error": str(exc)}
        finally:
            if write_fd >= 0:
                os.close(write_fd)
        if "pid" not in reply:
            conn.close()
            os.close(read_fd)
            raise ZygoteError(f"the zygote did not start {argv[2]}: {reply.get('error')}")
        stdout = os.fdopen(read_fd, "r", errors="replace")
        return ZygoteProcess(argv, int(reply["pid"]), conn, stdout, rest)

    def close(self) -> None:
        """Stop the zygote (its ``die_with_parent`` children go with it)."""
        with contextlib.suppress(OSError):
            os.close(self._alive_w)
        with contextlib.suppress(Exception):
            self.proc.wait(10)
        with contextlib.suppress(OSError):
            os.unlink(self.path)
            os.rmdir(self.dir)


_lock = threading.Lock()
_zygote: Zygote | None = None
_failed = ""


def zygote() -> Zygote | None:
    """This process's zygote, started on first use (and again if it died); None when it cannot
    start here (`failure` says why), and then for the rest of this process."""
    global _zygote, _failed
    with _lock:
        if _zygote is not None and _zygote.alive():
            return _zygote
        if _failed:
            return None
        try:
            _zygote = Zygote()
        except (OSError, ZygoteError) as exc:
            _failed = str(exc) or type(exc).__name__
            _zygote = None
        return _zygote


def failure() -> str:
    """Why `zygote` returned None ("" when it did not)."""
    return _failed


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
