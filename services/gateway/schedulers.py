"""Which scheduler replica a route request goes to (pure: no NATS, no clock of its own).

Every replica publishes its `SchedulerState` each ``state_interval`` and also answers routes on
its own subject (`subjects.sched_route`). The queue group alone is not enough when a replica's
host dies: its NATS server keeps the dead replica's queue subscription until it notices the
connection is gone (its ping interval: minutes by default), and meanwhile gives it its share
of the route requests, which then time out. A replica that stopped publishing its state is
left out here within about three of its state intervals instead.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable

_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,128}")


class SchedulerReplicas:
    """Replicas heard from, each with when its last state came and its cadence."""

    def __init__(self, stale_after: float = 1.5, rng: random.Random | None = None) -> None:
        """``stale_after``: seconds without a state after which a replica is left out (or three
        of its observed state intervals, whichever is longer)."""
        self.stale_after = stale_after
        self.rng = rng or random.Random()
        self._heard: dict[str, tuple[float, float]] = {}  # id -> (last state at, interval)

    def heard(self, scheduler_id: str, now: float) -> None:
        """A `SchedulerState` of ``scheduler_id`` arrived at ``now`` (ids that cannot be one
        subject token are ignored: routes to them use the queue group)."""
        if not _TOKEN.fullmatch(scheduler_id):
            return
        last, interval = self._heard.get(scheduler_id, (now, 0.0))
        self._heard[scheduler_id] = (now, now - last if now > last else interval)

    def live(self, now: float) -> list[str]:
        """The replicas whose state is fresh, in id order."""
        return sorted(
            sid
            for sid, (last, interval) in self._heard.items()
            if now - last <= max(self.stale_after, 3 * interval)
        )

    def pick(self, now: float, exclude: Iterable[str] = ()) -> str:
        """A fresh replica not in ``exclude``, at random (the load spreads as the queue group's
        would); "" when there is none: ask the queue group."""
        left = [sid for sid in self.live(now) if sid not in set(exclude)]
        return self.rng.choice(left) if left else ""
