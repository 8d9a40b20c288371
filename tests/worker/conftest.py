"""Fixtures of the in-process worker tests: the built-in model and a kvstore on real MinIO."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from services.kvstore.app import run_kvstore
from services.kvstore.config import KVStoreConfig


@pytest.fixture(scope="module")
def model_dir():
    from services.cluster_config import ensure_model

    return ensure_model("")


@pytest.fixture
async def kvstore(nats_url, minio_server):
    """A kvstore (64 MiB DRAM over a MinIO bucket) served in this process: (store, gRPC addr)."""
    cfg = KVStoreConfig.load(
        [],
        role="kvstore",
        instance_id="kv-test",
        nats_url=nats_url,
        minio_endpoint=minio_server.endpoint,
        minio_access_key=minio_server.access_key,
        minio_secret_key=minio_server.secret_key,
        minio_bucket="strata-kv-pool-test",
        dram_bytes=64 << 20,
    )
    stop = asyncio.Event()
    ready: asyncio.Future = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        run_kvstore(cfg, stop, on_ready=lambda s, a: ready.set_result((s, a)))
    )
    store, addr = await asyncio.wait_for(ready, 30)
    yield store, addr
    stop.set()
    await task


@contextlib.asynccontextmanager
async def kv_workers(nc, nats_url: str, model_dir: str, kvstore_addr: str, specs, **common):
    """Prefill and decode workers served in this process on ``model_dir`` (8 MiB of KV cache and
    load reports every 0.2 s unless set), using the kvstore at ``kvstore_addr``: one per ``(role, instance_id,
    fields)`` of ``specs`` (``fields``: `WorkerConfig` fields of that worker alone), with the
    fields in ``common`` for all. Yields them in ``specs`` order; stops them on exit."""
    from services.decode.service import DecodeService
    from services.prefill.service import PrefillService
    from shared.worker.app import start_worker
    from shared.worker.config import WorkerConfig

    workers = []
    try:
        for role, iid, fields in specs:
            settings = {"kv_cache_bytes": 8 << 20, "load_interval": 0.2, **common, **fields}
            cfg = WorkerConfig.load(
                [],
                role=role,
                instance_id=iid,
                nats_url=nats_url,
                model=model_dir,
                kvstore_addrs=kvstore_addr,
                **settings,
            )
            cls = {"prefill": PrefillService, "decode": DecodeService}[role]
            workers.append(await start_worker(cfg, role, cls, nc))
        yield workers
    finally:
        for w in workers:
            await w.stop()
