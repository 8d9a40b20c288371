"""When is loading prefix KV from the pool cheaper than recomputing it? A measured answer.

Recompute cost is seconds per prompt token, measured on this instance (a warm-up prefill at
start, then every real prefill). Load cost is seconds per block per tier, measured on every
pool read. Both are exponentially weighted so the model follows the machine's current load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.kvcache_rules import ReusePlan, plan_reuse
from shared.kvcache_rules import blocks_to_load as _blocks_to_load

# Priors until the first measurement of a tier (seconds per block). Optimistic on purpose: a
# tier that is never tried is never measured; one slow load corrects the estimate (EWMA).
DEFAULT_LOAD_S = {"engine": 0.0, "dram": 2e-4, "ssd": 1e-3}


@dataclass
class ReuseCostModel:
    block_size: int
    prefill_s_per_token: float = 1e-3
    load_s_per_block: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_LOAD_S))
    alpha: float = 0.3

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.prefill_s_per_token = _ewma(self.prefill_s_per_token, seconds / tokens, self.alpha)

    def observe_load(self, tier: str, blocks: int, seconds: float) -> None:
        if blocks > 0 and seconds > 0:
            old = self.load_s_per_block.get(tier, seconds / blocks)
            self.load_s_per_block[tier] = _ewma(old, seconds / blocks, self.alpha)

    def recompute_s(self, blocks: int) -> float:
        return blocks * self.block_size * self.prefill_s_per_token

    def load_s(self, tiers: Sequence[str]) -> float:
        return sum(self.load_s_per_block.get(t, DEFAULT_LOAD_S["ssd"]) for t in tiers)

    def blocks_to_load(self, tiers: Sequence[str | None]) -> int:
        """How many leading pool blocks to load: the prefix length ``k`` that minimises
        ``load(k) + recompute(rest)`` (`shared.kvcache_rules.blocks_to_load`)."""
        return _blocks_to_load(tiers, self.recompute_s(1), self._tier_load_s)

    def plan(self, local_blocks: int, tiers: Sequence[str | None]) -> ReusePlan:
        """Own ``local_blocks`` first, then the pool blocks worth loading right after them
        (``tiers``: pool tier per prompt block, None = absent), by the measured costs."""
        return plan_reuse(local_blocks, tiers, self.recompute_s(1), self._tier_load_s)

    def _tier_load_s(self, tier: str) -> float:
        return self.load_s_per_block.get(tier, DEFAULT_LOAD_S["ssd"])


def _ewma(old: float, new: float, alpha: float) -> float:
    return (1 - alpha) * old + alpha * new
