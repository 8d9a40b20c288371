"""Automatic restarts: the backoff rule and the watchdog's pass with fake units and a fake clock,
then the watchdog restarting a real dummy child under the `Supervisor` and serving its count."""

from __future__ import annotations

import sys
import time
import urllib.request

from services.infra.restart import (
    Backoff,
    RestartPolicy,
    ServiceUnit,
    Watchdog,
    serve_restart_metrics,
)
from services.infra.supervisor import ProcSpec, Supervisor


def test_backoff_doubles_to_the_cap_and_resets_after_a_stable_run():
    b = Backoff(RestartPolicy(initial_backoff=0.5, max_backoff=4.0, stable_after=60.0))
    delays = [b.on_exit(ran_s=5.0, was_ready=True).delay for _ in range(6)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    d = b.on_exit(ran_s=61.0, was_ready=True)  # a stable minute: back to the start
    assert (d.restart, d.delay, d.restarts) == (True, 0.5, 7)
    assert b.on_exit(ran_s=1.0, was_ready=True).delay == 1.0


def test_backoff_gives_up_after_failed_starts_in_a_row_only():
    b = Backoff(RestartPolicy(max_start_failures=3))
    assert b.on_exit(1.0, was_ready=False).restart
    assert b.on_exit(1.0, was_ready=False).restart
    assert b.on_exit(1.0, was_ready=True).restart  # it got ready once: the count starts over
    assert b.on_exit(1.0, was_ready=False).restart
    assert b.on_exit(1.0, was_ready=False).restart
    d = b.on_exit(1.0, was_ready=False)
    assert not d.restart and d.why == "3 failed starts in a row" and d.restarts == 5


class FakeUnit:
    def __init__(self, name: str, required: bool = True, starts_ok: bool = True):
        self.name, self.role, self.required = name, name.rsplit("-", 1)[0], required
        self.is_alive, self.is_ready, self.is_wanted = True, True, True
        self.starts_ok = starts_ok
        self.starts = 0

    def wanted(self) -> bool:
        return self.is_wanted

    def alive(self) -> bool:
        return self.is_alive

    def ready(self) -> bool:
        return self.is_ready

    def exit_code(self) -> int | None:
        return None if self.is_alive else -9

    def why(self) -> str:
        return "decode: bad setting STRATA_X"

    def start(self) -> None:
        self.starts += 1
        self.is_alive, self.is_ready = self.starts_ok, self.starts_ok


def test_watchdog_restarts_after_the_backoff_and_says_so():
    lines: list[str] = []
    u = FakeUnit("decode-0")
    w = Watchdog([u], RestartPolicy(initial_backoff=0.5), say=lines.append)
    w.tick(0.0)
    u.is_alive = False
    w.tick(10.0)  # exit noted: restart due at 10.5
    assert lines == ["decode-0 exited with code -9; restarting (restart 1, backoff 0.5s)"]
    w.tick(10.4)
    assert u.starts == 0
    w.tick(10.5)
    assert u.starts == 1 and u.is_alive
    u.is_alive = False
    w.tick(12.0)
    w.tick(13.0)
    assert lines[-1] == "decode-0 exited with code -9; restarting (restart 2, backoff 1.0s)"
    assert u.starts == 2 and w.restarts() == {"decode-0": 2} and not w.fatal


def test_watchdog_leaves_units_stopped_on_purpose_alone():
    u = FakeUnit("decode-0")
    w = Watchdog([u], say=lambda line: None)
    w.tick(0.0)
    u.is_alive, u.is_wanted = False, False  # Cluster.kill / stop_service
    for t in range(1, 40):
        w.tick(float(t))
    assert u.starts == 0 and w.restarts() == {"decode-0": 0}


def test_watchdog_gives_up_on_a_unit_that_cannot_start_and_flags_a_required_role():
    lines: list[str] = []
    d0, d1 = FakeUnit("decode-0", starts_ok=False), FakeUnit("decode-1", starts_ok=False)
    w = Watchdog(
        [d0, d1], RestartPolicy(initial_backoff=0.5, max_start_failures=3), say=lines.append
    )
    w.tick(0.0)
    d0.is_alive = d0.is_ready = False
    t = 0.0
    while "decode-0" not in w.given_up():
        t += 0.25
        w.tick(t)
        assert t < 60
    assert d0.starts == 2  # the first exit (not ready) + 2 failed restarts = 3 in a row
    assert lines[-1] == (
        "decode-0 exited with code -9; giving up after 3 failed starts in a "
        "row (last: decode: bad setting STRATA_X)"
    )
    assert not w.fatal  # decode-1 still serves
    d1.is_alive = d1.is_ready = False
    while "decode-1" not in w.given_up():
        t += 0.25
        w.tick(t)
    assert w.fatal == "no decode left: decode-1 cannot start (required role)"
    for _ in range(10):
        t += 5
        w.tick(t)
    assert (d0.starts, d1.starts) == (2, 2)  # given up: never started again


def test_optional_role_given_up_is_not_fatal():
    u = FakeUnit("vision-0", required=False, starts_ok=False)
    w = Watchdog([u], RestartPolicy(max_start_failures=1), say=lambda line: None)
    w.tick(0.0)
    u.is_alive = u.is_ready = False
    w.tick(1.0)
    assert w.given_up() == ["vision-0"] and not w.fatal


def test_watchdog_restarts_a_killed_child_and_serves_the_count():
    sup = Supervisor()
    code = "import time; print('STRATA_READY', flush=True); time.sleep(600)"
    spec = ProcSpec("svc-0", [sys.executable, "-c", code])
    sup.start(spec)
    sup.wait_ready(["svc-0"], 20)
    lines: list[str] = []
    w = Watchdog(
        [ServiceUnit(sup, spec, required=True)],
        RestartPolicy(initial_backoff=0.05),
        say=lines.append,
    ).start(0.02)
    try:
        port = serve_restart_metrics(w, "127.0.0.1", 0)
        first = sup.procs["svc-0"].pid
        sup.procs["svc-0"].signal(9)  # a crash: not marked as on purpose
        deadline = time.monotonic() + 20
        while sup.procs["svc-0"].pid == first or not sup.procs["svc-0"].ready.is_set():
            assert time.monotonic() < deadline, lines
            time.sleep(0.05)
        assert lines == ["svc-0 exited with code -9; restarting (restart 1, backoff 0.1s)"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
        assert 'strata_launcher_restarts_total{service="svc-0"} 1.0' in text
        sup.kill("svc-0")  # on purpose: stays down
        sup.procs["svc-0"].proc.wait(5)
        time.sleep(0.3)
        assert not sup.procs["svc-0"].alive() and len(lines) == 1
    finally:
        w.stop()
        sup.stop_all(timeout=5)
