"""Global prefix index: which instance holds which KV block hash, in which tier.

Fed with `KVEvent`s (stored / removed, tier engine|dram|ssd, sequence-numbered per instance and
incarnation). Engine-tier blocks are per instance (a prefill or decode instance's own cache);
dram/ssd blocks belong to the shared pool (kvstore instances), wherever they live.

`lookup(hashes)` walks the chained block hashes of a prompt and returns, per instance, how many
leading blocks it holds in its engine tier, and how many leading blocks the pool can serve (split
into DRAM and SSD by the fastest tier holding each). Pure Python: no NATS.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.protocol.kv import KVEvent

ENGINE, DRAM, SSD = 1, 2, 4
_TIER_BIT = {"engine": ENGINE, "dram": DRAM, "ssd": SSD}


@dataclass
class PrefixMatch:
    """Leading blocks of a prompt found in the index."""

    engine_blocks: dict[str, int] = field(default_factory=dict)  # instance -> leading blocks
    pool_dram_blocks: int = 0
    pool_ssd_blocks: int = 0

    @property
    def pool_blocks(self) -> int:
        return self.pool_dram_blocks + self.pool_ssd_blocks


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[str, dict[str, int]] = {}  # hash -> instance -> tier bits
        self._by_instance: dict[str, set[str]] = {}  # instance -> hashes it holds (any tier)
        self._incarnation: dict[str, str] = {}
        self._retired: dict[str, set[str]] = {}  # instance -> incarnations that are gone
        self._seq: dict[str, int] = {}  # instance -> last applied seq (current incarnation)
        self.events_applied = 0

    def __len__(self) -> int:
        """Number of distinct block hashes held anywhere."""
        return len(self._holders)

    def blocks_of(self, instance_id: str) -> int:
        return len(self._by_instance.get(instance_id, ()))

    # --- updates --------------------------------------------------------------------------------
    def apply(self, ev: KVEvent) -> bool:
        """Apply one event; returns False if it was stale (old incarnation) or a duplicate seq."""
        inst = ev.instance_id
        if ev.incarnation in self._retired.get(inst, ()):
            return False
        if self._incarnation.get(inst) != ev.incarnation:
            self.new_incarnation(inst, ev.incarnation)
        elif ev.seq <= self._seq.get(inst, -1):
            return False
        self._seq[inst] = ev.seq
        bit = _TIER_BIT[ev.tier]
        mine = self._by_instance.setdefault(inst, set())
        if ev.kind == "stored":
            for h in ev.hashes:
                holders = self._holders.setdefault(h, {})
                holders[inst] = holders.get(inst, 0) | bit
                mine.add(h)
        else:
            for h in ev.hashes:
                holders = self._holders.get(h)
                if holders is None or inst not in holders:
                    continue
                bits = holders[inst] & ~bit
                if bits:
                    holders[inst] = bits
                else:
                    del holders[inst]
                    mine.discard(h)
                    if not holders:
                        del self._holders[h]
        self.events_applied += 1
        return True

    def new_incarnation(self, instance_id: str, incarnation: str) -> None:
        """The instance restarted: its old blocks are gone; events of the old incarnation are
        ignored from now on."""
        old = self._incarnation.get(instance_id)
        if old == incarnation:
            return
        if old is not None:
            self._retired.setdefault(instance_id, set()).add(old)
        self.drop_instance(instance_id)
        self._incarnation[instance_id] = incarnation

    def drop_instance(self, instance_id: str) -> int:
        """Forget every block of ``instance_id``; returns how many were dropped."""
        hashes = self._by_instance.pop(instance_id, set())
        for h in hashes:
            holders = self._holders.get(h)
            if holders is not None:
                holders.pop(instance_id, None)
                if not holders:
                    del self._holders[h]
        self._seq.pop(instance_id, None)
        return len(hashes)

    # --- queries --------------------------------------------------------------------------------
    def lookup(self, hashes: list[str]) -> PrefixMatch:
        match = PrefixMatch()
        current: set[str] | None = None  # instances holding every block so far (engine tier)
        pool_open = True
        for i, h in enumerate(hashes):
            holders = self._holders.get(h)
            if not holders:
                break
            engine = {inst for inst, bits in holders.items() if bits & ENGINE}
            current = engine if current is None else current & engine
            for inst in current:
                match.engine_blocks[inst] = i + 1
            if pool_open:
                tiers = 0
                for bits in holders.values():
                    tiers |= bits
                if tiers & DRAM:
                    match.pool_dram_blocks += 1
                elif tiers & SSD:
                    match.pool_ssd_blocks += 1
                else:
                    pool_open = False
            if not current and not pool_open:
                break
        return match
