"""Routes go to a scheduler replica whose state came lately (`SchedulerReplicas`), not to one
whose host died: its NATS server keeps the dead replica's queue subscription until it notices
(minutes), and the queue group alone gave it its share of the routes meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import random

import httpx

from services.gateway.schedulers import SchedulerReplicas
from shared import bus
from shared.protocol import subjects
from shared.protocol.sched import InstancesRequest, RouteRequest, SchedulerState
from tests.gateway.harness import gateway

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_fresh_replicas_are_picked_stale_ones_left_out():
    r = SchedulerReplicas(stale_after=1.5, rng=random.Random(0))
    assert r.pick(0.0) == ""  # none heard yet: the queue group
    r.heard("s-a", 0.0)
    r.heard("s-b", 0.0)
    r.heard("bad.id", 0.0)  # not one subject token: ignored
    assert r.live(1.0) == ["s-a", "s-b"]
    assert {r.pick(1.0) for _ in range(20)} == {"s-a", "s-b"}
    assert r.pick(1.0, exclude=["s-a"]) == "s-b"
    assert r.pick(1.0, exclude=["s-a", "s-b"]) == ""
    r.heard("s-b", 1.0)
    assert r.live(1.6) == ["s-b"]  # s-a silent for 1.6 s
    for t in (3.0, 5.0):  # s-b's cadence is 2 s: stale only after 3 of them
        r.heard("s-b", t)
    assert r.live(10.9) == ["s-b"] and r.live(11.1) == []


async def test_a_replica_that_went_silent_gets_no_routes(nats_url):
    """Two replicas announce themselves; one then goes silent with its subscriptions left on
    the server (a dead host): requests sent after are all routed by the other one, none waits
    for a route timeout; those sent while it still looked alive are asked once more."""
    async with gateway(nats_url, roles=("tokenizer",)) as (url, peers, _s):
        nc = peers.nc
        dead = await bus.connect(nats_url, "dead-replica")
        stop = asyncio.Event()

        held: list[str] = []

        async def never(msg) -> None:  # holds the requests it gets, like a dead host
            held.append(msg.subject)

        for subject, queue in (
            (subjects.SCHED_ROUTE, subjects.QUEUE_SCHEDULER),
            (subjects.sched_route("s-dead"), ""),
        ):
            await dead.subscribe(subject, queue=queue, cb=never)
        peers.subs.append(
            await bus.serve(
                nc, subjects.SCHED_ROUTE, RouteRequest, peers.route, subjects.QUEUE_SCHEDULER
            )
        )
        peers.subs.append(
            await bus.serve(nc, subjects.sched_route("s-live"), RouteRequest, peers.route)
        )
        peers.subs.append(
            await bus.serve(nc, subjects.SCHED_INSTANCES, InstancesRequest, peers.insts)
        )

        async def announce() -> None:
            while not stop.is_set():
                await bus.publish(nc, subjects.SCHED_STATE, SchedulerState(scheduler_id="s-live"))
                await asyncio.sleep(0.2)

        await bus.publish(dead, subjects.SCHED_STATE, SchedulerState(scheduler_id="s-dead"))
        await dead.flush()
        beat = asyncio.create_task(announce())
        try:
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                early = await asyncio.gather(
                    *(c.post("/v1/chat/completions", json=CHAT) for _ in range(6))
                )
                assert [r.status_code for r in early] == [200] * 6  # asked once more if need be
                await asyncio.sleep(1.7)  # s-dead's state is stale now
                before = len(held)
                late = await asyncio.gather(
                    *(c.post("/v1/chat/completions", json=CHAT) for _ in range(8))
                )
            assert [r.status_code for r in late] == [200] * 8
            assert len(held) == before, held[before:]  # none went to the silent replica
        finally:
            stop.set()
            await beat
            with contextlib.suppress(Exception):
                await dead.close()
