"""`strata.kv.events.<instance>`: blocks stored / removed per tier, sequence-numbered."""

from __future__ import annotations

from typing import Literal

from shared.protocol.base import Msg

Tier = Literal["engine", "dram", "ssd"]


class KVEvent(Msg):
    instance_id: str
    incarnation: str
    seq: int
    tier: Tier
    kind: Literal["stored", "removed"]
    hashes: list[str]
    ts: float = 0.0


class KVStoreStatsRequest(Msg):
    """`strata.admin.kvstore.<instance>`: ask a kvstore for its tier counts (leak checks)."""

    fingerprint: str | None = None  # reserved: counts are over all fingerprints for now


class KVStoreStats(Msg):
    """Block counts and bytes per tier of one kvstore instance, plus its counters."""

    instance_id: str
    incarnation: str
    grpc_addr: str = ""
    dram_blocks: int
    dram_bytes: int
    dram_budget_bytes: int
    dram_leased: int
    pending_spill_blocks: int
    pending_spill_bytes: int
    ssd_blocks: int
    ssd_bytes: int
    ssd_online: bool
    counters: dict[str, int] = {}
