"""A model instance's link to the KV pool (kvstore DRAM + MinIO tiers).

- `load_prefix`: before a prefill (on a prefill instance, or on a decode instance that computes
  the prompt itself: the colocated shape, a failed push, a failover), find the longest reusable
  prefix (own memory first, then the pool) and fetch what the cost model says is cheaper to load
  than to recompute (or every pool block / none, by ``kv_pool_load``) as an `ExternalKV` the
  request carries into the engine: its scheduler takes the blocks in at admission, counted with
  the request's other blocks, like a prefix hit, so the engine computes only the rest. Each
  decision is counted and logged at debug level with its inputs.
- `load_blocks`: fetch given blocks (decode in pool mode) as an `ExternalKV`.
- `store_blocks`: offer blocks to the pool (prefill in pool mode, before decode pulls them).
- `offer`: the blocks the engine's save policy recorded since the last call (every computed
  one, or those that recur) and those evicted before their copy left go to the pool, less those
  the pool already holds; `flush`: at a graceful stop, every cached block it lacks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import NamedTuple

import torch
from prometheus_client import Counter

from shared.engine.port import EnginePort
from shared.engine.port_types import ExternalKV
from shared.kvcache_rules import pool_continuation
from shared.kvtransfer.frames import FrameError, frame_nbytes, frame_to_tensor, payload_nbytes
from shared.kvtransfer.pool import PoolClient
from shared.worker.cost import ReuseCostModel

log = logging.getLogger(__name__)

POOL_HIT_BLOCKS = Counter(
    "strata_prefix_pool_hit_blocks_total", "Prefix blocks loaded from the pool, by tier", ["tier"]
)
POOL_STORED_BLOCKS = Counter(
    "strata_prefix_pool_stored_blocks_total",
    "Blocks the pool accepted from this instance, by source",
    ["source"],  # "prefill" (pool mode, before decode pulls), "computed", "evicted", "shutdown"
)
POOL_DECISIONS = Counter(
    "strata_kv_pool_load_decisions_total",
    "Prefix lookups in the pool before computing a prompt, by outcome",
    ["decision"],  # DECISIONS
)
POOL_BAD_BLOCKS = Counter(
    "strata_kv_pool_bad_blocks_total",
    "Pool blocks that did not decode as this engine's blocks (corrupt, truncated, other shape)",
)
DECISIONS = ("miss", "load", "recompute", "unlisted")
"""``miss``: the pool holds no block right after the local prefix; ``load``: pool blocks were
loaded; ``recompute``: the pool held some but loading them was judged (or set) not worth it;
``unlisted``: not looked up, the scheduler's index placing none of the prompt's blocks in the
pool (`DecodeWork.pool_blocks`)."""


def count_pool_decision(decision: str) -> None:
    POOL_DECISIONS.labels(decision).inc()


for _d in DECISIONS:
    POOL_DECISIONS.labels(_d)
for _s in ("prefill", "computed", "evicted", "shutdown"):
    POOL_STORED_BLOCKS.labels(_s)


FLUSH_BATCH = 256
"""Blocks a stop's flush copies out of the engine per round (a whole engine cache copied at once
would double its memory at exit)."""


class PrefixLoad(NamedTuple):
    """What `PoolLink.load_prefix` found and fetched for one prompt."""

    hashes: list[str]  # the prompt's full-block hashes
    tiers: list[str | None]  # pool tier of each block (None: not in the pool)
    blocks: int  # blocks fetched from the pool for the engine
    nbytes: int  # their payload bytes
    external: ExternalKV | None = None  # what to hand `EnginePort.generate` (None: nothing)


class PoolLink:
    def __init__(
        self,
        addrs: list[str],
        fingerprint: str,
        cost: ReuseCostModel,
        port: EnginePort,
        int8: bool = False,
        load_mode: str = "auto",
    ):
        self.pool = PoolClient(addrs)
        self.fingerprint = fingerprint
        self.cost = cost
        self.port = port
        self.dtype = port.kv_spec.dtype
        self.int8 = int8
        self.load_mode = load_mode
        spec = port.kv_spec
        self.block_shape = (spec.num_layers, 2, spec.block_size, spec.kv_heads, spec.head_dim)

    async def load_prefix(self, context: list[int], mm, cache_salt: str = "") -> PrefixLoad:
        """Load the pool blocks worth loading right after the engine's own cached prefix (the
        prompt's blocks hashed under its ``cache_salt``)."""
        hashes, cached = await self.port.match_prefix(context, mm, cache_salt)
        if not hashes:
            return PrefixLoad(hashes, [], 0, 0)
        own = cached // self.cost.block_size
        tiers = await self.pool.lookup(hashes, self.fingerprint)
        rest = pool_continuation(own, tiers)
        if self.load_mode == "always":
            want = rest
        elif self.load_mode == "never":
            want = []
        else:  # shared.kvcache_rules: local prefix, then the cost-worthy part of the pool's
            want = list(self.cost.plan(own, tiers).pool_tiers)
        decision = "miss" if not rest else "load" if want else "recompute"
        count_pool_decision(decision)
        log.debug(
            "pool prefix: %d blocks, %d local, pool continuation %s, recompute %.2e s/block, "
            "load %s s/block, mode %s: %s %d",
            len(hashes),
            own,
            {t: rest.count(t) for t in set(rest)},
            self.cost.recompute_s(1),
            {t: f"{self.cost.load_s_per_block.get(t, 0.0):.2e}" for t in set(rest)},
            self.load_mode,
            decision,
            len(want),
        )
        if not want:
            return PrefixLoad(hashes, tiers, 0, 0)
        ext, nbytes = await self.load_blocks(hashes[own : own + len(want)], want)
        return PrefixLoad(hashes, tiers, 0 if ext is None else len(ext.hashes), nbytes, ext)

    async def load_blocks(
        self, want: list[str], tiers: list[str | None] | None = None
    ) -> tuple[ExternalKV | None, int]:
        """Pull ``want`` from the pool: its present, usable leading run as an `ExternalKV` for
        `EnginePort.generate` (None when the first block is missing), and its payload bytes."""
        t0 = time.perf_counter()
        frames = await self.pool.get_frames(want, self.fingerprint)
        run, blocks = [], []
        for h in want:  # the present, usable leading run
            f = frames.get(h)
            if f is None:
                break
            t = self._block(h, f)
            if t is None:
                break
            run.append(f)
            blocks.append(t)
        n = len(run)
        if n == 0:
            return None, 0
        kv = torch.stack(blocks, dim=2)  # [L, 2, n, bs, kvh, hd]
        nbytes = sum(frame_nbytes(f) for f in run)
        elapsed = time.perf_counter() - t0
        tiers = list(tiers or ["dram"] * n)[:n]
        for tier in set(tiers):
            cnt = sum(1 for t in tiers if t == tier)
            self.cost.observe_load(tier or "dram", cnt, elapsed * cnt / n)
            POOL_HIT_BLOCKS.labels(tier or "dram").inc(cnt)
        return ExternalKV(want[:n], kv, tiers[0] or "dram"), nbytes

    def _block(self, h: str, frame) -> torch.Tensor | None:
        """The frame as this engine's block ``[L, 2, bs, kvh, hd]``, or None when it is not one
        (a corrupt or truncated object, another shape): counted, and the prompt is computed
        from that block on instead of failing."""
        try:
            t = frame_to_tensor(frame, dtype=self.dtype)
        except FrameError as exc:
            why = str(exc)
        else:
            if tuple(t.shape) == self.block_shape:
                return t
            why = f"shape {list(t.shape)}, this engine's blocks are {list(self.block_shape)}"
        POOL_BAD_BLOCKS.inc()
        log.warning("pool block %s unusable (%s): computing the prompt from it on", h[:16], why)
        return None

    async def read_new_blocks(
        self, request_id: str, hashes: list[str], tiers: list[str | None]
    ) -> list[tuple[str, torch.Tensor]]:
        """The held request's full blocks that the pool lacks, as (hash, [L,2,bs,kvh,hd])."""
        idx = [i for i, t in enumerate(tiers) if t is None]
        if not idx:
            return []
        kv = (await self.port.read_kv(request_id, block_indices=idx)).blocks
        return [(hashes[i], kv[:, :, j].contiguous()) for j, i in enumerate(idx)]

    async def store_blocks(
        self, blocks: list[tuple[str, torch.Tensor]], source: str = "prefill"
    ) -> int:
        """Offer ``blocks`` to the pool; returns the payload bytes of those it accepted."""
        if not blocks:
            return 0
        stored = set(await self.pool.put(blocks, self.fingerprint, int8=self.int8))
        POOL_STORED_BLOCKS.labels(source).inc(len(stored))
        return sum(payload_nbytes(t, self.int8) for h, t in blocks if h in stored)

    async def offer(self) -> int:
        """Blocks the engine's save policy recorded since the last call (``pool_save``) and
        blocks evicted before their copy left go to the pool, less those it already holds
        (stored by another instance meanwhile). Returns the payload bytes the pool accepted."""
        return (await self._offer("computed", 0))[1]

    async def _offer(self, label: str, limit: int) -> tuple[int, int]:
        """`offer` with the recorded blocks counted under ``label``, the oldest ``limit`` of
        them when set: (recorded blocks drained, payload bytes the pool accepted)."""
        sent = drained = 0
        for source, blocks in (
            (label, await self.port.drain_computed(limit)),
            ("evicted", await self.port.drain_evicted()),
        ):
            drained += len(blocks) if source == label else 0
            if not blocks:
                continue
            tiers = await self.pool.lookup([b.hash for b in blocks], self.fingerprint)
            new = [(b.hash, b.kv) for b, t in zip(blocks, tiers, strict=True) if t is None]
            sent += await self.store_blocks(new, source)
        return drained, sent

    async def flush(self, timeout: float) -> int:
        """A graceful stop: hand the pool every cached block it has not been given (what the
        "reused" policy held back), `FLUSH_BATCH` blocks at a time, within ``timeout`` seconds;
        returns the payload bytes it accepted (what is left when the time runs out is lost: a
        cache loses nothing it needs)."""
        await self.port.offer_all()
        sent = 0
        try:
            async with asyncio.timeout(timeout):
                while True:  # FLUSH_BATCH blocks at a time: never a copy of the whole cache
                    drained, got = await self._offer("shutdown", FLUSH_BATCH)
                    sent += got
                    if drained < FLUSH_BATCH:
                        return sent
        except TimeoutError:
            log.warning("pool flush at stop took over %.0f s: the rest is not saved", timeout)
            return sent
