"""`strata up --autoscale-max-decode N`: the launcher's half of autoscaling.

The scheduler (`services.scheduler.autoscale`) decides how many decode instances the load needs
and exports it as ``strata_scheduler_desired_instances{role="decode"}``; it also picks and
retires (drains, then stops) instances beyond the need itself. This loop, on a thread of the
launcher, reads that gauge from scheduler-0's metrics endpoint, as an HPA or KEDA would in
Kubernetes, and starts the decode instances missing to it (an instance still loading counts as
there). A retired instance's name is reused first, so instance ids stay small.
"""

from __future__ import annotations

import re
import threading
import urllib.request

GAUGE = "strata_scheduler_desired_instances"


def parse_need(text: str, role: str) -> int | None:
    """The desired instances of ``role`` in a Prometheus text exposition (None: not there)."""
    m = re.search(rf'^{GAUGE}\{{role="{role}"\}} (\S+)$', text, re.MULTILINE)
    return None if m is None else int(float(m.group(1)))


class LocalScaler:
    """Starts decode instances of ``cluster`` (a `services.launcher.Cluster`) up to the need
    scheduler-0 exports, never beyond ``limit``; ``say`` gets one line per start."""

    def __init__(self, cluster, limit: int, say, interval: float = 1.0) -> None:
        self.cluster, self.limit, self.say, self.interval = cluster, limit, say, interval
        self.starts = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def need(self) -> int | None:
        spec = self.cluster.specs.get("scheduler-0")
        if spec is None:
            return None
        url = f"http://{self.cluster.cfg.host}:{spec.env['STRATA_METRICS_PORT']}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=2.0) as r:
                return parse_need(r.read().decode(), "decode")
        except OSError:
            return None

    def tick(self) -> list[str]:
        """One pass; returns the instances it started."""
        need = self.need()
        if need is None:
            return []
        procs = self.cluster.sup.procs
        names = self.cluster.names("decode")
        up = [n for n in names if procs[n].alive()]  # ready or still loading
        idle = [n for n in names if not procs[n].alive() and procs[n].retired]
        started = []
        for _ in range(min(need, self.limit) - len(up)):
            if idle:
                name = idle.pop(0)
                self.cluster.restart(name, wait=False)
            else:
                name = self.cluster.start_service("decode", wait=False)
            started.append(name)
            self.starts += 1
            self.say(f"autoscale: starting {name} (the scheduler needs {need} decode instances)")
        return started

    def start(self) -> LocalScaler:
        self._thread = threading.Thread(target=self._run, name="autoscale", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.tick()
            except Exception as exc:  # noqa: BLE001 - a failed start: say so, try again later
                self.say(f"autoscale: {exc}")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
