"""Global prefix index: which instance holds which KV block hash, in which tier.

Fed with `KVEvent`s (stored / removed, tier engine|dram|ssd, sequence-numbered per instance and
incarnation). Engine-tier blocks are per instance (a prefill or decode instance's own cache);
dram/ssd blocks belong to the shared pool (kvstore instances), wherever they live.

`lookup(hashes)` walks the chained block hashes of a prompt and returns, per instance, how many
leading blocks it holds in its engine tier, and how many leading blocks the pool can serve (split
into DRAM and SSD by the fastest tier holding each). Pure Python: no NATS.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field

import xxhash

from shared.protocol.kv import KVEvent
from shared.protocol.subjects import kv_events

ENGINE, DRAM, SSD = 1, 2, 4
_TIER_BIT = {"engine": ENGINE, "dram": DRAM, "ssd": SSD}
_HASH = re.compile(r"[0-9a-f]{32}")  # a block hash on the wire (`hashing.to_hex`: 16 bytes)
MAX_EVENT_HASHES = 65536
"""Most hashes one event may carry (publishers split far below this)."""


def event_problem(ev: KVEvent, subject: str) -> str | None:
    """Why a decoded KV event received on ``subject`` must not be applied, or None. The schema
    (tier, kind, types) is checked by decoding; this checks what it cannot: the event names the
    instance whose subject it came on, a non-empty incarnation, a sequence number >= 0 and
    block hashes in the wire format (32 lowercase hex digits)."""
    if not ev.instance_id or subject != kv_events(ev.instance_id):
        return f"instance_id {ev.instance_id[:64]!r} does not match the subject"
    if not ev.incarnation or len(ev.incarnation) > 128:
        return "incarnation must be 1-128 characters"
    if ev.seq < 0:
        return f"seq {ev.seq} is negative"
    if len(ev.hashes) > MAX_EVENT_HASHES:
        return f"{len(ev.hashes)} hashes in one event (at most {MAX_EVENT_HASHES})"
    for h in ev.hashes:
        if not _HASH.fullmatch(h):
            return f"block hash {h[:40]!r} is not 32 lowercase hex digits"
    return None


@dataclass
class IndexMatch:
    """Leading blocks of a prompt found in the index. ``pool_tiers[i]`` is the fastest pool
    tier holding block ``i`` ("dram" | "ssd" | None), walked as far as an engine prefix or the
    pool reaches, so the pool's continuation after any instance's local prefix can be read off
    (`shared.kvcache_rules.pool_continuation`); ``pool_dram_blocks`` / ``pool_ssd_blocks`` split
    the pool's run from block 0."""

    engine_blocks: dict[str, int] = field(default_factory=dict)  # instance -> leading blocks
    pool_dram_blocks: int = 0
    pool_ssd_blocks: int = 0
    pool_tiers: list[str | None] = field(default_factory=list)

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
        # Optimistic engine-tier entries: blocks of prompts just routed to an instance, counted
        # as held there until ``deadline`` (their "stored" event comes only after the prompt
        # was computed, which under load can be seconds later). Not part of `digest()`.
        self._expected: dict[str, dict[str, float]] = {}  # hash -> instance -> deadline
        self._expect_q: deque[tuple[float, str, str]] = deque()

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
                exp = self._expected.get(h)
                if exp is not None and ev.tier == "engine":
                    exp.pop(inst, None)
                    if not exp:
                        del self._expected[h]
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

    def expect(self, instance_id: str, hashes: list[str], deadline: float) -> None:
        """``instance_id`` is about to compute ``hashes`` (a request was routed there): count
        them as in its engine cache until ``deadline`` or until a "removed" event."""
        for h in hashes:
            self._expected.setdefault(h, {})[instance_id] = deadline
            self._expect_q.append((deadline, h, instance_id))

    def expire(self, now: float) -> None:
        """Forget expectations whose deadline passed (amortised O(1) per expectation)."""
        q = self._expect_q
        while q and q[0][0] <= now:
            _, h, inst = q.popleft()
            exp = self._expected.get(h)
            if exp is not None and exp.get(inst, now + 1) <= now:
                del exp[inst]
            if exp is not None and not exp:
                del self._expected[h]

    # --- snapshots ------------------------------------------------------------------------------
    def state(self) -> dict:
        """Everything `digest()` covers plus what `apply` needs to stay correct afterwards
        (incarnations, retired incarnations, last seq per instance). Expectations are not kept:
        they are seconds-lived hints."""
        return {
            "holders": {h: dict(v) for h, v in list(self._holders.items())},
            "incarnation": dict(self._incarnation),
            "retired": {k: sorted(v) for k, v in self._retired.items()},
            "seq": dict(self._seq),
            "events_applied": self.events_applied,
        }

    @classmethod
    def from_state(cls, state: dict) -> PrefixIndex:
        idx = cls()
        idx._holders = {h: dict(v) for h, v in state["holders"].items()}
        for h, holders in idx._holders.items():
            for inst in holders:
                idx._by_instance.setdefault(inst, set()).add(h)
        idx._incarnation = dict(state["incarnation"])
        idx._retired = {k: set(v) for k, v in state["retired"].items()}
        idx._seq = dict(state["seq"])
        idx.events_applied = int(state["events_applied"])
        return idx

    # --- queries --------------------------------------------------------------------------------
    def digest(self) -> int:
        """Order-independent 48-bit digest of the contents (block, instance, tier bits): two
        indexes that hold the same state have the same digest (a rebuilt index is compared with
        a live one this way, e.g. through the ``strata_scheduler_prefix_index_digest`` gauge)."""
        acc = 0
        # list() copies in one C call: safe while the event loop thread keeps applying events
        for h, holders in list(self._holders.items()):
            for inst, bits in list(holders.items()):
                acc ^= xxhash.xxh64_intdigest(f"{h}|{inst}|{bits}".encode())
        return acc & ((1 << 48) - 1)  # exact in a float64 gauge

    def lookup(self, hashes: list[str], now: float | None = None) -> IndexMatch:
        """Leading blocks of ``hashes`` per instance (engine tier, counting unexpired
        expectations when ``now`` is given) and the pool tier of each block, walked while some
        instance still holds every block so far or the pool holds the block."""
        match = IndexMatch()
        current: set[str] | None = None  # instances holding every block so far (engine tier)
        pool_run = True  # the pool holds every block so far
        tiers_out = match.pool_tiers
        expected = self._expected if now is not None else {}
        if now is not None:
            self.expire(now)
        for i, h in enumerate(hashes):
            holders = self._holders.get(h)
            exp = expected.get(h)
            if not holders and not exp:
                break
            holders = holders or {}
            if current is None or current:
                engine = {inst for inst, bits in holders.items() if bits & ENGINE}
                if exp:
                    engine.update(exp)
                current = engine if current is None else current & engine
                for inst in current:
                    match.engine_blocks[inst] = i + 1
            tiers = 0
            for bits in holders.values():
                tiers |= bits
            tier = "dram" if tiers & DRAM else "ssd" if tiers & SSD else None
            if tier is None and not current:
                break
            tiers_out.append(tier)
            if pool_run and tier == "dram":
                match.pool_dram_blocks += 1
            elif pool_run and tier == "ssd":
                match.pool_ssd_blocks += 1
            else:
                pool_run = False
        while tiers_out and tiers_out[-1] is None:
            tiers_out.pop()
        return match
