"""A model instance's link to the KV pool (kvstore DRAM + MinIO tiers).

- `load_prefix`: before a prefill, find the longest reusable prefix (own memory first, then the
  pool), load what the cost model says is cheaper to load than to recompute, and insert it into
  the engine as cached blocks, so the engine computes only the rest.
- `store_blocks`: after a prefill, offer the full blocks the pool does not hold yet.
- `offer_evicted`: blocks the engine evicts go to the pool instead of being dropped.
"""

from __future__ import annotations

import logging
import time

import torch
from prometheus_client import Counter

from services.worker.cost import CostModel
from shared.kvtransfer.pool import PoolClient

log = logging.getLogger(__name__)

POOL_HIT_BLOCKS = Counter("strata_prefix_pool_hit_blocks_total", "Prefix blocks loaded from the "
                          "pool, by tier", ["tier"])
POOL_STORED_BLOCKS = Counter("strata_prefix_pool_stored_blocks_total", "Blocks offered to pool")


class PoolLink:
    def __init__(self, addrs: list[str], fingerprint: str, cost: CostModel, ae,
                 dtype: torch.dtype, int8: bool = False):
        self.pool = PoolClient(addrs)
        self.fingerprint = fingerprint
        self.cost = cost
        self.ae = ae
        self.dtype = dtype
        self.int8 = int8

    async def load_prefix(self, context: list[int], mm) -> tuple[list[str], list[str | None], int]:
        """Returns (block hashes, pool tier per block, blocks loaded from the pool)."""
        hashes = await self.ae.call(lambda e: e.block_hashes_for(context, mm))
        if not hashes:
            return hashes, [], 0
        own = await self.ae.call(lambda e: e.match_prefix(context, mm)) // self.cost.block_size
        tiers = await self.pool.lookup(hashes, self.fingerprint)
        rest = tiers[own:]
        k = self.cost.blocks_to_load(rest)
        if k == 0:
            return hashes, tiers, 0
        n = await self.load_blocks(hashes[own:own + k], rest[:k])
        return hashes, tiers, n

    async def load_blocks(self, want: list[str], tiers: list[str | None] | None = None) -> int:
        """Pull ``want`` from the pool and insert its present leading run into the engine as
        cached blocks; returns how many blocks were loaded."""
        t0 = time.perf_counter()
        got = await self.pool.get(want, self.fingerprint, dtype=self.dtype)
        n = 0
        while n < len(want) and want[n] in got:
            n += 1
        if n == 0:
            return 0
        kv = torch.stack([got[h] for h in want[:n]], dim=2)  # [L, 2, n, bs, kvh, hd]
        await self.ae.call(lambda e: e.insert_cached_blocks(want[:n], kv))
        elapsed = time.perf_counter() - t0
        tiers = list(tiers or ["dram"] * n)[:n]
        for tier in set(tiers):
            cnt = sum(1 for t in tiers if t == tier)
            self.cost.observe_load(tier or "dram", cnt, elapsed * cnt / n)
            POOL_HIT_BLOCKS.labels(tier or "dram").inc(cnt)
        return n

    async def read_new_blocks(
        self, request_id: str, hashes: list[str], tiers: list[str | None]
    ) -> list[tuple[str, torch.Tensor]]:
        """The held request's full blocks that the pool lacks, as (hash, [L,2,bs,kvh,hd])."""
        idx = [i for i, t in enumerate(tiers) if t is None]
        if not idx:
            return []

        def read(e):
            table, _ = e.request_blocks(request_id)
            return e.read_kv([table[i] for i in idx])

        kv = await self.ae.call(read)
        return [(hashes[i], kv[:, :, j].contiguous()) for j, i in enumerate(idx)]

    async def store_blocks(self, blocks: list[tuple[str, torch.Tensor]]) -> int:
        if not blocks:
            return 0
        stored = await self.pool.put(blocks, self.fingerprint, int8=self.int8)
        POOL_STORED_BLOCKS.inc(len(stored))
        return len(stored)

    async def offer_evicted(self) -> int:
        evicted = await self.ae.call(lambda e: e.drain_evicted_kv())
        return await self.store_blocks(evicted)
