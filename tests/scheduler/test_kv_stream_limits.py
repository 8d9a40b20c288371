"""The KV-event stream is bounded (limits retention, discard old) and a scheduler whose replay
needs events the stream already discarded (no snapshot, or a snapshot older than the stream's
first sequence) starts from the first sequence kept and counts it. Real nats-server."""

from __future__ import annotations

import contextlib
import uuid

from nats.js.api import DiscardPolicy, RetentionPolicy

from services.scheduler import metrics
from services.scheduler.prefix_index import PrefixIndex
from services.scheduler.snapshots import BUCKET, save_snapshot
from shared.kv_events_stream import StreamLimits, kv_events_stream_state
from shared.protocol import subjects
from shared.protocol.codec import encode
from shared.protocol.kv import KVEvent
from tests.scheduler.test_service import scheduler, uid

TINY = 4096


def stored(d: str, seq: int, h: str) -> KVEvent:
    return KVEvent(instance_id=d, incarnation="x", seq=seq, tier="ssd", kind="stored", hashes=[h])


async def test_stream_limits_discard_old_and_replay_starts_at_first_kept(nc, nats_url):
    js = nc.jetstream()
    with contextlib.suppress(Exception):
        await js.delete_object_store(BUCKET)  # no snapshot: the replay starts at seq 1
    gaps = metrics.KV_EVENTS_REPLAY_GAPS._value.get()
    try:
        # Everything discarded (an idle stream past its age limit looks the same): the replay
        # has nothing to wait for, and the scheduler still becomes ready.
        await kv_events_stream_state(js)
        gone = uid("kvstore")
        for i in range(3):
            await js.publish(subjects.kv_events(gone), encode(stored(gone, i, uuid.uuid4().hex)))
        await js.purge_stream(subjects.KV_EVENTS_STREAM)
        async with scheduler(nats_url, snapshot_interval=0) as empty:
            pass
        assert len(empty.core.index) == 0
        assert metrics.KV_EVENTS_REPLAY_GAPS._value.get() == gaps + 1

        # An existing stream gets the limits of the process that ensures it.
        state = await kv_events_stream_state(js, limits=StreamLimits(max_bytes=TINY))
        info = await js.stream_info(subjects.KV_EVENTS_STREAM)
        assert info.config.max_bytes == TINY and info.config.discard == DiscardPolicy.OLD
        assert info.config.retention == RetentionPolicy.LIMITS

        d = uid("kvstore")
        hashes = [uuid.uuid4().hex for _ in range(60)]
        seqs = []
        for i, h in enumerate(hashes, start=1):
            ack = await js.publish(subjects.kv_events(d), encode(stored(d, i, h)))
            seqs.append(ack.seq)
        state = await kv_events_stream_state(js)
        assert state.bytes <= TINY and 0 < state.messages < len(hashes)  # the oldest are gone
        assert state.first_seq > seqs[0] and state.last_seq == seqs[-1]
        kept = [h for s, h in zip(seqs, hashes, strict=True) if s >= state.first_seq]
        assert len(kept) == state.messages

        # No snapshot: the replay wanted seq 1, starts at the first kept, has exactly the rest.
        async with scheduler(nats_url, snapshot_interval=0, kv_events_max_bytes=TINY) as fresh:
            pass
        assert metrics.KV_EVENTS_REPLAY_GAPS._value.get() == gaps + 2
        assert metrics.KV_EVENTS_MISSED._value.get() == state.first_seq - 1
        idx = fresh.core.index
        assert idx.blocks_of(d) == len(kept) and fresh.core.kv_seq == state.last_seq
        assert idx.lookup(kept).pool_ssd_blocks == len(kept)
        assert idx.lookup(hashes[:1]).pool_ssd_blocks == 0  # its event was discarded

        # A snapshot older than the first kept sequence: kept, and the kept events on top.
        old = PrefixIndex()
        old.apply(stored(d, 0, hashes[0]))
        await save_snapshot(js, old, seqs[0])
        async with scheduler(nats_url, snapshot_interval=0, kv_events_max_bytes=TINY) as late:
            pass
        assert metrics.KV_EVENTS_REPLAY_GAPS._value.get() == gaps + 3
        assert metrics.KV_EVENTS_MISSED._value.get() == state.first_seq - seqs[0] - 1
        assert late.core.index.blocks_of(d) == len(kept) + 1

        # A snapshot the stream still covers: no gap.
        await save_snapshot(js, late.core.index, late.core.kv_seq)
        async with scheduler(nats_url, snapshot_interval=0, kv_events_max_bytes=TINY) as ok:
            pass
        assert metrics.KV_EVENTS_REPLAY_GAPS._value.get() == gaps + 3
        assert ok.core.index.digest() == late.core.index.digest()
    finally:
        with contextlib.suppress(Exception):
            await js.delete_object_store(BUCKET)
        await kv_events_stream_state(js, limits=StreamLimits())  # the default for later tests
