"""A worker's token chunks to the gateways, batched: one message per gateway per engine step.

The engine hands a step's outputs to every request's stream in one loop callback
(`shared.engine.port`), so the request tasks woken by it all run, and `Outbox.send` their
chunks, within one loop iteration. The first `send` starts a flush task, which runs on the next
iteration: by then every chunk of the step is queued, and it publishes one `TokenChunkBatch`
per gateway on ``strata.gw.<gateway_id>.out`` instead of one message per request. A chunk whose
request names no gateway (an older gateway: `WorkItem.gateway_id` empty) goes alone on
``strata.req.<request_id>.out`` as before. Chunks leave in the order they were sent, so a
request's chunks (and its final or abort chunk) stay in index order.
"""

from __future__ import annotations

import asyncio
import logging

from nats.aio.client import Client as NATS

from shared import bus, metrics
from shared.protocol import subjects
from shared.protocol.stream import TokenChunk, TokenChunkBatch

log = logging.getLogger(__name__)

OUTPUT_MESSAGES = metrics.Counter(
    "strata_decode_output_messages_total",
    "Messages carrying token chunks to the gateways (batched: one per gateway per step)",
    ["role", "subject"],
)
OUTPUT_CHUNKS = metrics.Counter(
    "strata_decode_output_chunks_total",
    "Token chunks sent to the gateways (one per request per step)",
    ["role"],
)


class Outbox:
    """Queues chunks and publishes them per gateway on the next loop iteration (module doc)."""

    def __init__(self, nc: NATS, role: str):
        self.nc = nc
        self.role = role
        self._pending: list[tuple[str, TokenChunk]] = []
        self._task: asyncio.Task | None = None

    def send(self, chunk: TokenChunk, gateway_id: str = "") -> None:
        """Queue ``chunk`` for the gateway ``gateway_id`` ("": its request's own subject)."""
        self._pending.append((gateway_id, chunk))
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            by_gateway: dict[str, list[TokenChunk]] = {}
            for gw, chunk in batch:
                if gw:
                    by_gateway.setdefault(gw, []).append(chunk)
                else:
                    await self._publish(subjects.req_out(chunk.request_id), chunk, "request")
            for gw, chunks in by_gateway.items():
                await self._publish(subjects.gw_out(gw), TokenChunkBatch(chunks=chunks), "gateway")
            OUTPUT_CHUNKS.labels(self.role).inc(len(batch))

    async def _publish(self, subject: str, msg, kind: str) -> None:
        try:
            await bus.publish(self.nc, subject, msg)
        except Exception:  # noqa: BLE001 - a lost connection: the gateway's stall handling
            log.warning("could not publish on %s", subject, exc_info=True)  # resumes the stream
            return
        OUTPUT_MESSAGES.labels(self.role, kind).inc()
