"""Automatic restarts behind `strata up` (``Cluster(restart=True)``): exponential backoff per
process, a give-up rule for processes that cannot start, and the launcher's restart metrics.

`Backoff` (one process's restart state) and `Watchdog.tick` (one pass over every watched
process, with the clock passed in) are pure and tested directly with fake units; `Watchdog.run`
calls ``tick`` from a thread. A unit is anything with the small `Unit` interface: a supervised
service, nats-server or MinIO (`services.launcher` adapts each).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class RestartPolicy:
    """When and how often a crashed process is started again."""

    initial_backoff: float = 0.5
    """Seconds before the first restart after a stable run."""
    max_backoff: float = 30.0
    """The backoff doubles per crash up to this many seconds."""
    stable_after: float = 60.0
    """A run this long resets the backoff (and the start-failure count)."""
    max_start_failures: int = 5
    """Give up after this many exits in a row before the process was ready."""


@dataclass(frozen=True)
class Decision:
    """What to do about one exit: restart after ``delay`` s (restart number ``restarts``), or
    give up (``restart`` False) for the reason ``why``."""

    restart: bool
    delay: float
    restarts: int
    why: str = ""


class Backoff:
    """One process's restart state: feed it each exit, it says whether and when to restart."""

    def __init__(self, policy: RestartPolicy):
        self.policy = policy
        self.delay = policy.initial_backoff
        self.restarts = 0
        self.start_failures = 0

    def on_exit(self, ran_s: float, was_ready: bool) -> Decision:
        """The process exited after running ``ran_s`` seconds; ``was_ready``: it had printed
        its ready line (a crash before that counts toward giving up)."""
        p = self.policy
        if ran_s >= p.stable_after:
            self.delay = p.initial_backoff
            self.start_failures = 0
        self.start_failures = 0 if was_ready else self.start_failures + 1
        if self.start_failures >= p.max_start_failures:
            return Decision(
                False, 0.0, self.restarts, f"{self.start_failures} failed starts in a row"
            )
        delay = self.delay
        self.delay = min(delay * 2, p.max_backoff)
        self.restarts += 1
        return Decision(True, delay, self.restarts)


class Unit(Protocol):
    """A watched process as the watchdog sees it."""

    name: str
    role: str
    """Units of one role stand in for each other (decode-0, decode-1)."""
    required: bool
    """The cluster cannot serve once every unit of this role is given up."""

    def wanted(self) -> bool:
        """False while the process is stopped or killed on purpose (then it is left alone)."""

    def alive(self) -> bool: ...

    def ready(self) -> bool: ...

    def exit_code(self) -> int | None: ...

    def why(self) -> str:
        """One line on why it stopped (its STRATA_FATAL line, or its last log line)."""

    def start(self) -> None:
        """Start it again (same name, ports and settings); may block while it binds."""


@dataclass
class _State:
    backoff: Backoff
    started: float
    due: float | None = None  # restart time while waiting out a backoff
    given_up: bool = False


@dataclass
class Watchdog:
    """Restarts units that exit on their own; ``say`` gets one line per event."""

    units: list[Unit]
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    say: Callable[[str], None] = print
    fatal: str = ""
    """Set (one line) once a required role has no unit left: the cluster cannot serve."""

    def __post_init__(self) -> None:
        self._state: dict[str, _State] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def restarts(self) -> dict[str, int]:
        """Restarts so far per unit name (the launcher's ``strata_launcher_restarts_total``)."""
        return {
            u.name: self._state[u.name].backoff.restarts if u.name in self._state else 0
            for u in self.units
        }

    def given_up(self) -> list[str]:
        return [n for n, s in self._state.items() if s.given_up]

    def _st(self, u: Unit, now: float) -> _State:
        if u.name not in self._state:
            self._state[u.name] = _State(Backoff(self.policy), now)
        return self._state[u.name]

    def tick(self, now: float) -> None:
        """One pass: note exits, restart those whose backoff has passed, give up on units that
        cannot start (and set ``fatal`` when that leaves a required role with none)."""
        for u in list(self.units):
            st = self._st(u, now)
            if st.given_up or not u.wanted():
                st.due = None
                continue
            if st.due is None:
                if u.alive():
                    continue
                d = st.backoff.on_exit(now - st.started, u.ready())
                code = u.exit_code()
                if not d.restart:
                    st.given_up = True
                    self.say(
                        f"{u.name} exited with code {code}; giving up after {d.why} "
                        f"(last: {u.why() or 'no output'})"
                    )
                    self._check_role(u)
                    continue
                self.say(
                    f"{u.name} exited with code {code}; restarting (restart {d.restarts}, "
                    f"backoff {d.delay:.1f}s)"
                )
                st.due = now + d.delay
            if now >= st.due:
                st.due = None
                st.started = now
                try:
                    u.start()
                except Exception as exc:  # noqa: BLE001 - a failed start is one more failure
                    self.say(f"{u.name} could not be started: {exc}")

    def _check_role(self, u: Unit) -> None:
        same = [x for x in self.units if x.role == u.role]
        gone = all(x.name in self._state and self._state[x.name].given_up for x in same)
        if u.required and gone and not self.fatal:
            self.fatal = f"no {u.role} left: {u.name} cannot start (required role)"
            self.say(self.fatal)

    # ---- thread ----
    def start(self, interval: float = 0.1) -> Watchdog:
        self._thread = threading.Thread(
            target=self._run, args=(interval,), name="watchdog", daemon=True
        )
        self._thread.start()
        return self

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.tick(time.monotonic())

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(30)


def serve_restart_metrics(watchdog: Watchdog, host: str, port: int) -> int:
    """Serve ``strata_launcher_restarts_total{service}`` on ``host:port`` (0 = a free port);
    returns the port."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.core import CounterMetricFamily

    class _Collector:
        def collect(self):
            fam = CounterMetricFamily(
                "strata_launcher_restarts",
                "Automatic restarts by the launcher per service",
                labels=["service"],
            )
            for name, n in sorted(watchdog.restarts().items()):
                fam.add_metric([name], n)
            yield fam

    reg = CollectorRegistry()
    reg.register(_Collector())
    server, _ = start_http_server(port, addr=host, registry=reg)
    return server.server_port


class ServiceUnit:
    """A `Supervisor` process as a watchdog unit; ``start`` runs ``spec`` again under the
    same name (non-blocking: readiness is its ``STRATA_READY`` line)."""

    def __init__(self, sup, spec, required: bool):
        self.sup, self.spec, self.required = sup, spec, required
        self.name = spec.name
        self.role = spec.name.rsplit("-", 1)[0]

    def wanted(self) -> bool:
        return self.sup.wanted(self.name)

    def alive(self) -> bool:
        return self.sup.procs[self.name].alive()

    def ready(self) -> bool:
        return self.sup.procs[self.name].ready.is_set()

    def exit_code(self) -> int | None:
        return self.sup.procs[self.name].returncode

    def why(self) -> str:
        p = self.sup.procs[self.name]
        p._eof.wait(2.0)
        return p.fatal or (p.tail[-1] if p.tail else "")

    def start(self) -> None:
        self.sup.procs[self.name].finish()
        self.sup.start(self.spec)


class ServerUnit:
    """nats-server or MinIO (`NatsServer` / `MinioServer`) as a watchdog unit: ``start``
    starts it again on the same port and data dir (blocks until it answers)."""

    def __init__(self, name: str, server, log_file, required: bool):
        self.name, self.role, self.server, self.log_file = name, name, server, log_file
        self.required = required
        self.ok = True  # started and answering (False from a failed start until the next)

    def wanted(self) -> bool:
        return True  # the launcher stops the watchdog before it stops the servers

    def alive(self) -> bool:
        return self.server.proc is not None and self.server.proc.poll() is None

    def ready(self) -> bool:
        return self.ok

    def exit_code(self) -> int | None:
        return None if self.server.proc is None else self.server.proc.poll()

    def why(self) -> str:
        return f"see logs/{self.name}.log"

    def start(self) -> None:
        if self.server.proc is not None:
            self.server.stop()  # reap what is left of the old process group
        self.ok = False
        self.server.start(self.log_file)
        self.ok = True
