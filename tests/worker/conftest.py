"""Fixtures of the in-process worker tests: the built-in model and a kvstore on real MinIO."""

from __future__ import annotations

import asyncio

import pytest

from services.kvstore.app import run_kvstore
from services.kvstore.config import KVStoreConfig


@pytest.fixture(scope="module")
def model_dir():
    from services.launcher import ensure_model

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
