"""Run a kvstore service in-process (real NATS, real MinIO, real gRPC) for the service tests."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

import pytest
import torch

from services.kvstore.app import run_kvstore
from services.kvstore.config import KVStoreConfig
from services.kvstore.store import KVStore
from shared.kvtransfer.frames import tensor_to_frames

BLOCK_SHAPE = (2, 2, 16, 2, 8)  # layers, k/v, tokens, kv heads, head dim -> 2 KiB float32
BLOCK_BYTES = 2 * 2 * 16 * 2 * 8 * 4


@dataclass
class Running:
    cfg: KVStoreConfig
    store: KVStore
    addr: str
    stop: asyncio.Event
    task: asyncio.Task

    async def shutdown(self) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, 15)


async def start_kvstore(nats_url: str, minio=None, bucket: str = "", **kw) -> Running:
    fields = dict(
        nats_url=nats_url,
        instance_id=kw.pop("instance_id", f"kv-{uuid.uuid4().hex[:6]}"),
        load_interval=0.2,
        retry_interval=0.2,
        minio_timeout=2.0,
    )
    if minio is not None:
        fields.update(
            minio_endpoint=minio.endpoint,
            minio_access_key=minio.access_key,
            minio_secret_key=minio.secret_key,
            minio_bucket=bucket or new_bucket(),
        )
    fields.update(kw)
    cfg = KVStoreConfig.model_validate(fields)
    stop, ready = asyncio.Event(), asyncio.get_running_loop().create_future()
    task = asyncio.create_task(run_kvstore(cfg, stop, lambda s, a: ready.set_result((s, a))))
    done, _ = await asyncio.wait([ready, task], timeout=30, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        task.result()  # raises the start-up error
    store, addr = ready.result()
    return Running(cfg, store, addr, stop, task)


def new_bucket() -> str:
    return f"kv-{uuid.uuid4().hex[:10]}"


def block(seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(BLOCK_SHAPE, generator=torch.Generator().manual_seed(seed)).to(dtype)


def block_frames(h: str, t: torch.Tensor, fp: str = "fp-a", **kw):
    return tensor_to_frames(
        t, key=h, fingerprint=fp, layer_end=t.shape[0], num_tokens=t.shape[2], **kw
    )


@pytest.fixture
async def kvstore(nats_url, minio_server):
    """A kvstore over the session MinIO with a fresh bucket and a DRAM budget of ~4 blocks."""
    running = await start_kvstore(nats_url, minio_server, dram_bytes=4 * (BLOCK_BYTES + 256) + 10)
    yield running
    if not running.task.done():
        await running.shutdown()
