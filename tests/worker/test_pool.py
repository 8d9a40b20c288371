"""KV pool reuse across prefill instances, over real NATS, real gRPC, a real kvstore and MinIO.

A prefix computed on prefill A is reused by prefill B through the pool: B computes only the new
tokens and its output equals a cold run's. Pool-mode transfer (decode pulls from the kvstore)
gives the same tokens as direct transfer. Each step asserts on the transfer counters which path
moved how many bytes (`kv_counters`): recompute would give the same tokens.
"""

from __future__ import annotations

import asyncio

import pytest

from shared.protocol import subjects
from shared.protocol.sampling import SamplingParams
from shared.protocol.work import DecodeWork, PrefillWork
from tests.worker.conftest import kv_workers
from tests.worker.kv_counters import Transfers, assert_moved, kv_bytes
from tests.worker.test_pd import _run, _tokens

MAX_TOKENS = 8


@pytest.fixture
async def cluster(nats_url, nc, model_dir, kvstore):
    _, addr = kvstore
    specs = [("prefill", "pa", {}), ("prefill", "pb", {}), ("decode", "dd", {})]
    # layerwise: the tests assert that path; every computed block written through (`all`, a
    # CUDA box's default), so B finds A's prefix after A served it once
    async with kv_workers(
        nc, nats_url, model_dir, addr, specs, layerwise_transfer=True, kv_pool_save="all"
    ) as ws:
        yield ws


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
    from shared.worker.pool_link import POOL_HIT_BLOCKS

    pa, pb, dd = cluster
    shared_prefix = [(i * 37 + 11) % 2000 + 10 for i in range(160)]  # 10 full blocks
    p1 = shared_prefix + [5, 6, 7, 8, 9]
    p2 = shared_prefix + [21, 22, 23]
    p3 = [(i * 53 + 7) % 2000 + 10 for i in range(100)]  # 6 full blocks, new to everyone
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    def item(rid, prompt, **kw):
        return PrefillWork(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling=params,
            decode_instance="dd",
            decode_addr=dd.addr,
            **kw,
        )

    t = Transfers()
    await _run(nc, subjects.prefill_submit("pa"), item("r-a", p1))
    assert_moved(t.moved(), "layerwise", kv_bytes(dd.rt, len(p1)))
    link = pa.svc.pool
    hashes = (await pa.rt.port.match_prefix(shared_prefix)).hashes
    assert len(hashes) == 10
    await _wait_stored(link, hashes)

    t, pool_hits = Transfers(), POOL_HIT_BLOCKS.labels("dram")._value.get()
    chunks = await _run(nc, subjects.prefill_submit("pb"), item("r-b", p2))
    last = max(chunks, key=lambda c: c.index)
    assert last.usage.cached_tokens == 160  # B computed only the 3 new tokens
    # B loaded the 10 prefix blocks from the kvstore's DRAM tier, then pushed the whole prompt
    assert POOL_HIT_BLOCKS.labels("dram")._value.get() - pool_hits == 10
    assert_moved(t.moved(), "layerwise", kv_bytes(dd.rt, len(p2)), kvstore_hits_dram=10)
    cold = LLMEngine(load_model(model_dir), EngineConfig(kv_cache_bytes=8 << 20))
    assert _tokens(chunks) == cold.generate([p2], params)[0]

    # Pool mode: decode pulls the full blocks from the kvstore instead of a direct push; the
    # partial tail (4 tokens) is recomputed there, so only full blocks move.
    t = Transfers()
    chunks = await _run(nc, subjects.prefill_submit("pb"), item("r-pool", p3, transfer_mode="pool"))
    assert _tokens(chunks) == cold.generate([p3], params)[0]
    assert_moved(t.moved(), "pool", kv_bytes(dd.rt, 6 * 16), kvstore_hits_dram=6)


async def test_pool_blocks_missing_fall_back_to_recompute(cluster, nc, model_dir):
    """Decode told to pull blocks the pool never had: it recomputes and the fallback counter
    says why, with no byte counted as received."""
    *_, dd = cluster
    prompt = [(i * 29 + 3) % 2000 + 10 for i in range(40)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    t = Transfers()
    work = DecodeWork(
        request_id="r-miss",
        prompt_token_ids=prompt,
        sampling=params,
        kv_block_hashes=["ab" * 16, "cd" * 16],
    )
    chunks = await _run(nc, subjects.decode_submit("dd"), work)
    assert t.moved() == {"fallback:pool_miss": 1}
    ref = await _run(
        nc,
        subjects.decode_submit("dd"),
        DecodeWork(request_id="r-miss-ref", prompt_token_ids=prompt, sampling=params),
    )
    assert _tokens(chunks) == _tokens(ref) and len(_tokens(ref)) == 4
