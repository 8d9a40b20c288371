"""Which leading blocks of a prompt are reused, from where, and at what cost: the one rule the
prefill worker (`shared/worker/pool_link.py`), the scheduler's TTFT estimate
(`services/scheduler/policies/basic.py`) and the simulator (`loadtests/simulator/sim.py`) apply.

An instance reuses the leading blocks it holds in its own engine cache for free. The pool
(kvstore DRAM, then the SSD tier) can serve the continuation *after* that local prefix, block by
block while it holds each one (a gap ends it). Of that continuation the instance loads the
leading ``k`` blocks that minimise ``load(k) + recompute(rest)``; everything after is computed.
The last prompt token is always computed (it produces the first token's logits).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

POOL_TIERS = ("dram", "ssd")


@dataclass(frozen=True)
class ReusePlan:
    """The reuse decision for one prompt on one instance.

    Fields:
        local_blocks: leading blocks reused from the instance's own engine cache.
        pool_tiers: tier of each pool block loaded right after them, in order.
        load_s: estimated seconds to load those pool blocks.
    """

    local_blocks: int = 0
    pool_tiers: tuple[str, ...] = ()
    load_s: float = 0.0

    @property
    def pool_blocks(self) -> int:
        return len(self.pool_tiers)

    @property
    def blocks(self) -> int:
        return self.local_blocks + len(self.pool_tiers)

    def cached_tokens(self, num_tokens: int, block_tokens: int, local_tokens: int = 0) -> int:
        """Prompt tokens that are not computed (at most ``num_tokens - 1``). ``local_tokens``:
        the engine's own hit in tokens when it is finer than whole blocks."""
        reused = max(local_tokens, self.blocks * block_tokens)
        return max(0, min(num_tokens - 1, reused))


def pool_continuation(local_blocks: int, tiers: Sequence[str | None]) -> list[str]:
    """Tiers of the pool blocks that continue a local prefix of ``local_blocks``: ``tiers[i]``
    is the pool tier holding block ``i`` of the prompt (None = not in the pool); the run starts
    at ``local_blocks`` and ends at the first block the pool lacks."""
    out: list[str] = []
    for tier in tiers[local_blocks:]:
        if tier is None:
            break
        out.append(tier)
    return out


def blocks_to_load(
    tiers: Sequence[str | None], recompute_s_per_block: float, load_s: Callable[[str], float]
) -> int:
    """How many leading pool blocks to load: the ``k`` that minimises ``load(k) +
    recompute(rest)`` (only a present, contiguous run is usable; ties keep the shorter run)."""
    best_k, best_saving, saving = 0, 0.0, 0.0
    for k, tier in enumerate(tiers, start=1):
        if tier is None:
            break
        saving += recompute_s_per_block - load_s(tier)
        if saving > best_saving:
            best_k, best_saving = k, saving
    return best_k


def plan_reuse(
    local_blocks: int,
    tiers: Sequence[str | None],
    recompute_s_per_block: float,
    load_s: Callable[[str], float],
) -> ReusePlan:
    """Local prefix first, then the cost-worthy part of the pool's continuation after it."""
    rest = pool_continuation(local_blocks, tiers)
    k = blocks_to_load(rest, recompute_s_per_block, load_s)
    loaded = tuple(rest[:k])
    return ReusePlan(local_blocks, loaded, sum(load_s(t) for t in loaded))
