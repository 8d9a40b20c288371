"""The JetStream stream of KV events (`strata.kv.events.>`), shared by whoever publishes or
replays them (kvstore, scheduler): one definition, created by the first process that needs it.

The stream is bounded (`StreamLimits`: bytes and/or age, limits retention, discard old): the
oldest events go first. A replay that needs events already discarded starts at the stream's
first sequence instead (the scheduler counts it: docs/SCHEDULER.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass

from nats.js.api import DiscardPolicy, RetentionPolicy, StreamConfig, StreamState
from nats.js.errors import NotFoundError

from shared.jetstream import at_start
from shared.protocol import subjects

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 1 << 30

STARTUP_RETRY_S = 60.0
"""How long a process starting waits for JetStream to answer about the stream (a cluster
electing its leaders, a server busy) before it exits in one line."""


@dataclass(frozen=True)
class StreamLimits:
    """How much of the KV-event stream is kept (settings ``kv_events_max_bytes`` and
    ``kv_events_max_age``)."""

    max_bytes: int = DEFAULT_MAX_BYTES
    """Bytes kept; beyond them the oldest events are discarded (0 = unbounded)."""
    max_age: float = 0.0
    """Seconds an event is kept (0 = no age limit)."""

    def differs(self, cfg: StreamConfig) -> bool:
        """True when the stream's ``cfg`` keeps other limits than these."""
        return (
            (cfg.max_bytes or -1) != (self.max_bytes or -1)
            or float(cfg.max_age or 0) != float(self.max_age)
            or cfg.discard != DiscardPolicy.OLD
        )

    def apply(self, cfg: StreamConfig) -> StreamConfig:
        return dataclasses.replace(
            cfg,
            retention=RetentionPolicy.LIMITS,
            discard=DiscardPolicy.OLD,
            max_bytes=self.max_bytes or -1,
            max_age=self.max_age,
        )


async def kv_events_stream_state(
    js,
    replicas: int = 1,
    limits: StreamLimits | None = None,
    retry_s: float = STARTUP_RETRY_S,
) -> StreamState:
    """Create the stream if missing, with ``replicas`` copies (3 on a 3-node cluster; a lost
    creation race is fine) and ``limits`` (default: `StreamLimits()`); an existing stream is
    updated to ``limits`` when given and different (a stream made before limits existed gets
    them). Returns its state (first and last sequence, messages).

    While JetStream does not answer (`shared.jetstream.ELECTING`) this is retried for up to
    ``retry_s``; then `JetStreamUnavailable` ends the process in one line. A server without
    JetStream answers like a cluster electing (`ServiceUnavailableError`), so it is waited for
    too."""
    return await at_start(
        lambda: _stream_state(js, replicas, limits), f"stream {subjects.KV_EVENTS_STREAM}", retry_s
    )


async def _stream_state(js, replicas: int, limits: StreamLimits | None) -> StreamState:
    try:
        info = await js.stream_info(subjects.KV_EVENTS_STREAM)
    except NotFoundError:
        cfg = StreamConfig(
            name=subjects.KV_EVENTS_STREAM,
            subjects=[subjects.KV_EVENTS_ALL],
            num_replicas=replicas,
        )
        with contextlib.suppress(Exception):
            await js.add_stream((limits or StreamLimits()).apply(cfg))
        info = await js.stream_info(subjects.KV_EVENTS_STREAM)
    else:
        if limits is not None and limits.differs(info.config):
            try:
                await js.update_stream(limits.apply(info.config))
            except Exception as exc:  # noqa: BLE001 - the stream still works with its old limits
                log.warning("could not set %s limits: %s", subjects.KV_EVENTS_STREAM, exc)
            else:
                log.info(
                    "%s limits set: max_bytes=%d max_age=%gs",
                    subjects.KV_EVENTS_STREAM,
                    limits.max_bytes,
                    limits.max_age,
                )
                info = await js.stream_info(subjects.KV_EVENTS_STREAM)
    return info.state


async def ensure_kv_events_stream(js, replicas: int = 1, limits: StreamLimits | None = None) -> int:
    """`kv_events_stream_state`'s last sequence."""
    return (await kv_events_stream_state(js, replicas, limits)).last_seq
