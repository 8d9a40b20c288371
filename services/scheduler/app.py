"""`strata serve scheduler`: NATS wiring around `SchedulerCore`.

Subscribes load reports (`strata.load.>`), replays then follows KV events from the JetStream
stream `STRATA_KV_EVENTS` (so a restarted scheduler rebuilds its prefix index), watches the
registry bucket, answers `strata.sched.route` and `strata.sched.instances` (queue group
"scheduler": any number of active replicas; a route request that carries its `WorkItem` is
also submitted to the chosen instance from here, see `RouteRequest.submit`) and on its own
`strata.sched.route.<instance_id>` (what gateways use once they heard its state), and publishes
`SchedulerState` on `strata.sched.state` every ``state_interval``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from nats.aio.client import Client as NATS
from nats.js.api import ConsumerConfig, DeliverPolicy
from pydantic import ValidationError

from services.scheduler import metrics
from services.scheduler.config import SchedulerConfig
from services.scheduler.core import SchedulerCore
from services.scheduler.prefix_index import event_problem
from services.scheduler.snapshots import load_snapshot, save_snapshot, stored_seq
from shared import bus, service
from shared.badmsg import BadMessages, one_line
from shared.jetstream import at_start
from shared.kv_events_stream import STARTUP_RETRY_S, StreamLimits, kv_events_stream_state
from shared.logs import setup_logging
from shared.metrics import SERVICE_INFO, serve_metrics
from shared.protocol import subjects
from shared.protocol.codec import decode, encode
from shared.protocol.errors import StrataError
from shared.protocol.kv import KVEvent
from shared.protocol.load import LoadReport
from shared.protocol.sched import (
    InstanceRecord,
    InstancesReply,
    InstancesRequest,
    RouteReply,
    RouteRequest,
    routed_submit,
)
from shared.registry import registry_bucket

log = logging.getLogger(__name__)


BAD = BadMessages(metrics.BAD_MESSAGES, log)
"""Bad KV events, load reports and requests: ``strata_scheduler_bad_messages_total{subject}``
and rate-limited one-line warnings."""


def checked_kv_event(data: bytes, subject: str) -> KVEvent | None:
    """The event in ``data`` when it decodes and passes `event_problem`; else None (counted)."""
    try:
        ev = decode(data, KVEvent)
    except (StrataError, ValidationError) as exc:
        BAD.report(subjects.KV_EVENTS_ALL, subject, one_line(exc))
        return None
    why = event_problem(ev, subject)
    if why is not None:
        BAD.report(subjects.KV_EVENTS_ALL, subject, why)
        return None
    return ev


KV_EVENTS_HEARTBEAT_S = 1.0


async def follow_kv_events(
    js,
    core: SchedulerCore,
    start_seq: int = 1,
    replicas: int = 1,
    limits: StreamLimits | None = None,
) -> tuple[object, asyncio.Event]:
    """Replay the stream from ``start_seq`` (1: the start; after a snapshot: the sequence after
    it), then keep following it (one ordered consumer, so replay and live events never overlap).
    The event is set once the replay reached the stream's end. ``core.kv_seq`` tracks the last
    stream sequence applied (what a snapshot records). Events that fail validation are
    skipped and counted (`checked_kv_event`).

    The stream is bounded (``limits``): when it already discarded events the replay needs (the
    snapshot is older than the stream's first sequence, or there is none), the replay starts at
    the first sequence still kept, logs it once and counts it; the index then lacks what those
    events said (docs/SCHEDULER.md: how stale entries are corrected)."""
    state = await kv_events_stream_state(js, replicas, limits)
    last = state.last_seq
    if state.first_seq > start_seq:
        missed = state.first_seq - start_seq
        log.warning(
            "KV-event replay needs seq %d but %s keeps %d..%d (older events discarded by its "
            "limits); replaying from %d, %d events missed",
            start_seq,
            subjects.KV_EVENTS_STREAM,
            state.first_seq,
            last,
            state.first_seq,
            missed,
        )
        metrics.KV_EVENTS_REPLAY_GAPS.inc()
        metrics.KV_EVENTS_MISSED.set(missed)
        start_seq = state.first_seq
    replayed = asyncio.Event()
    if last < start_seq or state.messages == 0:
        replayed.set()

    async def on_event(m) -> None:
        ev = checked_kv_event(m.data, m.subject)
        if ev is not None:
            try:
                core.on_kv_event(ev)
            except Exception as exc:  # noqa: BLE001 - one bad event must not stop the index
                BAD.report(subjects.KV_EVENTS_ALL, m.subject, f"not applied: {one_line(exc)}")
        core.kv_seq = m.metadata.sequence.stream
        if not replayed.is_set() and m.metadata.sequence.stream >= last:
            replayed.set()

    extra = {}
    if start_seq > 1:
        extra = dict(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            config=ConsumerConfig(opt_start_seq=start_seq),
        )
    # Making the consumer right after the state can still meet a busy or electing cluster:
    # retried like the state, then one line.
    sub = await at_start(
        lambda: js.subscribe(
            subjects.KV_EVENTS_ALL,
            cb=on_event,
            ordered_consumer=True,
            # Two missed heartbeats make nats-py recreate the consumer (after a nats-server
            # restart, whose in-memory ordered consumers are gone): 1 s puts that at ~2 s.
            idle_heartbeat=KV_EVENTS_HEARTBEAT_S,
            pending_msgs_limit=-1,
            pending_bytes_limit=-1,
            **extra,
        ),
        f"a consumer on stream {subjects.KV_EVENTS_STREAM}",
        STARTUP_RETRY_S,
    )
    return sub, replayed


async def snapshot_loop(js, core: SchedulerCore, cfg: SchedulerConfig, stop: asyncio.Event) -> None:
    """Every ``snapshot_interval``, if enough events were applied since the last one, store the
    index with the stream sequence it reflects (every replica may write; each snapshot is
    self-consistent; one older than the stored one is not written).

    With ``snapshot_purge``, the KV events this replica's previous snapshot covered are then
    purged from the stream: a restarted replica loads a snapshot at least that new and replays
    only what follows, so the stream holds about one snapshot interval of events instead of
    growing to its byte limit. Keeping that interval, not purging up to the snapshot just
    written, leaves a replica that lags behind by less than one interval every event it has
    yet to apply."""
    done = core.index.events_applied
    previous = 0  # the stream sequence of this replica's last snapshot

    async def maybe() -> None:
        nonlocal done, previous
        if core.index.events_applied - done < cfg.snapshot_min_events:
            return
        seq, applied = core.kv_seq, core.index.events_applied
        done = applied
        if await stored_seq(js) >= seq:
            return  # another replica stored a snapshot at least as new
        nbytes = await save_snapshot(js, core.index, seq)
        metrics.SNAPSHOT_BYTES.set(nbytes)
        log.info(
            "prefix-index snapshot at stream seq %d (%d blocks, %d bytes)",
            seq,
            len(core.index),
            nbytes,
        )
        if cfg.snapshot_purge and previous > 0:
            await js.purge_stream(subjects.KV_EVENTS_STREAM, seq=previous + 1)
            metrics.KV_EVENTS_PURGES.inc()
            log.info("KV events up to stream seq %d purged (a snapshot covers them)", previous)
        previous = seq

    if cfg.snapshot_interval > 0:
        await service.periodic(cfg.snapshot_interval, maybe, stop)


REGISTRY_HEARTBEAT_S = 1.0


async def watch_registry(js, core: SchedulerCore, stop: asyncio.Event, replicas: int = 1) -> None:
    """Apply registry records and deletions as they change, until ``stop``.

    One ordered consumer on the bucket's stream, starting from every key's latest entry, with
    idle heartbeats like `follow_kv_events`: when two are missed nats-py makes the consumer
    again from the next sequence. That covers a restarted nats-server (its in-memory consumer
    is gone) and a lost node of a NATS cluster that held the consumer while this connection
    stays up on another node, where ``kv.watchall()`` (no heartbeat) waited forever.

    Making the consumer is retried until it succeeds or ``stop``: a bucket just created as R3
    has no stream leader for a moment, and a node lost under it makes the request time out.
    Ending there would leave the scheduler deaf to every instance that joins later."""
    prefix = f"$KV.{subjects.REGISTRY_BUCKET}."

    async def on_entry(m) -> None:
        key = m.subject[len(prefix) :]
        if (m.headers or {}).get("KV-Operation") in ("DEL", "PURGE") or not m.data:
            core.on_deregister(key)
            return
        try:
            core.on_record(decode(m.data, InstanceRecord))
        except (StrataError, ValidationError) as exc:
            BAD.report(prefix + ">", m.subject, one_line(exc))

    async def subscribe():
        await registry_bucket(js, replicas=replicas)  # created if this is the first process
        return await js.subscribe(
            prefix + ">",
            stream=f"KV_{subjects.REGISTRY_BUCKET}",
            cb=on_entry,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
            idle_heartbeat=REGISTRY_HEARTBEAT_S,
            pending_msgs_limit=-1,
            pending_bytes_limit=-1,
        )

    delay, sub = 0.1, None
    while sub is None:
        try:
            sub = await subscribe()
        except Exception as exc:  # noqa: BLE001 - any JetStream answer but success: try again
            metrics.REGISTRY_WATCH_RETRIES.inc()
            log.warning("registry watcher: no consumer yet, retrying: %s", one_line(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            if stop.is_set():
                return
            delay = min(2 * delay, 2.0)
    try:
        await stop.wait()
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def run_scheduler(
    cfg: SchedulerConfig,
    stop: asyncio.Event,
    nc: NATS | None = None,
    ready: asyncio.Event | None = None,
) -> SchedulerCore:
    """Run until ``stop``; usable in-process by tests (pass ``nc``/``ready``)."""
    own = nc is None
    nc = nc or await bus.connect(cfg.nats_url, name=f"scheduler:{cfg.instance_id}")
    js = nc.jetstream()
    core = SchedulerCore(cfg)
    subs = []

    async def on_load(m) -> None:
        try:
            core.on_load(decode(m.data, LoadReport))
        except Exception as exc:  # noqa: BLE001 - garbage on strata.load.> costs one count
            BAD.report(subjects.LOAD_ALL, m.subject, one_line(exc))

    async def route(req: RouteRequest) -> RouteReply:
        reply = core.route(req)
        # One hop: the item goes on to the chosen instance, which acks to the gateway directly.
        if req.submit is not None and reply.decode_instance:
            target, item = routed_submit(req.submit, reply)
            await nc.publish(target, encode(item), reply=subjects.req_ack(item.request_id))
        return reply

    async def instances(req: InstancesRequest) -> InstancesReply:
        return core.instances(req.role)

    async def publish_state() -> None:
        state, newly_down = core.tick()
        for iid in newly_down:
            log.warning(
                "instance %s declared down (no load report for %.1fs)", iid, core.members.timeout_s
            )
        await bus.publish(nc, subjects.SCHED_STATE, state)
        for change in [*core.plan_roles(), *core.plan_scale()]:
            await bus.publish(nc, subjects.role_change(change.instance_id), change)

    t0 = time.perf_counter()
    start_seq = 1
    snap = await load_snapshot(js)
    if snap is not None:
        core.index, core.kv_seq = snap
        start_seq = core.kv_seq + 1
        log.info("prefix index loaded from a snapshot at stream seq %d", core.kv_seq)
    limits = cfg.stream_limits()
    kv_sub, replayed = await follow_kv_events(js, core, start_seq, cfg.js_replicas, limits)
    subs.append(kv_sub)
    await replayed.wait()
    replay_s = time.perf_counter() - t0
    log.info(
        "prefix index rebuilt from %s: %d events, %d blocks in %.2fs",
        subjects.KV_EVENTS_STREAM,
        core.index.events_applied,
        len(core.index),
        replay_s,
    )
    metrics.KV_EVENTS_REPLAYED.set(core.index.events_applied)
    metrics.REPLAY_SECONDS.set(replay_s)
    metrics.PREFIX_INDEX_DIGEST.set_function(core.index.digest)  # computed on scrape only
    reg_task = asyncio.create_task(watch_registry(js, core, stop, cfg.js_replicas))
    snap_task = asyncio.create_task(snapshot_loop(js, core, cfg, stop))
    subs.append(await nc.subscribe(subjects.LOAD_ALL, cb=on_load))
    await wait_for_members(core, cfg.load_interval * cfg.down_after)
    subs.append(
        await bus.serve(
            nc, subjects.SCHED_ROUTE, RouteRequest, route, queue=subjects.QUEUE_SCHEDULER, bad=BAD
        )
    )
    # Its own route subject too, live before its first state names it to the gateways.
    direct = subjects.sched_route(cfg.instance_id)
    subs.append(await bus.serve(nc, direct, RouteRequest, route, bad=BAD))
    subs.append(
        await bus.serve(
            nc,
            subjects.SCHED_INSTANCES,
            InstancesRequest,
            instances,
            queue=subjects.QUEUE_SCHEDULER,
            bad=BAD,
        )
    )
    tick_task = asyncio.create_task(service.periodic(cfg.state_interval, publish_state, stop))
    service.announce_ready("scheduler", cfg.instance_id, f"policy={cfg.policy}")
    if ready is not None:
        ready.set()
    await stop.wait()
    for s in subs:
        with contextlib.suppress(Exception):
            await s.unsubscribe()
    await asyncio.gather(reg_task, tick_task, snap_task, return_exceptions=True)
    if own:
        await nc.drain()
    return core


async def wait_for_members(core: SchedulerCore, timeout: float) -> None:
    """Before answering routes: wait until every instance in the registry has reported load,
    at most ``timeout`` (one heartbeat timeout, by which every live instance has reported). A
    replica that just (re)started knows no live instance yet; answering then would refuse
    requests with "no decode instance" while the other replicas could route them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        recs, members = core.members.records, core.members.members
        if recs and all(i in members and members[i].alive for i in recs):
            return
        await asyncio.sleep(0.05)


def main(argv: list[str]) -> None:
    cfg = SchedulerConfig.load(argv, role="scheduler")
    setup_logging("scheduler", cfg.instance_id, cfg.log_level)
    serve_metrics(cfg.metrics_port, cfg.metrics_bind)
    SERVICE_INFO.labels(role="scheduler", instance=cfg.instance_id).set(1)
    service.run(lambda stop: run_scheduler(cfg, stop))
