"""`strata drain`: retire a model instance from its own host or pod, as the autoscaler does.

An instance with ``drain_socket`` set listens on that Unix socket, mode 0600: only its own user
reaches it, such as a Kubernetes preStop hook running in its container (nothing on the network
can). A client that writes ``drain`` gets `RoleSwitcher.retire_drain`, the drain of the
scheduler's retirement: the load reports say ``draining`` (every scheduler stops routing here),
the open requests run to completion for up to ``drain_timeout_s``, then the instance stops as on
SIGTERM (pool flush, deregistration) and exits with `RETIRED_EXIT`.

The reply is two JSON lines: ``{"state": "draining", "open": N, ...}`` when the drain starts and
``{"state": "drained" | "timed_out", "open": N, "seconds": S}`` when it is over, written before
the stop begins, so a preStop hook returns while its container still runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import stat
import time
from collections.abc import Callable, Iterator

from shared.service import StartupError

log = logging.getLogger(__name__)

REQUEST = b"drain\n"


class DrainEndpoint:
    """The Unix socket of one instance; ``roles`` is its `RoleSwitcher`."""

    def __init__(self, roles, path: str, instance_id: str) -> None:
        self.roles, self.path, self.instance_id = roles, path, instance_id
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> DrainEndpoint:
        _clear_stale(self.path)
        try:
            self.server = await asyncio.start_unix_server(self._handle, self.path)
        except OSError as exc:
            raise StartupError(
                f"drain socket {self.path} cannot be bound ({exc.strerror or exc}); set "
                "STRATA_DRAIN_SOCKET (--drain-socket) to a writable path, or empty for none"
            ) from exc
        os.chmod(self.path, 0o600)
        return self

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 5.0)
        except (TimeoutError, OSError):
            writer.close()
            return
        if line != REQUEST:
            await _send(writer, {"state": "error", "error": f"unknown request {line[:40]!r}"})
            writer.close()
            return
        roles, t0 = self.roles, time.monotonic()
        log.info("drain: requested on %s", self.path)
        await _send(
            writer,
            {
                "state": "draining",
                "instance": self.instance_id,
                "role": roles.rt.role,
                "open": roles.open_requests(),
                "timeout_s": roles.rt.cfg.drain_timeout_s,
            },
        )
        still = await roles.retire_drain()
        done = {"state": "timed_out" if still else "drained", "open": still}
        await _send(writer, {**done, "seconds": round(time.monotonic() - t0, 3)})
        writer.close()
        roles.finish_retire()  # after the reply: a preStop hook returns before the exit


async def _send(writer: asyncio.StreamWriter, msg: dict) -> None:
    """One JSON line; a client that left changes nothing (the drain goes on)."""
    with contextlib.suppress(OSError):
        writer.write(json.dumps(msg).encode() + b"\n")
        await writer.drain()


def _clear_stale(path: str) -> None:
    """Remove a socket file left by an instance that is gone; refuse one that still answers."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise StartupError(
            f"drain socket {path} exists and is not a socket; set STRATA_DRAIN_SOCKET "
            "(--drain-socket) to another path"
        )
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(path)
        except OSError:
            os.unlink(path)
            return
    raise StartupError(
        f"drain socket {path} is another running instance's; give each instance its own "
        "STRATA_DRAIN_SOCKET (--drain-socket)"
    )


def ask_drain(path: str, timeout: float | None = None) -> Iterator[dict]:
    """Ask the instance listening on ``path`` to retire; yields its reply lines as they come
    (``timeout``: seconds each may take; None: no limit, the instance bounds its drain)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(REQUEST)
        with s.makefile("rb") as f:
            for line in f:
                yield json.loads(line)


def request_drain(path: str, say: Callable[[str], None], timeout: float | None = None) -> int:
    """`strata drain`: `ask_drain`, one line said per reply. Returns 0 when the instance drained,
    1 when requests were still open at its bound or it cannot be reached."""
    last: dict = {}
    try:
        for last in ask_drain(path, timeout):
            say(_describe(last))
    except OSError as exc:
        say(f"drain: cannot reach the instance at {path}: {exc.strerror or exc}")
        return 1
    if last.get("state") in ("drained", "timed_out"):
        return 0 if last["state"] == "drained" else 1
    if last.get("state") != "error":
        say("drain: the instance closed the connection before the drain was over")
    return 1


def _describe(m: dict) -> str:
    if m.get("state") == "draining":
        return (
            f"drain: {m['instance']} ({m['role']}) draining: {m['open']} requests open, "
            f"up to {m['timeout_s']:g}s"
        )
    if m.get("state") == "drained":
        return f"drain: drained in {m['seconds']:.2f}s; the instance stops (exit code 75)"
    if m.get("state") == "timed_out":
        return (
            f"drain: {m['open']} requests still open after {m['seconds']:.2f}s; the instance "
            "stops and their streams fail over to another instance"
        )
    return f"drain: {m.get('error', m)}"
