"""The JetStream stream of KV events (`strata.kv.events.>`), shared by whoever publishes or
replays them (kvstore, scheduler): one definition, created by the first process that needs it."""

from __future__ import annotations

import contextlib

from nats.js.api import StreamConfig
from nats.js.errors import NotFoundError

from shared.protocol import subjects


async def ensure_kv_events_stream(js, replicas: int = 1) -> int:
    """Create the stream if missing, with ``replicas`` copies (3 on a 3-node cluster; a lost
    creation race is fine); returns its last sequence."""
    try:
        info = await js.stream_info(subjects.KV_EVENTS_STREAM)
    except NotFoundError:
        with contextlib.suppress(Exception):
            await js.add_stream(
                StreamConfig(
                    name=subjects.KV_EVENTS_STREAM,
                    subjects=[subjects.KV_EVENTS_ALL],
                    num_replicas=replicas,
                )
            )
        info = await js.stream_info(subjects.KV_EVENTS_STREAM)
    return info.state.last_seq
