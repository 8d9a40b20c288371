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
import sys
from array import array
from collections import deque
from collections.abc import Callable
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


SMALL_HOLDERS = 8
"""Up to this many holders a block's entry is a tuple; past it, a dict."""


def _key(h: str) -> bytes | str:
    """A block's key in the index: the 16 bytes of a wire hash (32 hex digits), or the string
    itself for any other name (the simulator's and tests' synthetic hashes)."""
    if len(h) == 32:
        try:
            return bytes.fromhex(h)
        except ValueError:
            pass
    return h


def _name(key: bytes | str) -> str:
    return key.hex() if type(key) is bytes else key


class PrefixIndex:
    """The index is kept compact, since it holds every block the engines and the pool hold (tens
    of millions at scale): a block is keyed by its 16-byte digest (not the 32-character hex
    string of the wire), instances by small slot numbers, and a block's holders are one int
    ``slot << 3 | tier bits`` when one instance holds it (the common case), a tuple of such ints
    for a few, a dict ``slot -> bits`` for many: about 120-180 bytes a block with one holder
    where a dict per block keyed by the hex string took 330-390 (docs/benchmarks/scheduler.md).
    `holders()` and `digest()` still name blocks and instances as the wire does."""

    def __init__(self) -> None:
        self._holders: dict[bytes | str, int | tuple[int, ...] | dict[int, int]] = {}
        self._by_slot: list[set[bytes | str]] = []  # slot -> digests it holds (any tier)
        self._names: list[str | None] = []  # slot -> instance id (None: free)
        self._slot: dict[str, int] = {}
        self._free_slots: list[int] = []
        self._many: set[bytes | str] = set()  # blocks whose holders are a dict (mutable)
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
        slot = self._slot.get(instance_id)
        return 0 if slot is None else len(self._by_slot[slot])

    # --- slots and holder entries ---------------------------------------------------------------
    def _slot_of(self, instance_id: str) -> int:
        slot = self._slot.get(instance_id)
        if slot is None:
            if self._free_slots:
                slot = self._free_slots.pop()
                self._names[slot] = instance_id
            else:
                slot = len(self._names)
                self._names.append(instance_id)
                self._by_slot.append(set())
            self._slot[instance_id] = slot
        return slot

    def _release(self, instance_id: str) -> set[bytes | str]:
        """Give ``instance_id``'s slot back; returns the digests it held."""
        slot = self._slot.pop(instance_id, None)
        if slot is None:
            return set()
        held, self._by_slot[slot] = self._by_slot[slot], set()
        self._names[slot] = None
        self._free_slots.append(slot)
        return held

    def _add(self, key: bytes | str, slot: int, bit: int) -> None:
        v = self._holders.get(key)
        if v is None:
            self._holders[key] = slot << 3 | bit
        elif type(v) is int:
            if v >> 3 == slot:
                self._holders[key] = v | bit
            else:
                self._holders[key] = (v, slot << 3 | bit)
        elif type(v) is tuple:
            for j, e in enumerate(v):
                if e >> 3 == slot:
                    self._holders[key] = (*v[:j], e | bit, *v[j + 1 :])
                    return
            if len(v) < SMALL_HOLDERS:
                self._holders[key] = (*v, slot << 3 | bit)
            else:
                d = {e >> 3: e & 7 for e in v}
                d[slot] = bit
                self._holders[key] = d
                self._many.add(key)
        else:
            v[slot] = v.get(slot, 0) | bit

    def _clear(self, key: bytes | str, slot: int, bit: int) -> bool:
        """Clear ``bit`` of ``slot`` on block ``key``; True when the slot no longer holds it in
        any tier."""
        v = self._holders.get(key)
        if v is None:
            return False
        if type(v) is int:
            if v >> 3 != slot:
                return False
            if v & 7 & ~bit:
                self._holders[key] = v & ~bit
                return False
            del self._holders[key]
            return True
        if type(v) is tuple:
            for j, e in enumerate(v):
                if e >> 3 == slot:
                    if e & 7 & ~bit:
                        self._holders[key] = (*v[:j], e & ~bit, *v[j + 1 :])
                        return False
                    rest = v[:j] + v[j + 1 :]
                    self._holders[key] = rest[0] if len(rest) == 1 else rest
                    return True
            return False
        bits = v.get(slot)
        if bits is None:
            return False
        if bits & ~bit:
            v[slot] = bits & ~bit
            return False
        del v[slot]
        if len(v) <= SMALL_HOLDERS:
            rest = tuple(s << 3 | b for s, b in v.items())
            self._holders[key] = rest[0] if len(rest) == 1 else rest
            self._many.discard(key)
        return True

    @staticmethod
    def _entries(v: int | tuple[int, ...] | dict[int, int]) -> list[tuple[int, int]]:
        """(slot, tier bits) of every holder of one block entry."""
        if type(v) is int:
            return [(v >> 3, v & 7)]
        if type(v) is tuple:
            return [(e >> 3, e & 7) for e in v]
        return list(v.items())

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
        slot = self._slot_of(inst)
        mine = self._by_slot[slot]
        if ev.kind == "stored":
            table, one = self._holders, slot << 3 | bit
            for h in ev.hashes:
                key = _key(h)
                v = table.get(key)
                if v is None:  # the common cases inline: a new block, or one of its own
                    table[key] = one
                elif type(v) is int and v >> 3 == slot:
                    table[key] = v | bit
                else:
                    self._add(key, slot, bit)
                mine.add(key)
        else:
            for h in ev.hashes:
                exp = self._expected.get(h)
                if exp is not None and ev.tier == "engine":
                    exp.pop(inst, None)
                    if not exp:
                        del self._expected[h]
                key = _key(h)
                if self._clear(key, slot, bit):
                    mine.discard(key)
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
        slot = self._slot.get(instance_id)
        held = self._release(instance_id)
        for key in held:
            self._clear(key, slot, 7)
        self._seq.pop(instance_id, None)
        return len(held)

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
    def holders(self) -> dict[str, dict[str, int]]:
        """``{hex hash: {instance: tier bits}}`` of every block, as the wire names them.
        list() copies in one C call: safe while the event loop keeps applying events."""
        names = self._names
        return {
            _name(key): {names[slot]: bits for slot, bits in self._entries(v)}
            for key, v in list(self._holders.items())
        }

    def state(self) -> dict:
        """Everything `digest()` covers plus what `apply` needs to stay correct afterwards
        (incarnations, retired incarnations, last seq per instance). Expectations are not kept:
        they are seconds-lived hints. Format 2 (`freeze`)."""
        return self.freeze()()

    def freeze(self) -> Callable[[], dict]:
        """Copy what a snapshot needs now, in C-level copies (tens of ms for a million blocks;
        the few blocks held by more than `SMALL_HOLDERS` instances, whose entries change in
        place, copied one by one), and return the function that builds `state()` from them: it
        may run on another thread while this index keeps changing (`snapshots.save_snapshot`
        runs it off the event loop) and describes the index as it was at the copy.

        Format 2: ``names`` (slot -> instance id), ``keys`` (the 16-byte keys of the blocks with
        one holder, concatenated) with ``values`` (their ``slot << 3 | tier bits`` as
        little-endian uint32), and ``rest`` (``[key, [slot << 3 | bits, ...]]`` for the others);
        about 20 bytes a block where format 1 (``holders``, the `holders()` dict) took 45."""
        meta = {
            "format": 2,
            "incarnation": dict(self._incarnation),
            "retired": {k: sorted(v) for k, v in list(self._retired.items())},
            "seq": dict(self._seq),
            "events_applied": self.events_applied,
        }
        items = list(self._holders.items())
        names = list(self._names)
        many = {k: list(v.items()) for k in self._many if type(v := self._holders[k]) is dict}

        def build() -> dict:
            keys: list[bytes] = []
            values = array("I")
            rest: list[list] = []
            for key, v in items:
                if type(v) is int and type(key) is bytes:
                    keys.append(key)
                    values.append(v)
                elif type(v) is dict:
                    rest.append([key, [s << 3 | b for s, b in many[key]]])
                else:
                    rest.append([key, [v] if type(v) is int else list(v)])
            if sys.byteorder != "little":
                values.byteswap()
            return {
                **meta,
                "names": names,
                "keys": b"".join(keys),
                "values": values.tobytes(),
                "rest": rest,
            }

        return build

    @classmethod
    def from_state(cls, state: dict) -> PrefixIndex:
        """The index `state()` describes (format 2, or format 1's ``holders`` dict as
        snapshots written before format 2 hold)."""
        idx = cls()
        if "holders" in state:
            for h, held in state["holders"].items():
                key = _key(h)
                for inst, bits in held.items():
                    slot = idx._slot_of(inst)
                    for bit in (ENGINE, DRAM, SSD):
                        if bits & bit:
                            idx._add(key, slot, bit)
                    idx._by_slot[slot].add(key)
        else:
            idx._load_format2(state)
        idx._incarnation = dict(state["incarnation"])
        idx._retired = {k: set(v) for k, v in state["retired"].items()}
        idx._seq = dict(state["seq"])
        idx.events_applied = int(state["events_applied"])
        return idx

    def _load_format2(self, state: dict) -> None:
        names: list[str | None] = list(state["names"])
        self._names = names
        self._slot = {n: i for i, n in enumerate(names) if n is not None}
        self._free_slots = [i for i, n in enumerate(names) if n is None]
        by_slot: list[set[bytes | str]] = [set() for _ in names]
        self._by_slot = by_slot
        known = len(names)  # a slot out of range or free: a damaged snapshot's, skipped
        values = array("I")
        values.frombytes(state["values"])
        if sys.byteorder != "little":
            values.byteswap()
        keys: bytes = state["keys"]
        holders = self._holders
        for i, v in enumerate(values):
            if v >> 3 < known and names[v >> 3] is not None:
                key = keys[16 * i : 16 * i + 16]
                holders[key] = v
                by_slot[v >> 3].add(key)
        for key, packed in state["rest"]:
            kept = [p for p in packed if p >> 3 < known and names[p >> 3] is not None]
            if not kept:
                continue
            if len(kept) == 1:
                holders[key] = kept[0]
            elif len(kept) <= SMALL_HOLDERS:
                holders[key] = tuple(kept)
            else:
                holders[key] = {p >> 3: p & 7 for p in kept}
                self._many.add(key)
            for p in kept:
                by_slot[p >> 3].add(key)

    # --- queries --------------------------------------------------------------------------------
    def digest(self) -> int:
        """Order-independent 48-bit digest of the contents (block, instance, tier bits): two
        indexes that hold the same state have the same digest (a rebuilt index is compared with
        a live one this way, e.g. through the ``strata_scheduler_prefix_index_digest`` gauge)."""
        acc = 0
        for h, held in self.holders().items():
            for inst, bits in held.items():
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
        names, entries, table, fromhex = self._names, self._entries, self._holders, bytes.fromhex
        for i, h in enumerate(hashes):
            key = h  # `_key(h)` inlined: the call doubled its cost (95 -> 190 ns a block)
            if len(h) == 32:
                try:
                    key = fromhex(h)
                except ValueError:
                    pass
            v = table.get(key)
            exp = expected.get(h)
            if v is None and not exp:
                break
            if type(v) is int:  # one holder, the common case: no list built
                tiers = v & 7
                on_engine: tuple[str | None, ...] | list[str | None] = (
                    (names[v >> 3],) if v & ENGINE else ()
                )
            elif type(v) is tuple:
                tiers = 0
                on_engine = []
                for e in v:
                    tiers |= e
                    if e & ENGINE:
                        on_engine.append(names[e >> 3])
                tiers &= 7
            else:
                held = entries(v) if v is not None else []
                tiers = 0
                for _, bits in held:
                    tiers |= bits
                on_engine = [names[slot] for slot, bits in held if bits & ENGINE]
            if current is None or current:
                engine = set(on_engine)
                if exp:
                    engine.update(exp)
                current = engine if current is None else current & engine
                for inst in current:
                    match.engine_blocks[inst] = i + 1
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
