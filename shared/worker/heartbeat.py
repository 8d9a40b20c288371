"""Liveness that no forward can block: the load report (the heartbeat) is published from a thread
of its own, with its own event loop and its own NATS connection.

Why this shape. The scheduler declares an instance down after ``down_after`` report intervals
without a load report (1.5 s by default), while one forward of a long prefill chunk on a CPU
takes seconds. So nothing on the path from "time for a report" to "bytes on the socket" may
wait for a forward:

- not the engine thread: the report is built from lock-free reads of engine counters and queue
  lengths (`ModelRuntime.load_report`, an estimate, never used for correctness); work that must
  run on the engine thread (KV events, offering evicted blocks to the pool) runs in a separate
  periodic task on the main loop (`runtime.housekeeping`), where waiting costs nothing;
- not the main event loop: it serves submits, streams tokens and KV frames, and a burst of
  CPU-bound work there (decoding big messages, detokenizing many streams) would delay a
  coroutine heartbeat, and a report held in the main connection's write buffer behind megabytes
  of frames arrives late too. A thread with its own loop and connection shares nothing with it
  but the GIL, which torch releases inside kernels (the thread needs microseconds per beat).

The main connection's state rides along (``LoadReport.connected``): an instance whose main
connection is down (reconnecting) cannot take submits or publish tokens, so the scheduler stops
routing to it without declaring it down; this connection staying up keeps it a member.

What a beat does not prove: that forwards make progress. A wedged engine thread keeps beating;
the gateway's per-request first-token and stall timeouts fail such requests over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence

from prometheus_client import Counter

from shared import bus
from shared.protocol.base import Msg

log = logging.getLogger(__name__)

HEARTBEATS = Counter(
    "strata_worker_heartbeats_total",
    "Load reports published by the heartbeat thread",
    ["role", "instance"],
)
HEARTBEAT_FAILURES = Counter(
    "strata_worker_heartbeat_failures_total",
    "Load reports the heartbeat thread could not build or publish",
    ["role", "instance"],
)


class HeartbeatError(RuntimeError):
    """The heartbeat thread could not connect to NATS at start-up."""


class Heartbeat:
    """Publishes ``build()`` on ``subject`` every ``interval`` seconds from a dedicated thread.

    ``build`` runs on the heartbeat thread: it must not wait for the engine thread or the main
    event loop (read plain attributes only). `start` returns once the thread's own connection is
    up (or raises `HeartbeatError`); `stop` ends the thread and closes that connection.
    """

    def __init__(
        self,
        nats_url: str | Sequence[str],
        client_name: str,
        subject: str,
        build: Callable[[], Msg],
        interval: float,
        labels: tuple[str, str] = ("", ""),
    ):
        self.nats_url = nats_url if isinstance(nats_url, str) else ",".join(nats_url)
        self.client_name = client_name
        self.subject = subject
        self.build = build
        self.interval = interval
        self.labels = labels
        self.beats = 0
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None  # the thread's, once it runs
        self._wake: asyncio.Event | None = None  # set by `stop` on the thread's loop
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="strata-heartbeat", daemon=True)

    def start(self, timeout: float = 15.0) -> None:
        """Start the thread and wait until its own connection is up."""
        self._thread.start()
        if not self._ready.wait(timeout):
            self._stop.set()
            raise HeartbeatError(
                f"heartbeat: no NATS connection to {self.nats_url} within {timeout:.0f}s"
            )
        if self._error is not None:
            raise HeartbeatError(
                f"heartbeat: cannot connect to NATS at {self.nats_url}: {self._error}"
            ) from self._error

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop has already closed
                loop.call_soon_threadsafe(wake.set)
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ----- heartbeat thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # noqa: BLE001 - reported to start() or logged
            if not self._ready.is_set():
                self._error = exc
                self._ready.set()
            else:
                log.error("heartbeat thread ended: %s", exc)

    async def _main(self) -> None:
        # The wake-up event exists before the stop flag is read: a `stop` that finds no loop yet
        # set the flag before this thread's first check of it.
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        nc = await bus.connect(self.nats_url, self.client_name)
        self._ready.set()
        try:
            next_at = time.monotonic()
            while not self._stop.is_set():
                await self._beat(nc)
                # fixed cadence: a slow beat does not push every later one back
                next_at = max(next_at + self.interval, time.monotonic())
                # asleep until the next beat or `stop`: on a small box every wake-up of this
                # thread takes a core (and the GIL) from the engine's OpenMP team
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), next_at - time.monotonic())
        finally:
            await nc.close()

    async def _beat(self, nc) -> None:
        try:
            try:
                msg = self.build()
            except RuntimeError:  # a queue changed size under the lock-free read: read again
                msg = self.build()
            await bus.publish(nc, self.subject, msg)
        except Exception:  # noqa: BLE001 - the next beat tries again; reconnect is automatic
            HEARTBEAT_FAILURES.labels(*self.labels).inc()
            log.warning("heartbeat failed", exc_info=True)
            return
        self.beats += 1
        HEARTBEATS.labels(*self.labels).inc()
