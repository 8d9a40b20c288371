"""The prefix index's compact encoding (16-byte keys, instance slots, one int / a tuple / a dict
of holders per block) behaves exactly like the plain ``{hash: {instance: tier bits}}`` model it
replaces, through every change of form, and costs what docs/benchmarks/scheduler.md says."""

from __future__ import annotations

import random
import secrets
import tracemalloc

from services.scheduler.prefix_index import DRAM, ENGINE, SMALL_HOLDERS, SSD, PrefixIndex
from shared.protocol.kv import KVEvent

BITS = {"engine": ENGINE, "dram": DRAM, "ssd": SSD}


class Plain:
    """The reference: what the index must answer, kept the obvious way."""

    def __init__(self) -> None:
        self.holders: dict[str, dict[str, int]] = {}

    def apply(self, inst: str, tier: str, kind: str, hashes: list[str]) -> None:
        bit = BITS[tier]
        for h in hashes:
            held = self.holders.setdefault(h, {})
            bits = (held.get(inst, 0) | bit) if kind == "stored" else (held.get(inst, 0) & ~bit)
            if bits:
                held[inst] = bits
            else:
                held.pop(inst, None)
            if not held:
                del self.holders[h]

    def drop(self, inst: str) -> None:
        for h in list(self.holders):
            self.holders[h].pop(inst, None)
            if not self.holders[h]:
                del self.holders[h]

    def blocks_of(self, inst: str) -> int:
        return sum(inst in held for held in self.holders.values())

    def engine_run(self, hashes: list[str], inst: str) -> int:
        n = 0
        for h in hashes:
            if not self.holders.get(h, {}).get(inst, 0) & ENGINE:
                break
            n += 1
        return n


def test_random_events_match_the_plain_model_through_every_form():
    rng = random.Random(7)
    # wire hashes (32 hex digits) and synthetic names, as the simulator uses
    blocks = [secrets.token_hex(16) for _ in range(40)] + [f"b{i}" for i in range(10)]
    instances = [f"decode-{i}" for i in range(SMALL_HOLDERS + 6)]  # past the tuple form
    idx, plain = PrefixIndex(), Plain()
    seq = dict.fromkeys(instances, 0)
    forms: set[str] = set()
    for step in range(4000):
        inst = rng.choice(instances)
        if step % 500 == 499:  # an instance dies: all its blocks go
            idx.drop_instance(inst)
            plain.drop(inst)
            continue
        tier = rng.choice(list(BITS))
        kind = "stored" if rng.random() < 0.6 else "removed"
        hashes = rng.sample(blocks, rng.randint(1, 6))
        seq[inst] += 1
        ev = KVEvent(
            instance_id=inst, incarnation="i", seq=seq[inst], tier=tier, kind=kind, hashes=hashes
        )
        assert idx.apply(ev)
        plain.apply(inst, tier, kind, hashes)
        forms.update(type(v).__name__ for v in idx._holders.values())
    assert forms == {"int", "tuple", "dict"}  # every form was taken (and left: same answers)
    assert idx.holders() == plain.holders
    assert len(idx) == len(plain.holders)
    for inst in instances:
        assert idx.blocks_of(inst) == plain.blocks_of(inst)
    back = PrefixIndex.from_state(idx.state())
    assert back.holders() == plain.holders and back.digest() == idx.digest()
    for inst in instances:
        assert back.blocks_of(inst) == plain.blocks_of(inst)
    # a format-1 snapshot (the hex-keyed holders dict, as written before format 2) still loads
    old = {**idx.state(), "holders": plain.holders}
    assert PrefixIndex.from_state(old).holders() == plain.holders
    for _ in range(200):
        prompt = rng.sample(blocks, 5)
        match = idx.lookup(prompt)
        for inst in instances:
            assert match.engine_blocks.get(inst, 0) == plain.engine_run(prompt, inst)


def test_a_dropped_instance_frees_its_slot_for_the_next():
    idx = PrefixIndex()
    h = [secrets.token_hex(16) for _ in range(3)]
    idx.apply(
        KVEvent(instance_id="d0", incarnation="a", seq=1, tier="engine", kind="stored", hashes=h)
    )
    assert idx.drop_instance("d0") == 3 and len(idx) == 0
    idx.apply(
        KVEvent(instance_id="d1", incarnation="a", seq=1, tier="dram", kind="stored", hashes=h[:1])
    )
    assert len(idx._names) == 1  # d1 took d0's slot
    assert idx.holders() == {h[0]: {"d1": DRAM}} and idx.blocks_of("d0") == 0


def test_a_frozen_snapshot_is_the_index_as_of_the_freeze():
    """`freeze` copies now; building later (on another thread, as the service does) gives the
    index as it was, whatever was applied in between."""
    idx = PrefixIndex()
    h = [secrets.token_hex(16) for _ in range(12)]

    def ev(inst, seq, kind, hashes, tier="engine"):
        return KVEvent(
            instance_id=inst, incarnation="a", seq=seq, tier=tier, kind=kind, hashes=hashes
        )

    idx.apply(ev("d0", 1, "stored", h[:8]))
    idx.apply(ev("d1", 1, "stored", h[:2]))  # two holders: a tuple
    for i in range(SMALL_HOLDERS + 1):  # block 11 on many: a dict
        idx.apply(ev(f"k{i}", 1, "stored", h[11:], tier="dram"))
    before = idx.holders()
    build = idx.freeze()
    idx.apply(ev("d0", 2, "removed", h[:4]))
    idx.apply(ev("d2", 1, "stored", h[8:11]))  # a slot the copies do not know
    idx.apply(ev("k0", 2, "removed", h[11:], tier="dram"))
    idx.drop_instance("d1")
    state = build()
    assert state["format"] == 2 and len(state["keys"]) == 16 * 6  # d0's own 6 blocks
    back = PrefixIndex.from_state(state)
    assert back.holders() == before and back.blocks_of("d2") == 0
    assert {i: back._seq[i] for i in ("d0", "d1")} == {"d0": 1, "d1": 1} and "d2" not in back._seq


def traced_bytes(build) -> float:
    tracemalloc.start()
    try:
        kept = build()
        size = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert kept is not None
    return size


def test_an_indexed_block_costs_about_half_of_the_plain_model():
    n = 20000
    wire = [secrets.token_hex(16).encode() for _ in range(n)]  # bytes, as a decoded message

    def compact():
        idx = PrefixIndex()
        for i in range(0, n, 4):
            hashes = [h.decode() for h in wire[i : i + 4]]
            ev = KVEvent(
                instance_id="decode-0",
                incarnation="a",
                seq=i,
                tier="engine",
                kind="stored",
                hashes=hashes,
            )
            idx.apply(ev)
        return idx

    def plain():  # what the index kept before: the hex strings, a dict per block, a set
        holders: dict[str, dict[str, int]] = {}
        mine: set[str] = set()
        for raw in wire:
            h = raw.decode()
            holders[h] = {"decode-0": ENGINE}
            mine.add(h)
        return holders, mine

    per_block = traced_bytes(compact) / n
    before = traced_bytes(plain) / n
    assert per_block < 0.6 * before, (per_block, before)
    assert per_block < 200, per_block
