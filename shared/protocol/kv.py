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
