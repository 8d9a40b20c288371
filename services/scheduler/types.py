"""Narrow types between the scheduler core, the routing policies and the simulator.

Policies see only these: an `InstanceView` per live instance, a `RequestView` (the request plus
its prefix matches, already looked up in the index) and a `CostModel`. They return a
`RouteDecision`.
Nothing here imports NATS; the simulator builds the same objects from simulated instances.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class InstanceView:
    """What the scheduler knows about one live prefill or decode instance."""

    instance_id: str
    role: str  # "prefill" | "decode"
    grpc_addr: str = ""
    num_running: int = 0
    num_waiting: int = 0
    waiting_tokens: int = 0  # prompt tokens queued for prefill (reported)
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    prefill_tokens_per_s: float = 0.0  # measured by the engine (0 = unknown: use the cost model)
    decode_tokens_per_s: float = 0.0
    step_s: float = 0.0  # mean engine step seconds over the last report interval
    block_size: int = 16
    reserved_long: bool = False  # length-aware: reserved for very long prompts
    # Work the scheduler routed here since the last load report (optimistic accounting, so a
    # burst between two reports does not all land on the same instance).
    pending_tokens: int = 0
    pending_requests: int = 0
    # Blocks the global prefix index says this instance holds (its cache footprint): new
    # prefixes go where it is smallest, so tenants spread over the fleet's caches.
    cached_blocks: int = 0

    @property
    def queued_tokens(self) -> int:
        return self.waiting_tokens + self.pending_tokens

    @property
    def batch(self) -> int:
        return self.num_running + self.num_waiting + self.pending_requests

    @property
    def kv_used_frac(self) -> float:
        if self.kv_blocks_total <= 0:
            return 0.0
        return 1.0 - self.kv_blocks_free / self.kv_blocks_total


@dataclass
class RequestView:
    """A request as the policies see it, with its prefix matches looked up in the index."""

    request_id: str
    num_prompt_tokens: int
    priority: int = 0  # lower = more important (engine convention)
    slo_class: str = "interactive"
    max_tokens: int = 16
    ttft_slo_s: float = 0.0  # 0 = no SLO check
    exclude: frozenset[str] = frozenset()
    # instance id -> tokens of the prompt's prefix already in that instance's engine cache
    cached_tokens: dict[str, int] = field(default_factory=dict)
    # contiguous prefix available in the pool (kvstore) from block 0, split by tier
    pool_dram_tokens: int = 0
    pool_ssd_tokens: int = 0
    # pool tier of each prompt block (None = absent), as far as the index walked: what the pool
    # can add after an instance's own prefix. Derived from the two fields above when not given.
    pool_tiers: tuple[str | None, ...] = ()
    block_tokens: int = 16

    def __post_init__(self) -> None:
        if not self.pool_tiers and self.pool_tokens:
            bt = self.block_tokens
            self.pool_tiers = ("dram",) * -(-self.pool_dram_tokens // bt) + ("ssd",) * -(
                -self.pool_ssd_tokens // bt
            )

    @property
    def pool_tokens(self) -> int:
        return self.pool_dram_tokens + self.pool_ssd_tokens


@dataclass
class ClusterState:
    """Live instances by role (excluded / down ones already removed), each sorted by id.
    Policies must not mutate the lists. ``prefill_table`` / ``decode_table``, when given, are
    numpy columns over exactly those lists (`table.RoleTable`, kept current by `Membership`);
    policies build their own when they are None."""

    prefill: list[InstanceView]
    decode: list[InstanceView]
    now: float = 0.0
    prefill_table: Any = None
    decode_table: Any = None


@dataclass(frozen=True)
class RouteDecision:
    """A policy's answer. ``prefill_instance == ""`` means the decode instance prefills itself.
    ``reject`` means the predicted TTFT breaks the request's SLO (retry after ``retry_after_s``)."""

    decode_instance: str = ""
    prefill_instance: str = ""
    cached_tokens: int = 0
    predicted_ttft_s: float = 0.0
    transfer_mode: str = "direct"
    reject: bool = False
    retry_after_s: float = 0.0
    reason: str = ""
    path: str = ""  # why the prompt prefills where it does: a `PREFILL_PATHS` key


@dataclass(frozen=True)
class CostModel:
    """Per-token costs behind the TTFT estimate. Defaults are replaced by measured engine rates
    (LoadReport.prefill_tokens_per_s) per instance when they are reported.

    Fields:
        prefill_tokens_per_s: prefill throughput of an instance that reports none.
        dram_tokens_per_s: rate at which pool-hit KV loads from the kvstore DRAM tier.
        ssd_tokens_per_s: rate at which pool-hit KV loads from the SSD (MinIO) tier.
        decode_step_s: one decode step at batch size 1.
        decode_step_per_seq_s: extra decode step time per running sequence.
        transfer_tokens_per_s: prefill -> decode KV push rate (overlapped; used for the estimate).
    """

    prefill_tokens_per_s: float = 8000.0
    dram_tokens_per_s: float = 200_000.0
    ssd_tokens_per_s: float = 40_000.0
    decode_step_s: float = 0.02
    decode_step_per_seq_s: float = 0.0002
    transfer_tokens_per_s: float = 400_000.0

    def prefill_rate(self, inst: InstanceView) -> float:
        return (
            inst.prefill_tokens_per_s
            if inst.prefill_tokens_per_s > 0
            else (self.prefill_tokens_per_s)
        )

    def queue_s(self, inst: InstanceView) -> float:
        """Time until ``inst`` starts a new prompt: its queued prompt tokens at its rate."""
        return inst.queued_tokens / self.prefill_rate(inst)

    def load_s(self, dram_tokens: int, ssd_tokens: int) -> float:
        return dram_tokens / self.dram_tokens_per_s + ssd_tokens / self.ssd_tokens_per_s

    def tier_rate(self, tier: str) -> float:
        """Tokens per second loaded from pool ``tier`` ("dram" | "ssd")."""
        return self.dram_tokens_per_s if tier == "dram" else self.ssd_tokens_per_s
