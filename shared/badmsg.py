"""Messages that fail validation: counted per subscription, logged as rate-limited one-liners.

A publisher that sends garbage (a bug, or anyone with publish rights on a subject) must cost
the receiver one counter increment per message, not a traceback in its log: `BadMessages`
keeps at most one line per subscription every ``interval`` seconds, naming how many more came
since the last line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pydantic import ValidationError


def one_line(exc: BaseException) -> str:
    """A short single-line reason for a decode or validation failure."""
    if isinstance(exc, ValidationError):
        errs = exc.errors()
        parts = [f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in errs[:3]]
        more = f" (+{len(errs) - 3} more)" if len(errs) > 3 else ""
        return "; ".join(parts) + more
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:300]


class BadMessages:
    """Counts bad messages in ``counter`` (a prometheus Counter with a ``subject`` label) and
    logs rate-limited warnings. ``subject`` labels are the subscription (a fixed pattern such as
    ``strata.kv.events.>``), so a publisher cannot grow the label set."""

    def __init__(
        self,
        counter,
        logger: logging.Logger,
        interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.counter = counter
        self.log = logger
        self.interval = interval
        self.clock = clock
        self._last: dict[str, float] = {}  # subscription -> when its last line was logged
        self._quiet: dict[str, int] = {}  # subscription -> bad messages since that line

    def report(self, subscription: str, subject: str, why: str) -> bool:
        """Count one bad message on ``subject`` (received through ``subscription``); returns
        True when a log line was written for it."""
        self.counter.labels(subject=subscription).inc()
        now = self.clock()
        last = self._last.get(subscription)
        if last is not None and now - last < self.interval:
            self._quiet[subscription] = self._quiet.get(subscription, 0) + 1
            return False
        quiet = self._quiet.pop(subscription, 0)
        self._last[subscription] = now
        more = f" ({quiet} more since the last report)" if quiet else ""
        self.log.warning("dropped a bad message on %s: %s%s", subject, why[:300], more)
        return True
