"""Prefix-index snapshots in a JetStream object store, so a restarted replica loads the newest
snapshot and replays only the KV events after it instead of the whole stream.

A snapshot is ``msgpack({"v": 2, "last_seq": N, "index": PrefixIndex.state()})``: the index as
it was after applying stream sequence ``N`` (or newer: see `PrefixIndex.freeze`); the object's
description says ``last_seq=N`` too, so a replica can see how new the stored snapshot is without
reading it (`stored_seq`). Version 1 snapshots (the index's format 1) still load. The snapshot is
built and encoded off the event loop: at a million blocks that is seconds of work, which on the
loop would hold every routing decision.
"""

from __future__ import annotations

import asyncio
import logging

import msgpack
from nats.js.api import ObjectMeta
from nats.js.errors import BucketNotFoundError, NotFoundError, ObjectNotFoundError

from services.scheduler.prefix_index import PrefixIndex

log = logging.getLogger(__name__)

BUCKET = "strata_sched_snapshots"
NAME = "prefix-index"
VERSION = 2
READABLE = (1, 2)


async def _store(js, create: bool):
    try:
        return await js.object_store(BUCKET)
    except (BucketNotFoundError, NotFoundError):
        if not create:
            return None
        try:
            return await js.create_object_store(BUCKET)
        except Exception:  # noqa: BLE001 - another replica created it first
            return await js.object_store(BUCKET)


async def save_snapshot(js, index: PrefixIndex, last_seq: int) -> int:
    """Write the index as of stream sequence ``last_seq``; returns the snapshot's bytes."""
    build = index.freeze()  # cheap copies, here on the loop; the rest on a worker thread

    def encode() -> bytes:
        snap = {"v": VERSION, "last_seq": last_seq, "index": build()}
        return msgpack.packb(snap, use_bin_type=True)

    data = await asyncio.to_thread(encode)
    store = await _store(js, create=True)
    await store.put(NAME, data, meta=ObjectMeta(name=NAME, description=f"last_seq={last_seq}"))
    return len(data)


async def stored_seq(js) -> int:
    """The stream sequence of the stored snapshot, from its description (0: none, or one
    written before descriptions carried it)."""
    try:
        store = await _store(js, create=False)
        if store is None:
            return 0
        info = await store.get_info(NAME)
    except (ObjectNotFoundError, NotFoundError):
        return 0
    key, _, value = (info.description or "").partition("=")
    return int(value) if key == "last_seq" and value.isdigit() else 0


async def load_snapshot(js) -> tuple[PrefixIndex, int] | None:
    """(index, last stream sequence) of the newest snapshot, or None if there is none or it
    cannot be read (then the caller replays the whole stream)."""
    try:
        store = await _store(js, create=False)
        if store is None:
            return None
        res = await store.get(NAME)
        snap = msgpack.unpackb(res.data, raw=False, strict_map_key=False)
        if snap.get("v") not in READABLE:
            return None
        return PrefixIndex.from_state(snap["index"]), int(snap["last_seq"])
    except ObjectNotFoundError:
        return None
    except Exception:  # noqa: BLE001 - a bad snapshot costs a full replay, never a failure
        log.warning("prefix-index snapshot unreadable; replaying the whole stream", exc_info=True)
        return None
