"""A model instance's link to the KV pool (kvstore DRAM + MinIO tiers).

- `load_prefix`: before a prefill, find the longest reusable prefix (own memory first, then the
  pool), load what the cost model says is cheaper to load than to recompute, and insert it into
  the engine as cached blocks, so the engine computes only the rest.
- `load_blocks`: pull given blocks (decode in pool mode), reporting the payload bytes written.
- `store_blocks`: after a prefill, offer the full blocks the pool does not hold yet.
- `offer_evicted`: blocks the engine evicts go to the pool instead of being dropped.
"""

from __future__ import annotations

import logging
import time

import torch
from prometheus_client import Counter

from shared.engine.port import EnginePort
from shared.kvtransfer.frames import frame_nbytes, frame_to_tensor, payload_nbytes
from shared.kvtransfer.pool import PoolClient
from shared.worker.cost import ReuseCostModel

log = logging.getLogger(__name__)

POOL_HIT_BLOCKS = Counter(
    "strata_prefix_pool_hit_blocks_total", "Prefix blocks loaded from the pool, by tier", ["tier"]
)
POOL_STORED_BLOCKS = Counter("strata_prefix_pool_stored_blocks_total", "Blocks offered to pool")


class PoolLink:
    def __init__(
        self,
        addrs: list[str],
        fingerprint: str,
        cost: ReuseCostModel,
        port: EnginePort,
        int8: bool = False,
    ):
        self.pool = PoolClient(addrs)
        self.fingerprint = fingerprint
        self.cost = cost
        self.port = port
        self.dtype = port.kv_spec.dtype
        self.int8 = int8

    async def load_prefix(self, context: list[int], mm) -> tuple[list[str], list[str | None], int]:
        """Returns (block hashes, pool tier per block, blocks loaded from the pool)."""
        hashes, cached = await self.port.match_prefix(context, mm)
        if not hashes:
            return hashes, [], 0
        own = cached // self.cost.block_size
        tiers = await self.pool.lookup(hashes, self.fingerprint)
        plan = self.cost.plan(own, tiers)  # shared.kvcache_rules: local prefix, then the pool
        if plan.pool_blocks == 0:
            return hashes, tiers, 0
        n, _ = await self.load_blocks(hashes[own : plan.blocks], list(plan.pool_tiers))
        return hashes, tiers, n

    async def load_blocks(
        self, want: list[str], tiers: list[str | None] | None = None
    ) -> tuple[int, int]:
        """Pull ``want`` from the pool and insert its present leading run into the engine as
        cached blocks. Returns (blocks loaded, payload bytes of the blocks written into the
        engine: blocks it already held are skipped and not counted)."""
        t0 = time.perf_counter()
        frames = await self.pool.get_frames(want, self.fingerprint)
        n = 0
        while n < len(want) and want[n] in frames:
            n += 1
        if n == 0:
            return 0, 0
        run = [frames[h] for h in want[:n]]
        kv = torch.stack([frame_to_tensor(f, dtype=self.dtype) for f in run], dim=2)
        written = await self.port.insert_cached_blocks(want[:n], kv)  # [L, 2, n, bs, kvh, hd]
        nbytes = sum(frame_nbytes(f) for f, w in zip(run, written, strict=True) if w)
        elapsed = time.perf_counter() - t0
        tiers = list(tiers or ["dram"] * n)[:n]
        for tier in set(tiers):
            cnt = sum(1 for t in tiers if t == tier)
            self.cost.observe_load(tier or "dram", cnt, elapsed * cnt / n)
            POOL_HIT_BLOCKS.labels(tier or "dram").inc(cnt)
        return n, nbytes

    async def read_new_blocks(
        self, request_id: str, hashes: list[str], tiers: list[str | None]
    ) -> list[tuple[str, torch.Tensor]]:
        """The held request's full blocks that the pool lacks, as (hash, [L,2,bs,kvh,hd])."""
        idx = [i for i, t in enumerate(tiers) if t is None]
        if not idx:
            return []
        kv = (await self.port.read_kv(request_id, block_indices=idx)).blocks
        return [(hashes[i], kv[:, :, j].contiguous()) for j, i in enumerate(idx)]

    async def store_blocks(self, blocks: list[tuple[str, torch.Tensor]]) -> int:
        """Offer ``blocks`` to the pool; returns the payload bytes of those it accepted."""
        if not blocks:
            return 0
        stored = set(await self.pool.put(blocks, self.fingerprint, int8=self.int8))
        POOL_STORED_BLOCKS.inc(len(stored))
        return sum(payload_nbytes(t, self.int8) for h, t in blocks if h in stored)

    async def offer_evicted(self) -> int:
        evicted = await self.port.drain_evicted()
        return await self.store_blocks([(b.hash, b.kv) for b in evicted])
