"""The scheduler's JetStream followers survive a nats-server restart (same port, same data dir,
as `strata up` restarts it): the KV-event follower (`follow_kv_events`, an ordered consumer)
applies events published after the restart, and the registry watcher (`watch_registry`, an
ordered consumer too) sees records and deletions written after it, past a record that does not
decode. Its own nats-server, killed with SIGKILL and started again. The ordered consumers are
recreated by nats-py after two missed heartbeats (1 s each here, `KV_EVENTS_HEARTBEAT_S`), so the
event arrives about 3 s after the restart."""

from __future__ import annotations

import asyncio
import signal
import uuid

import pytest

from services.infra.nats_server import start_nats
from services.infra.procs import signal_group
from services.scheduler import metrics
from services.scheduler.app import follow_kv_events, watch_registry
from shared import bus
from shared.protocol import subjects
from shared.protocol.codec import encode
from shared.protocol.kv import KVEvent
from shared.protocol.sched import InstanceRecord
from shared.registry import deregister_instance, register_instance, registry_bucket

pytestmark = pytest.mark.timeout(120)


class Core:
    """What the followers call on the scheduler's core, recorded."""

    def __init__(self) -> None:
        self.kv_seq = 0
        self.events: list[int] = []
        self.records: list[str] = []
        self.deleted: list[str] = []

    def on_kv_event(self, ev: KVEvent) -> None:
        self.events.append(ev.seq)

    def on_record(self, rec: InstanceRecord) -> None:
        self.records.append(rec.instance_id)

    def on_deregister(self, key: str) -> None:
        self.deleted.append(key)


def event(seq: int) -> bytes:
    return encode(
        KVEvent(
            instance_id="decode-0",
            incarnation="x",
            seq=seq,
            tier="engine",
            kind="stored",
            hashes=[uuid.uuid4().hex],
        )
    )


async def _until(cond, what: str, timeout: float = 60.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if cond():
            return
        await asyncio.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


async def test_kv_event_follower_and_registry_watcher_recover_after_nats_restart(tmp_path):
    server = start_nats(data_dir=str(tmp_path / "nats"))
    port, data_dir = server.port, server.data_dir
    nc = await bus.connect(server.url, "scheduler-test")
    pub = await bus.connect(server.url, "decode-test")
    js, pjs = nc.jetstream(), pub.jetstream()
    core, stop = Core(), asyncio.Event()
    sub, replayed = await follow_kv_events(js, core)
    await replayed.wait()
    watcher = asyncio.create_task(watch_registry(js, core, stop))
    try:
        await pjs.publish(subjects.kv_events("decode-0"), event(1))
        await register_instance(
            pjs, InstanceRecord(instance_id="decode-0", role="decode", incarnation="a")
        )
        await _until(lambda: core.events == [1] and core.records == ["decode-0"], "before")
        signal_group(server.proc.pid, signal.SIGKILL)
        server.proc.wait(5)
        await asyncio.sleep(1.0)
        server = start_nats(port=port, data_dir=data_dir)
        await _until(lambda: nc.is_connected and pub.is_connected, "the reconnect")
        await pjs.publish(subjects.kv_events("decode-0"), event(2))
        await register_instance(
            pjs, InstanceRecord(instance_id="decode-1", role="decode", incarnation="b")
        )
        await _until(lambda: core.events[-1:] == [2], "an event after the restart")
        await _until(lambda: "decode-1" in core.records, "a record after the restart")
        assert core.events == [1, 2] and core.kv_seq == 2  # none lost, none applied twice
        await (await registry_bucket(pjs)).put("junk", b"\xc1 not msgpack")  # counted, skipped
        await deregister_instance(pjs, "decode-0")
        await register_instance(
            pjs, InstanceRecord(instance_id="decode-2", role="decode", incarnation="c")
        )
        await _until(lambda: "decode-2" in core.records, "a record after a bad one")
        assert core.deleted == ["decode-0"] and "junk" not in core.records
    finally:
        stop.set()
        await asyncio.gather(watcher, return_exceptions=True)
        await sub.unsubscribe()
        for c in (nc, pub):
            await c.close()
        server.stop()


async def test_registry_watcher_started_while_jetstream_does_not_answer_keeps_trying(tmp_path):
    """Its consumer cannot be made at first (the server is down: as an R3 bucket just created,
    or a node lost under it, answers for a moment). The watcher keeps trying instead of ending
    (the scheduler would never hear of an instance that joins later), and applies the record
    written once the server is back."""
    server = start_nats(data_dir=str(tmp_path / "nats"))
    port, data_dir = server.port, server.data_dir
    nc = await bus.connect(server.url, "scheduler-test")
    core, stop = Core(), asyncio.Event()
    retries = metrics.REGISTRY_WATCH_RETRIES._value.get()
    signal_group(server.proc.pid, signal.SIGKILL)
    server.proc.wait(5)
    watcher = asyncio.create_task(watch_registry(nc.jetstream(timeout=0.5), core, stop))
    try:
        await _until(lambda: metrics.REGISTRY_WATCH_RETRIES._value.get() >= retries + 2, "retries")
        assert not watcher.done()
        server = start_nats(port=port, data_dir=data_dir)
        pub = await bus.connect(server.url, "decode-test")
        try:
            await register_instance(
                pub.jetstream(),
                InstanceRecord(instance_id="decode-0", role="decode", incarnation="a"),
            )
            await _until(
                lambda: core.records == ["decode-0"], "the record after the server came back"
            )
        finally:
            await pub.close()
    finally:
        stop.set()
        await asyncio.gather(watcher, return_exceptions=True)
        await nc.close()
        server.stop()
