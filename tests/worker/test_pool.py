"""KV pool reuse across prefill instances, over real NATS, real gRPC, a real kvstore and MinIO.

A prefix computed on prefill A is reused by prefill B through the pool: B computes only the new
tokens and its output equals a cold run's. Pool-mode transfer (decode pulls from the kvstore)
gives the same tokens as direct transfer.
"""

from __future__ import annotations

import asyncio

import pytest

from services.decode.service import DecodeService
from services.kvstore.app import run_kvstore
from services.kvstore.config import KVStoreConfig
from services.prefill.service import PrefillService
from services.worker.app import start_worker
from services.worker.config import WorkerConfig
from shared.engine.params import SamplingParams
from shared.protocol import subjects
from tests.worker.test_pd import _run, _tokens

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir():
    from services.launcher import ensure_model

    return ensure_model("")


@pytest.fixture
async def kvstore(nats_url, minio_server):
    cfg = KVStoreConfig.load([], role="kvstore", instance_id="kv-test", nats_url=nats_url,
                             minio_endpoint=minio_server.endpoint, minio_bucket="strata-kv-pool-test",
                             dram_bytes=64 << 20)
    stop = asyncio.Event()
    ready: asyncio.Future = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(run_kvstore(cfg, stop, on_ready=lambda s, a: ready.set_result((s, a))))
    store, addr = await asyncio.wait_for(ready, 30)
    yield store, addr
    stop.set()
    await task


@pytest.fixture
async def cluster(nats_url, nc, model_dir, kvstore):
    _, addr = kvstore
    common = dict(nats_url=nats_url, model=model_dir, kv_cache_bytes=8 << 20, load_interval=0.2,
                  kvstore_addrs=addr)
    workers = []
    for role, iid, cls in (("prefill", "pa", PrefillService), ("prefill", "pb", PrefillService),
                           ("decode", "dd", DecodeService)):
        cfg = WorkerConfig.load([], role=role, instance_id=iid, **common)
        workers.append(await start_worker(cfg, role, cls, nc))
    yield workers
    for w in workers:
        await w.stop()


async def _wait_stored(link, hashes: list[str], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        tiers = await link.pool.lookup(hashes, link.fingerprint)
        if all(t is not None for t in tiers):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("prefill never stored its blocks in the pool")


async def test_prefix_computed_on_a_is_reused_on_b(cluster, nc, model_dir):
    from shared.engine.engine import LLMEngine
    from shared.engine.params import EngineConfig
    from shared.model.loader import load_model

    pa, pb, dd = cluster
    shared_prefix = [(i * 37 + 11) % 2000 + 10 for i in range(160)]  # 10 full blocks
    p1 = shared_prefix + [5, 6, 7, 8, 9]
    p2 = shared_prefix + [21, 22, 23]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    def item(rid, prompt, **kw):
        from shared.protocol.work import WorkItem

        return WorkItem(request_id=rid, prompt_token_ids=prompt, sampling=params,
                        decode_instance="dd", decode_addr=dd.addr, **kw)

    await _run(nc, subjects.prefill_submit("pa"), item("r-a", p1))
    link = pa.svc.pool
    hashes = await pa.rt.async_engine.call(lambda e: e.block_hashes_for(shared_prefix))
    assert len(hashes) == 10
    await _wait_stored(link, hashes)

    chunks = await _run(nc, subjects.prefill_submit("pb"), item("r-b", p2))
    last = max(chunks, key=lambda c: c.index)
    assert last.usage.cached_tokens == 160  # B computed only the 3 new tokens
    cold = LLMEngine(load_model(model_dir), EngineConfig(kv_cache_bytes=8 << 20))
    assert _tokens(chunks) == cold.generate([p2], params)[0]

    # Pool mode: decode pulls the blocks from the kvstore instead of a direct push.
    chunks = await _run(nc, subjects.prefill_submit("pb"),
                        item("r-pool", p1, transfer_mode="pool"))
    assert _tokens(chunks) == cold.generate([p1], params)[0]
