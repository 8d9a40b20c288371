"""Cluster-level acceptance tests of the scheduler: a real subprocess cluster (`Cluster`, the
tiny default model, ``torch_threads=1``) per test, driven through the REST gateway, with helpers
to scrape a service's Prometheus metrics and follow `SchedulerState` on NATS."""

from __future__ import annotations

import asyncio
import re
import threading
import urllib.request

import pytest

from loadtests.simulator.realcluster import start_cluster
from services.cluster_config import ensure_model
from services.launcher import Cluster
from shared.protocol import subjects
from shared.protocol.codec import decode
from shared.protocol.sched import SchedulerState

__all__ = ["start_cluster", "scrape", "StateWatcher", "API_KEY", "AUTH"]

API_KEY = "sk-fault-tests"
"""The gateway key of the fault tests' clusters: they run the secured deployment (NATS users,
KV mTLS by default, and this key on the gateway)."""
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    return ensure_model("")


def scrape(c: Cluster, name: str, metric: str) -> dict[str, float]:
    """Every sample of ``metric`` exposed by service ``name``: {label string: value}."""
    port = c.specs[name].env["STRATA_METRICS_PORT"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(metric)}(\{{[^}}]*\}})? (\S+)$", line)
        if m:
            out[m.group(1) or ""] = float(m.group(2))
    return out


class StateWatcher:
    """Records every `SchedulerState` (time, degrade level) published on NATS, in a thread, and
    every instance any of them listed as down (``down_seen``)."""

    def __init__(self, nats_url: str, auth=None) -> None:
        import time

        self._time = time.monotonic
        self.levels: list[tuple[float, int]] = []
        self.down_seen: set[str] = set()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._run(nats_url, auth)), daemon=True
        )
        self._thread.start()
        assert self._ready.wait(10), "could not subscribe to scheduler state"

    async def _run(self, url: str, auth) -> None:
        from shared.bus import connect

        nc = await connect(url, name="test-state-watcher", auth=auth)

        async def on_state(msg) -> None:
            st = decode(msg.data, SchedulerState)
            self.levels.append((self._time(), st.degrade_level))
            self.down_seen.update(st.down)

        await nc.subscribe(subjects.SCHED_STATE, cb=on_state)
        await nc.flush()
        self._ready.set()
        while not self._stop.is_set():
            await asyncio.sleep(0.05)
        await nc.drain()

    @property
    def level(self) -> int:
        return self.levels[-1][1] if self.levels else 0

    def max_level(self, since: float = 0.0) -> int:
        return max((lv for t, lv in self.levels if t >= since), default=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
