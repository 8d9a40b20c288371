"""Poisoned bus input: garbage and wrong-shape KV events (stored in JetStream, so replayed at
every start), garbage load reports and route requests. The scheduler keeps routing, counts each
bad message in ``strata_scheduler_bad_messages_total{subject}`` and logs rate-limited
one-liners, never a traceback."""

from __future__ import annotations

import logging
import uuid

import msgpack
import pytest
from prometheus_client import REGISTRY

from services.scheduler.prefix_index import event_problem
from shared.badmsg import BadMessages
from shared.protocol import subjects
from shared.protocol.codec import encode
from shared.protocol.kv import KVEvent
from tests.scheduler.test_service import eventually, report, route, scheduler, uid

KV = subjects.KV_EVENTS_ALL


def bad_count(subject: str) -> float:
    v = REGISTRY.get_sample_value("strata_scheduler_bad_messages_total", {"subject": subject})
    return v or 0.0


def ev(inst: str, **kw) -> KVEvent:
    base = dict(
        instance_id=inst,
        incarnation="x",
        seq=1,
        tier="engine",
        kind="stored",
        hashes=[uuid.uuid4().hex],
    )
    return KVEvent(**{**base, **kw})


@pytest.mark.parametrize(
    "kw,needle",
    [
        ({}, None),
        ({"hashes": ["zz"]}, "not 32 lowercase hex"),
        ({"hashes": ["A" * 32]}, "not 32 lowercase hex"),
        ({"instance_id": "other"}, "does not match the subject"),
        ({"incarnation": ""}, "incarnation"),
        ({"seq": -1}, "negative"),
        ({"hashes": ["0" * 32] * 70000}, "hashes in one event"),
    ],
)
def test_event_problem(kw, needle):
    why = event_problem(ev("d-1", **kw), subjects.kv_events("d-1"))
    assert (why is None) if needle is None else (needle in why)


def test_bad_messages_log_is_rate_limited():
    from prometheus_client import CollectorRegistry, Counter

    counter = Counter("t_bad", "t", ["subject"], registry=CollectorRegistry())
    now = [0.0]
    lines: list[str] = []

    class Log:
        def warning(self, fmt, *args):
            lines.append(fmt % args)

    bad = BadMessages(counter, Log(), interval=10.0, clock=lambda: now[0])
    assert bad.report("s.>", "s.a", "junk")
    assert not bad.report("s.>", "s.b", "junk")
    assert not bad.report("s.>", "s.c", "junk")
    assert bad.report("t.>", "t.a", "other subscription")  # its own budget
    now[0] = 10.0
    assert bad.report("s.>", "s.d", "junk")
    assert counter.labels(subject="s.>")._value.get() == 4
    assert lines == [
        "dropped a bad message on s.a: junk",
        "dropped a bad message on t.a: other subscription",
        "dropped a bad message on s.d: junk (2 more since the last report)",
    ]


async def test_poisoned_kv_events_are_counted_and_skipped(nc, nats_url, caplog):
    caplog.set_level(logging.INFO)
    js = nc.jetstream()
    d = uid("decode")
    subj = subjects.kv_events(d)
    good = [uuid.uuid4().hex for _ in range(2)]
    poison = [
        b"\xc1garbage",  # not msgpack
        b"\x93\x01\x02\x03",  # msgpack, wrong shape
        msgpack.packb(
            {
                "instance_id": d,
                "incarnation": "x",
                "seq": 1,
                "tier": "nvme",
                "kind": "stored",
                "hashes": [],
            }
        ),  # unknown tier
        msgpack.packb(
            {
                "instance_id": d,
                "incarnation": "x",
                "seq": 1,
                "tier": "engine",
                "kind": "evicted",
                "hashes": [],
            }
        ),  # unknown kind
        encode(ev(d, hashes=["../../etc"])),  # hash format
        encode(ev("someone-else")),  # instance does not match the subject
        msgpack.packb({"__error__": {"code": "internal", "message": "x"}}),
    ]
    async with scheduler(nats_url, policy="prefix_aware") as first:
        before = bad_count(KV)
        for data in poison:
            await js.publish(subj, data)
        await js.publish(subj, encode(ev(d, seq=2, hashes=good)))
        await report(nc, d, "decode", inc="x")
        rep = await eventually(lambda: _cached(nc, good))
        assert rep.decode_instance == d and rep.expected_cached_tokens == 16 * len(good)
        assert bad_count(KV) - before == len(poison)
        # garbage on the load reports and on the route request subject
        load_before = bad_count(subjects.LOAD_ALL)
        await nc.publish(subjects.load_report("decode", d), b"\xc1")
        await nc.publish(subjects.load_report("decode", d), msgpack.packb({"role": 7}))
        r = await nc.request(subjects.SCHED_ROUTE, b"\x92\x01\x02", timeout=5)
        assert b"bad_request" in r.data and b"invalid RouteRequest" in r.data
        await eventually(lambda: _async(bad_count(subjects.LOAD_ALL) - load_before == 2))
        assert bad_count(subjects.SCHED_ROUTE) >= 1
        # still routing (a fresh report: on a loaded box the first may have aged out by now)
        await report(nc, d, "decode", inc="x")
        assert (await route(nc, n=40)).decode_instance == d
    assert first.core.index.blocks_of(d) == len(good)
    # a restart replays the stream, poison included: counted and skipped again
    async with scheduler(nats_url, policy="prefix_aware") as second:
        assert bad_count(KV) - before >= 2 * len(poison)
        await report(nc, d, "decode", inc="x")
        await eventually(lambda: _cached(nc, good))
    assert second.core.index.blocks_of(d) == len(good)
    text = caplog.text
    assert "Traceback" not in text
    assert "dropped a bad message on strata.kv.events." in text
    # rate-limited: far fewer lines than bad messages
    assert text.count("dropped a bad message") < len(poison)


async def _async(v):
    return v


async def _cached(nc, hashes):
    r = await route(nc, n=16 * len(hashes) + 5, block_hashes=hashes)
    return r if r.expected_cached_tokens else None
