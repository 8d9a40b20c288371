"""`Heartbeat` against a real nats-server: load reports keep flowing while the main event loop is
blocked (as a forward run on it, or a wait for one, would block it), a failing ``build`` costs
one beat and not the thread, and ``connected`` carries what the builder reads."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
from prometheus_client import REGISTRY

from shared import bus
from shared.protocol.codec import decode
from shared.protocol.load import LoadReport
from shared.worker.heartbeat import Heartbeat

SUBJECT = "strata.load.prefill.hb-test"


async def test_beats_while_the_main_loop_is_blocked(nats_url):
    nc = await bus.connect(nats_url, "hb-test-sub")
    got: list[LoadReport] = []

    async def on_msg(msg) -> None:
        got.append(decode(msg.data, LoadReport))

    await nc.subscribe(SUBJECT, cb=on_msg)
    await nc.flush()
    state = {"connected": True, "calls": 0}

    def build() -> LoadReport:
        state["calls"] += 1
        if state["calls"] == 2:
            raise ValueError("engine counters unreadable")  # one beat lost, not the thread
        return LoadReport(
            instance_id="hb-test",
            role="prefill",
            incarnation="i",
            ts=time.time(),
            connected=state["connected"],
        )

    def failures() -> float:
        labels = {"role": "prefill", "instance": "hb-test"}
        return REGISTRY.get_sample_value("strata_worker_heartbeat_failures_total", labels) or 0.0

    failed_before = failures()
    hb = Heartbeat(
        nats_url, "hb-test", SUBJECT, build, interval=0.05, labels=("prefill", "hb-test")
    )
    await asyncio.to_thread(hb.start)
    try:
        t0 = time.time()
        time.sleep(1.0)  # the main loop is stuck: no coroutine here can publish
        t1 = time.time()
        state["connected"] = False
        await asyncio.sleep(0.3)
        await nc.flush()
        await asyncio.sleep(0.1)
    finally:
        await asyncio.to_thread(hb.stop)
        await nc.drain()
    during = [r for r in got if t0 <= r.ts <= t1]
    assert len(during) >= 3, [r.ts - t0 for r in got]  # built and sent by the thread meanwhile
    assert failures() == failed_before + 1
    assert got[0].connected and not got[-1].connected


def _voluntary_switches(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("voluntary_ctxt_switches:"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
async def test_the_thread_sleeps_between_beats(nats_url):
    """Between beats the thread is off the CPU: on a small box each wake-up takes a core from
    the engine's OpenMP team. Polling the stop flag every 50 ms, as before, woke it 20 times a
    second; now it wakes for the beats."""
    hb = Heartbeat(nats_url, "hb-idle", "strata.load.decode.hb-idle", _report, interval=0.5)
    await asyncio.to_thread(hb.start)
    try:
        await asyncio.sleep(0.3)  # past the first beat and the connection's start-up
        tid = hb._thread.native_id
        s0, beats0 = _voluntary_switches(tid), hb.beats
        await asyncio.sleep(2.0)
        switches, beats = _voluntary_switches(tid) - s0, hb.beats - beats0
    finally:
        await asyncio.to_thread(hb.stop)
    assert 3 <= beats <= 5
    assert switches <= 4 * beats, (switches, beats)  # polling: 40 and more in these 2 s


async def test_stop_wakes_the_thread_mid_interval(nats_url):
    """`stop` ends a thread that sleeps until its next beat, a minute away."""
    hb = Heartbeat(nats_url, "hb-stop", "strata.load.decode.hb-stop", _report, interval=60.0)
    await asyncio.to_thread(hb.start)
    await asyncio.sleep(0.3)
    await asyncio.to_thread(hb.stop, 10.0)
    assert not hb._thread.is_alive()
    assert hb.beats == 1


def _report() -> LoadReport:
    return LoadReport(instance_id="hb-idle", role="decode", incarnation="i", ts=time.time())
