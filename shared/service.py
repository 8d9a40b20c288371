"""Service lifecycle: uvloop, signals set a stop event, an exit stack, drain on the way out."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable

from shared.heap import freeze_startup_heap, watch_gc_pauses

log = logging.getLogger(__name__)
_owns_process = False  # set by `run`: this process is one service's

READY_LINE = "STRATA_READY"
FATAL_LINE = "STRATA_FATAL"
"""Prefix of the one line a service prints when it cannot start (`strata serve` prints it for
a `StartupError`, a `CheckpointError` or a bad setting); `strata up` reports that line."""


class StartupError(RuntimeError):
    """A service cannot start; the message is one line naming the problem and the fix."""


def run(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run ``main(stop)`` on uvloop until SIGINT/SIGTERM sets ``stop``; the service owns the
    process: the garbage collector's pauses are measured and `announce_ready` freezes the
    start-up heap (`shared.heap`)."""
    global _owns_process
    _owns_process = True
    watch_gc_pauses()

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await main(stop)

    try:
        import uvloop

        uvloop.run(runner())
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep a fallback anyway
        asyncio.run(runner())


def announce_ready(role: str, instance: str, detail: str = "") -> None:
    """One greppable line once subscriptions are live (`strata up` and tests wait for it).
    In a process started by `run`, what start-up allocated is frozen out of the garbage
    collector's view first, so full collections stop walking it (`shared.heap`); a service
    run inside another process (a test's) leaves that process's collector alone."""
    if _owns_process:
        freeze_startup_heap()
    print(f"{READY_LINE} role={role} instance={instance} {detail}".rstrip(), flush=True)


async def periodic(interval: float, fn: Callable[[], Awaitable[None]], stop: asyncio.Event) -> None:
    """Call ``fn`` every ``interval`` seconds until ``stop``; errors are logged, not fatal."""
    while not stop.is_set():
        try:
            await fn()
        except Exception:  # noqa: BLE001
            log.warning("periodic task failed", exc_info=True)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)
