"""Service lifecycle: uvloop, signals set a stop event, an exit stack, drain on the way out."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

READY_LINE = "STRATA_READY"
FATAL_LINE = "STRATA_FATAL"
"""Prefix of the one line a service prints when it cannot start (`strata serve` prints it for
a `StartupError`, a `CheckpointError` or a bad setting); `strata up` reports that line."""


class StartupError(RuntimeError):
    """A service cannot start; the message is one line naming the problem and the fix."""


def run(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run ``main(stop)`` on uvloop until SIGINT/SIGTERM sets ``stop``."""

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
    """One greppable line once subscriptions are live (`strata up` and tests wait for it)."""
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
