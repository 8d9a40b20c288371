"""The scheduler service against a real nats-server: registry, heartbeats, down detection,
incarnation change, route replies, the no-decode error and prefix-index rebuild by replay."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
import uuid

import pytest

from services.scheduler.app import run_scheduler
from services.scheduler.config import SchedulerConfig
from shared import bus
from shared.protocol import subjects
from shared.protocol.codec import decode
from shared.protocol.errors import StrataError
from shared.protocol.kv import KVEvent
from shared.protocol.load import LoadReport
from shared.protocol.sampling import SamplingParams
from shared.protocol.sched import (
    InstanceRecord,
    InstancesReply,
    InstancesRequest,
    RouteReply,
    RouteRequest,
    SchedulerState,
    routed_submit,
)
from shared.protocol.work import DecodeWork, PrefillWork, SubmitAck, WorkItem
from shared.registry import deregister_instance, read_registry, register_instance


@contextlib.asynccontextmanager
async def scheduler(nats_url, **over):
    cfg = SchedulerConfig.load(
        [],
        role="scheduler",
        nats_url=nats_url,
        load_interval=0.1,
        down_after=3,
        state_interval=0.05,
        **over,
    )
    stop, ready = asyncio.Event(), asyncio.Event()
    conn = await bus.connect(nats_url, name="test-scheduler")
    task = asyncio.create_task(run_scheduler(cfg, stop, nc=conn, ready=ready))
    await asyncio.wait_for(ready.wait(), 10)
    try:
        yield task
    finally:
        stop.set()
        core = await asyncio.wait_for(task, 10)
        task.core = core
        await conn.drain()


def uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


async def report(nc, iid, role, inc="i1", **kw):
    await bus.publish(
        nc,
        subjects.load_report(role, iid),
        LoadReport(
            instance_id=iid,
            role=role,
            incarnation=inc,
            grpc_addr=f"127.0.0.1:{hash(iid) % 1000 + 1}",
            ts=time.time(),
            **kw,
        ),
    )


async def route(nc, **kw) -> RouteReply:
    req = RouteRequest(request_id=uid("r"), num_prompt_tokens=kw.pop("n", 100), **kw)
    return await bus.request(nc, subjects.SCHED_ROUTE, req, RouteReply, timeout=5)


async def eventually(fn, timeout=5.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            res = await fn()
            if res:
                return res
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


async def test_registry_bucket_register_and_deregister(nc):
    js = nc.jetstream()
    iid = uid("decode")
    rev = await register_instance(
        js,
        InstanceRecord(
            instance_id=iid,
            role="decode",
            incarnation="a",
            grpc_addr="127.0.0.1:5000",
            capacity={"kv_blocks": 128.0},
        ),
    )
    assert rev > 0
    recs = await read_registry(js)
    assert recs[iid].grpc_addr == "127.0.0.1:5000"
    assert recs[iid].capacity == {"kv_blocks": 128.0}
    await deregister_instance(js, iid)
    await deregister_instance(js, iid)  # idempotent
    assert iid not in await read_registry(js)


async def test_no_decode_is_unavailable_then_routes_and_self_prefills(nc, nats_url):
    async with scheduler(nats_url, policy="least_loaded"):
        with pytest.raises(StrataError) as exc:
            await route(nc, exclude=[])
        assert exc.value.code == "unavailable"
        assert exc.value.http_status == 503
        d = uid("decode")
        await report(nc, d, "decode", kv_blocks_total=100, kv_blocks_free=100)
        rep = await eventually(lambda: route(nc))
        # Only a decode instance is alive: it prefills itself.
        assert (rep.decode_instance, rep.prefill_instance) == (d, "")
        assert rep.decode_addr.startswith("127.0.0.1:")
        p = uid("prefill")
        await report(nc, p, "prefill")

        async def disagg():
            r = await route(nc)
            return r if r.prefill_instance == p else None

        rep = await eventually(disagg)
        assert rep.decode_instance == d and rep.policy == "least_loaded"


async def test_route_with_submit_forwards_the_item_and_the_instance_acks_the_requester(
    nc, nats_url
):
    """`RouteRequest.submit`: the scheduler submits the routed item itself; the instance's ack
    goes to ``strata.req.<id>.ack`` (the requester), the route reply to the requester as usual."""
    async with scheduler(nats_url, policy="least_loaded"):
        d = uid("decode")
        got: list[DecodeWork] = []

        async def submit(item: DecodeWork) -> SubmitAck:
            got.append(item)
            return SubmitAck(instance_id=d)

        sub = await bus.serve(nc, subjects.decode_submit(d), DecodeWork, submit)
        await report(nc, d, "decode", kv_blocks_total=100, kv_blocks_free=100)
        await eventually(lambda: route(nc))
        rid = uid("r")
        acks: asyncio.Queue = asyncio.Queue()

        async def on_ack(msg) -> None:
            acks.put_nowait(decode(msg.data, SubmitAck))

        ack_sub = await nc.subscribe(subjects.req_ack(rid), cb=on_ack)
        item = WorkItem(
            request_id=rid, prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=4)
        )
        req = RouteRequest(request_id=rid, num_prompt_tokens=3, submit=item)
        rep = await bus.request(nc, subjects.SCHED_ROUTE, req, RouteReply, timeout=5)
        assert rep.decode_instance == d
        assert (await asyncio.wait_for(acks.get(), 5)).instance_id == d
        assert [(i.request_id, i.prompt_token_ids) for i in got] == [(rid, [1, 2, 3])]
        await ack_sub.unsubscribe()
        await sub.unsubscribe()


def test_routed_submit_fills_route_fields_and_caps_max_tokens():
    item = WorkItem(
        request_id="r", prompt_token_ids=[1], sampling=SamplingParams(max_tokens=100, min_tokens=80)
    )
    route = RouteReply(
        decode_instance="d1",
        decode_addr="h:1",
        prefill_instance="p1",
        transfer_mode="pool",
        max_tokens_cap=50,
    )
    target, out = routed_submit(item, route)
    assert target == subjects.prefill_submit("p1") and isinstance(out, PrefillWork)
    assert (out.decode_instance, out.decode_addr, out.transfer_mode) == ("d1", "h:1", "pool")
    assert (out.sampling.max_tokens, out.sampling.min_tokens) == (50, 50)
    target, out = routed_submit(item, RouteReply(decode_instance="d2", decode_addr="h:2"))
    assert target == subjects.decode_submit("d2") and out.sampling.max_tokens == 100
    assert isinstance(out, DecodeWork) and out.first_token_id is None  # decode prefills itself
    assert item.sampling.max_tokens == 100  # the input is unchanged


async def test_least_loaded_and_round_robin_routes(nc, nats_url):
    async with scheduler(nats_url, policy="round_robin"):
        ds = sorted(uid("decode") for _ in range(2))
        for d in ds:
            await report(nc, d, "decode")
        infos = await eventually(lambda: _live(nc, ds))
        assert {i.instance_id for i in infos} >= set(ds)
        got = [(await route(nc, exclude=[])).decode_instance for _ in range(4)]
        mine = [g for g in got if g in ds]
        assert mine and all(a != b for a, b in zip(mine, mine[1:], strict=False))


async def _live(nc, ids):
    rep = await bus.request(nc, subjects.SCHED_INSTANCES, InstancesRequest(), InstancesReply)
    live = [i for i in rep.instances if i.instance_id in ids and i.alive]
    return live if len(live) == len(ids) else None


async def test_down_detection_and_incarnation_change(nc, nats_url):
    states: list[SchedulerState] = []

    async def on_state(m):
        from shared.protocol.codec import decode

        states.append(decode(m.data, SchedulerState))

    sub = await nc.subscribe(subjects.SCHED_STATE, cb=on_state)
    async with scheduler(nats_url):
        d = uid("decode")
        await report(nc, d, "decode", inc="one")
        await eventually(lambda: _live(nc, [d]))
        # Silent for > 3 x 0.1 s: declared down and published as such.
        await eventually(lambda: asyncio.sleep(0, any(d in s.down for s in states)))
        with pytest.raises(StrataError) as exc:
            await route(nc, exclude=[i for s in states[-1:] for i in s.live])
        assert exc.value.code == "unavailable"
        # It comes back as a new incarnation: a new member, alive again.
        await report(nc, d, "decode", inc="two")
        infos = await eventually(lambda: _live(nc, [d]))
        assert infos[0].incarnation == "two"
        await eventually(
            lambda: asyncio.sleep(0, d in states[-1].live and d not in states[-1].down)
        )
    await sub.unsubscribe()


async def test_restart_rebuilds_prefix_index_by_replay(nc, nats_url):
    js = nc.jetstream()
    d = uid("decode")
    hashes = [uuid.uuid4().hex for _ in range(4)]
    async with scheduler(nats_url, policy="prefix_aware") as first:
        await js.publish(
            subjects.kv_events(d),
            _enc(
                KVEvent(
                    instance_id=d,
                    incarnation="x",
                    seq=1,
                    tier="engine",
                    kind="stored",
                    hashes=hashes,
                )
            ),
        )
        await js.publish(
            subjects.kv_events(d),
            _enc(
                KVEvent(
                    instance_id=d,
                    incarnation="x",
                    seq=2,
                    tier="engine",
                    kind="removed",
                    hashes=hashes[3:],
                )
            ),
        )
        await report(nc, d, "decode", inc="x")
        rep = await eventually(lambda: _cached(nc, hashes))
        assert rep.expected_cached_tokens == 3 * 16
    # A fresh scheduler (nothing in memory) replays STRATA_KV_EVENTS before it serves.
    async with scheduler(nats_url, policy="prefix_aware") as second:
        await report(nc, d, "decode", inc="x")
        rep = await eventually(lambda: _cached(nc, hashes))
        assert rep.decode_instance == d and rep.expected_cached_tokens == 3 * 16
    assert second.core.index.blocks_of(d) == 3
    assert first.core.index.blocks_of(d) == 3


def _enc(msg):
    from shared.protocol.codec import encode

    return encode(msg)


async def _cached(nc, hashes):
    r = await route(nc, n=16 * 4 + 5, block_hashes=hashes)
    return r if r.expected_cached_tokens else None


def test_cli_entry_starts_and_announces_ready(nats_url):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from services.scheduler.app import main; main(sys.argv[1:])",
            "--nats-url",
            nats_url,
            "--policy",
            "prefix_aware",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("STRATA_READY role=scheduler") and "policy=prefix_aware" in line
    finally:
        proc.terminate()
        assert proc.wait(10) == 0


async def test_restart_loads_snapshot_and_replays_only_the_tail(nc, nats_url):
    """With a snapshot, the events it covers may leave the stream (retention) and a restarted
    scheduler still has them; events after it are replayed on top."""
    from services.scheduler.snapshots import BUCKET

    js = nc.jetstream()
    d = uid("decode")
    head, tail = [uuid.uuid4().hex for _ in range(3)], uuid.uuid4().hex

    def ev(seq, hashes):
        return _enc(
            KVEvent(
                instance_id=d, incarnation="x", seq=seq, tier="engine", kind="stored", hashes=hashes
            )
        )

    try:
        async with scheduler(
            nats_url, policy="prefix_aware", snapshot_interval=0.1, snapshot_min_events=1
        ) as first:
            ack = await js.publish(subjects.kv_events(d), ev(1, head))
            await eventually(lambda: _snapshot_seq(js, at_least=ack.seq))
        # Retention drops everything the snapshot covers; one more event arrives afterwards.
        await js.purge_stream(subjects.KV_EVENTS_STREAM, seq=ack.seq + 1)
        await js.publish(subjects.kv_events(d), ev(2, [tail]))
        async with scheduler(nats_url, policy="prefix_aware", snapshot_interval=0) as second:
            pass
        assert first.core.index.blocks_of(d) == 3
        assert second.core.index.blocks_of(d) == 4  # 3 from the snapshot + 1 replayed
        assert second.core.index.lookup(head + [tail]).engine_blocks == {d: 4}
    finally:
        await js.delete_object_store(BUCKET)


async def test_snapshots_purge_the_events_the_previous_one_covered(nc, nats_url):
    """Each snapshot purges, from the KV-event stream, the events this replica's previous
    snapshot covered: the stream keeps one interval of events, not everything up to its byte
    limit, and a replica started afterwards (newest snapshot + the kept tail) has the same
    index with no replay gap. A snapshot older than the stored one is not written."""
    from services.scheduler import metrics as sm
    from services.scheduler.prefix_index import PrefixIndex
    from services.scheduler.snapshots import BUCKET, save_snapshot, stored_seq
    from shared.kv_events_stream import kv_events_stream_state

    js = nc.jetstream()
    d = uid("decode")
    purges = sm.KV_EVENTS_PURGES._value.get()

    def ev(seq):
        return _enc(
            KVEvent(
                instance_id=d,
                incarnation="x",
                seq=seq,
                tier="engine",
                kind="stored",
                hashes=[uuid.uuid4().hex],
            )
        )

    try:
        async with scheduler(
            nats_url, policy="prefix_aware", snapshot_interval=0.1, snapshot_min_events=1
        ) as first:
            acks = []
            for batch in range(3):  # a snapshot after each batch
                for i in range(4):
                    acks.append(await js.publish(subjects.kv_events(d), ev(batch * 4 + i)))
                await eventually(lambda a=acks[-1].seq: _snapshot_seq(js, at_least=a))
            # a later snapshot purged what an earlier one covered (at least the first batch),
            # and the events after the previous snapshot are still there
            state = await kv_events_stream_state(js)
            assert acks[3].seq < state.first_seq <= acks[-1].seq, (state, acks[3], acks[-1])
            assert sm.KV_EVENTS_PURGES._value.get() >= purges + 2
            # a newer snapshot stored by another replica is not overwritten by an older one
            await save_snapshot(js, PrefixIndex(), 10**12)
            await js.publish(subjects.kv_events(d), ev(99))
            await asyncio.sleep(0.5)
            assert await stored_seq(js) == 10**12
        await save_snapshot(js, first.core.index, first.core.kv_seq)  # back to the truth
        gaps = sm.KV_EVENTS_REPLAY_GAPS._value.get()
        async with scheduler(nats_url, policy="prefix_aware", snapshot_interval=0) as second:
            pass
        assert second.core.index.digest() == first.core.index.digest()
        assert second.core.index.blocks_of(d) == 13
        assert sm.KV_EVENTS_REPLAY_GAPS._value.get() == gaps  # nothing it needed was purged
    finally:
        await js.delete_object_store(BUCKET)


async def _snapshot_seq(js, at_least: int):
    from services.scheduler.snapshots import load_snapshot

    snap = await load_snapshot(js)
    return snap if snap is not None and snap[1] >= at_least else None


async def test_a_snapshot_is_built_off_the_event_loop_and_reads_back(nc):
    """A million-block index takes seconds to encode: `save_snapshot` builds it on a worker
    thread (where `freeze`'s build function ran is recorded), and a version-1 snapshot, as
    written before the compact format, still loads."""
    import threading

    import msgpack

    from services.scheduler.prefix_index import PrefixIndex
    from services.scheduler.snapshots import BUCKET, NAME, load_snapshot, save_snapshot

    js = nc.jetstream()
    idx = PrefixIndex()
    hashes = [f"{i:032x}" for i in range(50)]
    idx.apply(
        KVEvent(
            instance_id="d0", incarnation="a", seq=1, tier="engine", kind="stored", hashes=hashes
        )
    )
    ran_on: list[threading.Thread] = []
    freeze = idx.freeze

    def recording_freeze():
        build = freeze()

        def build_here():
            ran_on.append(threading.current_thread())
            return build()

        return build_here

    idx.freeze = recording_freeze
    try:
        await save_snapshot(js, idx, 77)
        assert ran_on and ran_on[0] is not threading.current_thread()
        back, seq = await load_snapshot(js)
        assert seq == 77 and back.holders() == idx.holders() and back.blocks_of("d0") == 50
        store = await js.object_store(BUCKET)
        v1 = {"v": 1, "last_seq": 78, "index": {**idx.state(), "holders": idx.holders()}}
        await store.put(NAME, msgpack.packb(v1, use_bin_type=True))
        back, seq = await load_snapshot(js)
        assert seq == 78 and back.holders() == idx.holders()
    finally:
        await js.delete_object_store(BUCKET)
