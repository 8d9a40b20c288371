"""kvstore service wiring: NATS (events, load reports, admin), the gRPC KVTransfer server, MinIO.

``strata serve kvstore [flags]`` -> `main(argv)`. `run_kvstore(cfg, stop)` is the same service as
a coroutine (tests run it in-process against real NATS and MinIO).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from services.kvstore import metrics as kvm
from services.kvstore.config import KVStoreConfig
from services.kvstore.core import KVStoreCore
from services.kvstore.handler import KVStoreHandler
from services.kvstore.ssd import MinioTier
from services.kvstore.store import KVStore
from services.kvstore.writer import WriterOptions
from shared import bus, metrics
from shared.config import new_incarnation
from shared.kv_events_stream import ensure_kv_events_stream
from shared.kvtransfer.server import start_kv_server
from shared.logs import setup_logging
from shared.protocol import subjects
from shared.protocol.codec import encode
from shared.protocol.kv import KVEvent, KVStoreStats, KVStoreStatsRequest
from shared.protocol.load import LoadReport
from shared.service import announce_ready, periodic, run

log = logging.getLogger(__name__)
ROLE = "kvstore"


def build_store(cfg: KVStoreConfig, incarnation: str, publish) -> KVStore:
    core = KVStoreCore(
        cfg.instance_id,
        incarnation,
        cfg.dram_bytes,
        cfg.spill_buffer_bytes or None,
        write_behind_blocks=cfg.write_behind_blocks
        if cfg.write_behind and cfg.minio_endpoint
        else 0,
        ssd_bytes=cfg.ssd_bytes if cfg.minio_endpoint else 0,
    )
    ssd = None
    if cfg.minio_endpoint:
        ssd = MinioTier(
            cfg.minio_endpoint,
            cfg.minio_access_key,
            cfg.minio_secret_key,
            cfg.minio_bucket,
            secure=cfg.minio_secure,
            timeout=cfg.minio_timeout,
            max_connections=max(16, cfg.spill_concurrency * 2),
        )
    return KVStore(
        core,
        ssd,
        publish=publish,
        writer=WriterOptions(
            concurrency=cfg.spill_concurrency,
            retry_interval=cfg.retry_interval,
            chunk_bytes=cfg.chunk_bytes,
            chunk_block_max=cfg.chunk_block_max_bytes,
            linger=cfg.write_linger,
        ),
        refresh_interval=cfg.refresh_interval,
        negative_ttl=cfg.negative_ttl,
    )


def stats_reply(store: KVStore, grpc_addr: str) -> KVStoreStats:
    s = store.stats()
    fields = set(KVStoreStats.model_fields)
    return KVStoreStats(
        instance_id=store.core.instance_id,
        incarnation=store.core.incarnation,
        grpc_addr=grpc_addr,
        **{k: v for k, v in s.items() if k in fields and k != "counters"},
        counters={**s["counters"], "write_behind_blocks": s["write_behind_blocks"]},
    )


async def run_kvstore(
    cfg: KVStoreConfig,
    stop: asyncio.Event,
    on_ready: Callable[[KVStore, str], None] | None = None,
) -> None:
    """Serve until ``stop`` is set. ``on_ready(store, grpc_addr)`` is called once live."""
    incarnation = new_incarnation()
    nc = await bus.connect(cfg.nats_url, name=f"{ROLE}-{cfg.instance_id}")
    js = nc.jetstream()
    await ensure_kv_events_stream(js, cfg.js_replicas, cfg.stream_limits())
    event_subject = subjects.kv_events(cfg.instance_id)

    async def publish(ev: KVEvent) -> None:
        await js.publish(event_subject, encode(ev), timeout=5)

    store = build_store(cfg, incarnation, publish)
    await store.start()
    server, addr = await start_kv_server(KVStoreHandler(store), cfg.grpc_host, cfg.grpc_port)

    async def admin(_: KVStoreStatsRequest) -> KVStoreStats:
        return stats_reply(store, addr)

    sub = await bus.serve(nc, subjects.admin(ROLE, cfg.instance_id), KVStoreStatsRequest, admin)

    async def heartbeat() -> None:
        counts = store.core.tier_counts()
        kvm.update_gauges(counts)
        blocks = counts["dram_blocks"]
        mean = counts["dram_bytes"] / blocks if blocks else 0
        free = int((counts["dram_budget_bytes"] - counts["dram_bytes"]) / mean) if mean else 0
        await bus.publish(
            nc,
            subjects.load_report(ROLE, cfg.instance_id),
            LoadReport(
                instance_id=cfg.instance_id,
                role=ROLE,
                incarnation=incarnation,
                grpc_addr=addr,
                ts=time.time(),
                kv_blocks_total=blocks + free,
                kv_blocks_free=free,
            ),
        )

    beat = asyncio.create_task(periodic(cfg.load_interval, heartbeat, stop))
    metrics.serve_metrics(cfg.metrics_port, cfg.metrics_bind)
    metrics.SERVICE_INFO.labels(ROLE, cfg.instance_id).set(1)
    announce_ready(ROLE, cfg.instance_id, f"grpc={addr} incarnation={incarnation}")
    if on_ready is not None:
        on_ready(store, addr)
    try:
        await stop.wait()
    finally:
        await server.stop(1.0)
        try:  # best effort: commit outstanding SSD writes (write-behind, spills) and events
            await store.flush(timeout=cfg.flush_timeout)
        except TimeoutError as exc:
            log.warning("shutdown flush incomplete: %s", exc)
        await store.stop()
        beat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beat
        await sub.unsubscribe()
        await nc.drain()
        metrics.SERVICE_INFO.labels(ROLE, cfg.instance_id).set(0)


def main(argv: list[str]) -> None:
    cfg = KVStoreConfig.load(argv, role=ROLE)
    setup_logging(ROLE, cfg.instance_id, cfg.log_level)
    run(lambda stop: run_kvstore(cfg, stop))
