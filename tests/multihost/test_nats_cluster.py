"""A 3-node NATS cluster with JetStream across three namespace hosts, secured as deployed (per-role
users and permissions, authenticated routes): the KV-event stream and
the registry are R3 (``js_replicas=3``); the scheduler's followers (`follow_kv_events`,
`watch_registry`) run on a fourth host, connected through the seed list of all three servers.
Killing a node under a steady publisher loses no event (publishes retried with a message id,
so none is stored twice), the follower's index gets every one, and the registry keeps the record
written before the kill and takes one written after it. The node killed is the KV-event
stream's leader (a leader election under the publisher), or the one holding the registry
watcher's consumer while the scheduler's own connection is on another node (no reconnect tells
the watcher; its missed heartbeats must)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from services.scheduler.app import follow_kv_events, watch_registry
from shared import bus
from shared.kv_events_stream import ensure_kv_events_stream
from shared.nats_auth import NatsAuth
from shared.protocol import subjects
from shared.protocol.sched import InstanceRecord
from shared.registry import read_registry, register_instance
from tests.multihost.hosts import NatsCluster
from tests.multihost.netns import Net
from tests.scheduler.test_nats_restart import Core, event

pytestmark = pytest.mark.timeout(150)

NATS_HOSTS = (1, 2, 3)
CLIENT_HOST = 4
EVENTS = 120


async def until(cond, what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if await cond():
            return
        await asyncio.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


async def publish_retrying(js, seq: int) -> None:
    """What a careful publisher does while a stream changes leader: retry the same message id
    until the stream acknowledges it (the duplicate window drops a retry that did land)."""
    for _ in range(100):
        try:
            await js.publish(
                subjects.kv_events("decode-0"),
                event(seq),
                timeout=2,
                headers={"Nats-Msg-Id": f"decode-0:{seq}"},
            )
            return
        except Exception:  # noqa: BLE001 - timeout / no responders during the election
            await asyncio.sleep(0.2)
    raise AssertionError(f"event {seq} never acknowledged")


async def retrying(call, what: str, timeout: float = 30.0):
    """A JetStream API call made after the kill: the stream or consumer it reaches may be
    mid-election (a request then times out), so retry it as a client would."""
    end = time.monotonic() + timeout
    while True:
        try:
            return await call()
        except Exception as e:  # noqa: BLE001 - timeout / no responders during the election
            if time.monotonic() > end:
                raise AssertionError(f"{what}: still failing after {timeout:.0f} s: {e!r}") from e
            await asyncio.sleep(0.5)


async def registry_holding(js, want: set[str], timeout: float = 30.0) -> dict:
    """The registry as stored, read until it holds `want` or the deadline passes (then the last
    read, for the test's assertion to name). Right after a node dies, nats-py's `keys()` on the
    bucket can answer "no keys" (`read_registry` gives {}) while the new stream leader catches up:
    a transient answer a client retries, not a lost record; a record really lost never shows."""
    end = time.monotonic() + timeout
    while True:
        records = await retrying(lambda: read_registry(js), "reading the registry after the kill")
        if want <= set(records) or time.monotonic() > end:
            return records
        await asyncio.sleep(0.5)


async def scenario(net: Net, cluster: NatsCluster, victim: str) -> dict:
    seeds = cluster.url
    pw = cluster.passwords  # the scheduler's user observes, decode's publishes and registers
    nc = await bus.connect(
        seeds, "scheduler-mh", NatsAuth(user="scheduler", password=pw["scheduler"])
    )
    pub = await bus.connect(seeds, "decode-mh", NatsAuth(user="decode", password=pw["decode"]))
    js, pjs = nc.jetstream(), pub.jetstream()

    async def stream_ready() -> bool:
        try:
            await ensure_kv_events_stream(js, replicas=3)
            return True
        except Exception:  # noqa: BLE001 - the cluster is still electing its meta leader
            return False

    await until(stream_ready, "the R3 stream (cluster formed)")
    core, stops, watchers = Core(), [], []
    sub, replayed = await follow_kv_events(js, core, 1, replicas=3)
    await replayed.wait()
    reg_stream = f"KV_{subjects.REGISTRY_BUCKET}"

    def start_watcher() -> None:
        stops.append(asyncio.Event())
        watchers.append(asyncio.create_task(watch_registry(js, core, stops[-1], replicas=3)))

    async def consumers() -> dict[str, str]:
        """The registry stream's consumers: name -> the node holding it."""
        with contextlib.suppress(Exception):
            return {c.name: c.cluster.leader for c in await js.consumers_info(reg_stream)}
        return {}

    async def watcher_off_its_connections_node() -> str:
        """Start watchers until one's consumer sits on another node than the scheduler's
        connection (placement is the cluster's choice); that node's name."""
        for _ in range(20):
            before = await consumers()
            start_watcher()
            new: dict[str, str] = {}
            for _ in range(100):
                new = {n: h for n, h in (await consumers()).items() if n not in before}
                if new and all(new.values()):
                    break
                await asyncio.sleep(0.1)
            (host,) = new.values() or ("",)
            if host and nc.connected_url.hostname != net.addr(int(host[1:])):
                return host
            stops[-1].set()
            await watchers[-1]
        pytest.fail("every registry watcher's consumer landed on the scheduler's own node")

    if victim == "stream-leader":
        start_watcher()
    try:
        await register_instance(
            pjs, InstanceRecord(instance_id="decode-0", role="decode", incarnation="a"), replicas=3
        )
        info = await js.stream_info(subjects.KV_EVENTS_STREAM)
        reg = await js.stream_info(reg_stream)
        leader = info.cluster.leader
        if victim == "registry-consumer":
            leader = await watcher_off_its_connections_node()
        for seq in range(1, EVENTS + 1):
            if seq == EVENTS // 2:
                cluster.kill(leader)
            await publish_retrying(pjs, seq)
            await asyncio.sleep(0.01)
        await retrying(
            lambda: register_instance(
                pjs,
                InstanceRecord(instance_id="decode-1", role="decode", incarnation="b"),
                replicas=3,
            ),
            "registering decode-1 after the kill",
        )

        async def all_applied() -> bool:
            return len(core.events) >= EVENTS and "decode-1" in core.records

        try:
            await until(all_applied, "every event and the new record at the follower")
        except pytest.fail.Exception as e:
            raise AssertionError(
                f"{e}: killed {leader} ({victim}); {len(core.events)} of {EVENTS} events, "
                f"records {sorted(core.records)}"
            ) from None
        after = await retrying(
            lambda: js.stream_info(subjects.KV_EVENTS_STREAM), "the stream's info after the kill"
        )
        records = await registry_holding(js, {"decode-0", "decode-1"})
        return {
            "replicas": (info.config.num_replicas, reg.config.num_replicas),
            "peers": len(info.cluster.replicas or []),
            "killed": leader,
            "new_leader": after.cluster.leader,
            "stored": after.state.messages,
            "events": list(core.events),
            "records": sorted(records),
            "urls": [str(nc.connected_url.netloc), str(pub.connected_url.netloc)],
        }
    finally:
        for stop in stops:
            stop.set()
        await asyncio.gather(*watchers, return_exceptions=True)
        for c in (nc, pub):
            await c.close()


@pytest.mark.parametrize("victim", ["stream-leader", "registry-consumer"])
def test_losing_one_nats_node_loses_no_kv_event_or_registry_record(net_factory, tmp_path, victim):
    net = net_factory(4)
    cluster = NatsCluster(net, tmp_path, NATS_HOSTS)
    t0 = time.monotonic()
    out = net.run_in(CLIENT_HOST, lambda: asyncio.run(scenario(net, cluster, victim)))
    print(
        f"killed stream leader {out['killed']}, new leader {out['new_leader']}, "
        f"clients on {out['urls']}, {time.monotonic() - t0:.1f}s"
    )
    assert out["replicas"] == (3, 3) and out["peers"] == 2
    assert out["new_leader"] != out["killed"]
    killed_addr = net.addr(int(out["killed"][1:]))
    assert all(not u.startswith(killed_addr) for u in out["urls"])  # on survivors now
    assert out["stored"] == EVENTS  # none lost, none stored twice
    assert sorted(out["events"]) == list(range(1, EVENTS + 1))  # the index saw each once
    assert {"decode-0", "decode-1"} <= set(out["records"])
