"""Simulated instances: a FIFO prefill server with an LRU engine cache, a decode batch with a KV
budget, and the shared pool (DRAM LRU spilling to an unbounded SSD tier). Every cache change is
announced as a real `KVEvent` to the simulation, which applies it to the real `PrefixIndex` with the
service's rule (`services.scheduler.rules.apply_kv_event`), exactly as live instances do."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from services.scheduler.types import InstanceView
from shared.protocol.kv import KVEvent


@dataclass(frozen=True)
class SimConfig:
    """Cluster shape and cost constants of one simulation.

    Fields:
        num_prefill / num_decode: instance counts; ``num_long`` of the prefill instances are
            reserved for long prompts (length-aware routing).
        prefill_tokens_per_s: prefill rate of one instance (uncached tokens).
        dram_tokens_per_s / ssd_tokens_per_s: pool KV load rates by tier.
        engine_cache_blocks / pool_dram_blocks: LRU capacities in 512-token trace blocks.
        decode_kv_blocks: KV budget of a decode instance (running requests).
        decode_step_s / decode_step_per_seq_s: decode step time = base + per_seq x batch.
        decode_max_batch: running sequences per decode instance.
        ttft_slo_s: TTFT SLO of every request (interactive class).
        rate_scale: arrival-time compression (2.0 = the trace replayed twice as fast).
        pool_write_through: prefill also writes every block to the pool (pool transfer mode);
            otherwise the pool only receives blocks evicted from engine caches.
        pool_enabled: False = no pool at all (evicted blocks are dropped).
        expect_ttl_s: seconds a routed prompt's blocks count as held by its prefill instance
            before their KV event (the scheduler's ``expect_ttl_s``).
        load_interval_s: seconds between an instance's load reports (the workers'
            ``STRATA_LOAD_INTERVAL``); between two, the policy sees the last report plus what
            was routed since, as `SchedulerCore` counts it. 0: a fresh report at every decision.
        cache_holds_running: the engine cache and the running sequences share the instance's
            ``engine_cache_blocks`` (one paged KV cache, as in a real engine): the blocks only a
            running sequence holds (its output and its partial last block) are not cache.
    """

    num_prefill: int = 6
    num_decode: int = 4
    num_long: int = 0
    prefill_tokens_per_s: float = 8000.0
    dram_tokens_per_s: float = 200_000.0
    ssd_tokens_per_s: float = 40_000.0
    engine_cache_blocks: int = 2000
    pool_dram_blocks: int = 20_000
    decode_kv_blocks: int = 2000
    decode_step_s: float = 0.03
    decode_step_per_seq_s: float = 0.0003
    decode_max_batch: int = 128
    ttft_slo_s: float = 10.0
    rate_scale: float = 1.0
    block_tokens: int = 512
    pool_write_through: bool = True
    pool_enabled: bool = True
    expect_ttl_s: float = 30.0
    load_interval_s: float = 0.0
    cache_holds_running: bool = False


class LRU:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.d: OrderedDict[str, None] = OrderedDict()

    def prefix(self, hashes) -> int:
        n = 0
        for h in hashes:
            if h not in self.d:
                break
            self.d.move_to_end(h)
            n += 1
        return n

    def add(self, hashes) -> tuple[list[str], list[str]]:
        """Insert; returns (newly stored, evicted)."""
        new, gone = [], []
        for h in hashes:
            if h in self.d:
                self.d.move_to_end(h)
            else:
                self.d[h] = None
                new.append(h)
        while len(self.d) > self.capacity:
            gone.append(self.d.popitem(last=False)[0])
        return new, gone


class Announcer:
    """Sequence-numbered KV events of one simulated instance, handed to ``sink``."""

    def __init__(self, instance_id: str, sink: Callable[[KVEvent], object]) -> None:
        self.instance_id, self.sink, self.seq = instance_id, sink, 0

    def __call__(self, tier: str, kind: str, hashes: list[str]) -> None:
        if hashes:
            self.seq += 1
            self.sink(
                KVEvent(
                    instance_id=self.instance_id,
                    incarnation="sim",
                    seq=self.seq,
                    tier=tier,
                    kind=kind,
                    hashes=hashes,
                )
            )


class Pool:
    def __init__(self, cfg: SimConfig, sink: Callable[[KVEvent], object]) -> None:
        self.dram = LRU(cfg.pool_dram_blocks)
        self.ssd: set[str] = set()
        self.emit = Announcer("kvpool", sink)
        self.hit_blocks = {"dram": 0, "ssd": 0}  # blocks loaded by prefills

    def tiers(self, hashes) -> list[str | None]:
        """The pool tier holding each block ("dram" first, then "ssd"; None = absent)."""
        return ["dram" if h in self.dram.d else "ssd" if h in self.ssd else None for h in hashes]

    def offer(self, hashes: list[str]) -> None:
        new, gone = self.dram.add(hashes)
        self.emit("dram", "stored", new)
        self.emit("dram", "removed", gone)
        spill = [h for h in gone if h not in self.ssd]
        self.ssd.update(spill)
        self.emit("ssd", "stored", spill)


@dataclass
class Job:
    rid: int
    arrival: float
    input_len: int
    output_len: int
    hashes: tuple[str, ...]
    decode: SimInstance | None = None
    cached_tokens: int = 0  # reused: local prefix + pool continuation
    local_tokens: int = 0  # of which from the prefilling instance's own engine cache
    uncached: int = 0
    ttft: float = -1.0
    finish: float = -1.0


@dataclass
class SimInstance:
    view: InstanceView
    cache: LRU
    emit: Announcer
    rate: float
    queue: deque = field(default_factory=deque)  # prefill jobs waiting
    busy_until: float = 0.0
    queued_tokens: int = 0  # estimated uncached tokens waiting (what a load report would say)
    prefilled_tokens: int = 0  # prompt tokens computed here (the load-balance measure)
    running: int = 0
    kv_used: int = 0
    decode_wait: deque = field(default_factory=deque)
    next_report: float = 0.0  # when its next load report arrives (``load_interval_s`` > 0)
    private_blocks: int = 0  # blocks its running sequences hold outside the cache

    def report_due(self, now: float, interval: float) -> bool:
        """Whether a load report arrived since the last one the policy saw (every decision
        when ``interval`` is 0; else on the instance's own period)."""
        if interval <= 0:
            return True
        if now < self.next_report:
            return False
        self.next_report += interval * (int((now - self.next_report) / interval) + 1)
        return True

    def refresh(self, now: float, kv_total: int) -> None:
        """What a fresh load report would carry."""
        v = self.view
        left = max(0.0, self.busy_until - now) * self.rate
        v.waiting_tokens = int(self.queued_tokens + left)
        v.num_waiting = len(self.queue) + len(self.decode_wait)
        v.num_running = self.running
        v.kv_blocks_total = kv_total
        v.kv_blocks_free = max(0, kv_total - self.kv_used)
        v.pending_tokens = v.pending_requests = 0  # the report covers what was routed
