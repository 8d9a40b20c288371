"""Weighted fair queuing between tenants: start-time fair queuing (plain Python, no clock).

Each request gets a *start tag* when it arrives: ``max(V, F[tenant])``, where ``V`` is the
virtual time (the start tag of the last request served) and ``F[tenant]`` the tenant's finish
tag, which then advances by ``cost / weight``. Serving waiting requests in start-tag order gives
each backlogged tenant a share of service proportional to its weight, whatever the arrival rates
(Goyal, Vin and Cheng, "Start-time Fair Queueing", SIGCOMM 1996). A tenant that was idle starts
again at ``V``: it gets no credit for the time it sent nothing, so it cannot then take the
whole capacity for a burst.

The engine scheduler orders its waiting queue by ``(priority, start tag, arrival)``, so
priority classes still win across classes and fairness orders each class (`tag`, `served`).
`FairQueue.push` / `pop` is the same policy as a self-contained queue (tests, the simulator).
With ``enabled=False`` every tag is 0 and the order falls back to arrival (FIFO).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Any

DEFAULT_TENANT = "default"
"""The tenant of a request that names none (auth off, an internal caller)."""


@dataclass(frozen=True)
class Tenant:
    """Who a request belongs to and its share: ``weight`` 2 gets twice the service of 1."""

    name: str = DEFAULT_TENANT
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"tenant {self.name!r}: weight must be > 0 (got {self.weight!r})")


class FairQueue:
    """Start tags per tenant (`tag`) and the virtual time (`served`); see the module doc."""

    PRUNE_AT = 256  # tenants remembered before those with nothing past ``V`` are forgotten

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.vtime = 0.0
        self._finish: dict[str, float] = {}
        self._heap: list[tuple[int, float, int, Any]] = []
        self._order = itertools.count()

    def tag(self, tenant: Tenant, cost: float = 1.0) -> float:
        """The start tag of a request of ``cost`` service units arriving now for ``tenant``."""
        if not self.enabled:
            return 0.0
        start = max(self.vtime, self._finish.get(tenant.name, 0.0))
        self._finish[tenant.name] = start + cost / tenant.weight
        return start

    def served(self, start: float) -> None:
        """A request with start tag ``start`` was taken into service: the virtual time moves
        up to it (never back: a preempted request served again carries its old tag)."""
        if start <= self.vtime:
            return
        self.vtime = start
        if len(self._finish) > self.PRUNE_AT:  # a forgotten tenant restarts at V: the same
            self._finish = {t: f for t, f in self._finish.items() if f > self.vtime}

    def finish_tag(self, tenant: str) -> float:
        """Where ``tenant``'s next request would start if ``V`` were 0 (for tests and metrics)."""
        return self._finish.get(tenant, 0.0)

    # ----- a self-contained queue ------------------------------------------------------------
    def push(self, item: Any, tenant: Tenant, cost: float = 1.0, priority: int = 0) -> None:
        """Queue ``item``; lower ``priority`` numbers are served first, whatever the tags."""
        heapq.heappush(self._heap, (priority, self.tag(tenant, cost), next(self._order), item))

    def pop(self) -> Any:
        """The next item to serve (IndexError when empty)."""
        _, start, _, item = heapq.heappop(self._heap)
        self.served(start)
        return item

    def __len__(self) -> int:
        return len(self._heap)
