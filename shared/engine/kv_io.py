"""``EngineKV``: KV that moves in and out of the engine's paged cache.

Swap out/in, evicted cached blocks kept for the pool, newly computed blocks read out for the
pool (write-through), blocks reserved for KV computed elsewhere
(reserve -> write -> commit or cancel: the one write path of pushed KV), external KV the
scheduler admitted with a request (pool blocks, written before its first forward), and the
per-layer views handed to a `KVConnector`. It works on the block manager
and the model runner it is given, never on the scheduler's tables; the engine owns one
(``LLMEngine.kv``), and `shared.engine.port.EnginePort` is how services reach it.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from shared.engine.block_manager import BlockManager
from shared.engine.model_runner import ModelRunner
from shared.engine.port_types import EvictedBlock, KVConnector, LayerKV
from shared.engine.scheduler import Reservation, Scheduler
from shared.engine.sequence import MMInput
from shared.protocol.hashing import hash_blocks, mm_extra_keys, request_salt


def _spans(mm) -> list[tuple[int, int, str]]:
    return [
        (m.offset, m.length, m.content_hash) if isinstance(m, MMInput) else tuple(m) for m in mm
    ]


class EngineKV:
    def __init__(
        self,
        runner: ModelRunner,
        bm: BlockManager,
        salt: bytes,
        collect_evicted: bool,
        scheduler: Scheduler,
    ):
        self.runner = runner
        self.bm = bm
        self.salt = salt
        self.collect_evicted = collect_evicted
        self.scheduler = scheduler  # admits pushed requests (`Scheduler.admit_incoming`)
        self.swap_store: dict[str, torch.Tensor] = {}
        self.evicted: list[EvictedBlock] = []

    # ----- every step ------------------------------------------------------------------------
    def move(self, sched) -> None:
        """Copy out what must leave before this step's forward overwrites it, then copy in."""
        self.collect_evicted_blocks()
        for seq, blocks in sched.swap_out:
            self.swap_store[seq.request_id] = self.runner.read_blocks(blocks).cpu()
        for seq, blocks in sched.swap_in:
            self.runner.write_blocks(blocks, self.swap_store.pop(seq.request_id))
        for blocks, kv in sched.load_in:  # external KV admitted this step (the pool)
            self.runner.write_blocks(blocks, kv.to(self.runner.device))

    def collect_evicted_blocks(self) -> None:
        ev = self.bm.drain_evicted()
        if ev and self.collect_evicted:
            data = self.runner.read_blocks([b for _, b in ev]).cpu()
            self.evicted += [EvictedBlock(h.hex(), data[:, :, i]) for i, (h, _) in enumerate(ev)]

    def save_layer(self, connector: KVConnector, sched, layer: int) -> None:
        """Hand ``connector`` this step's K/V of ``layer`` for each request it wants."""
        if sched is None:
            return
        for ss in sched.scheduled:
            rid = ss.seq.request_id
            if not connector.wants(rid):
                continue
            table = list(ss.seq.block_table)
            view = LayerKV(
                layer=layer,
                num_layers=self.runner.kv.k.shape[0],
                token_start=ss.start,
                token_end=ss.start + ss.num_new_tokens - ss.num_draft_tokens,
                final=bool(ss.samples) and layer == self.runner.kv.k.shape[0] - 1,
                _read=lambda ls, s, e, t=table: self.runner.read_tokens(t, ls, s, e),
            )
            connector.save_layer(rid, layer, view)

    # ----- KV computed elsewhere (disaggregated prefill) ---------------------------------------
    def hashes(self, token_ids: Seq[int], mm=(), cache_salt: str = "") -> list[bytes]:
        bs = self.bm.block_size
        root = request_salt(self.salt, cache_salt)
        return hash_blocks(list(token_ids), bs, root, mm_extra_keys(_spans(mm), bs))

    def reserve(self, request_id: str, num_tokens: int, hashes: Seq[bytes] = ()) -> Reservation:
        """Admission of a pushed request at its first frame (`Scheduler.admit_incoming`): blocks
        for ``num_tokens`` incoming tokens, the cached prefix of ``hashes`` shared (those tokens
        are not rewritten)."""
        r = self.scheduler.admit_incoming(request_id, num_tokens, hashes)
        self.collect_evicted_blocks()  # blocks it took from the cache are read out first
        return r

    def write(self, request_id: str, layers: range, token_start: int, kv: torch.Tensor) -> int:
        """Write ``kv`` = ``[len(layers), 2, n, kvh, hd]`` for tokens ``[token_start, +n)`` of a
        reservation; tokens in shared cached blocks are skipped. Returns the tokens written."""
        r = self.scheduler.incoming.get(request_id)
        if r is None:
            raise KeyError(f"no KV reservation for {request_id!r}")
        end = token_start + kv.shape[2]
        if (
            end > r.num_tokens
            or kv.shape[0] != len(layers)
            or layers.stop > self.runner.kv.k.shape[0]
        ):
            raise ValueError(
                f"KV for {request_id!r} out of range: layers {layers.start}-"
                f"{layers.stop}, tokens {token_start}-{end} of {r.num_tokens}"
            )
        start = max(token_start, r.num_cached)
        if start >= end:
            return 0
        slots = self.runner.slots_for(r.block_table, start, end)
        self.runner.write_token_layers(slots, layers, kv[:, :, start - token_start :])
        return end - start

    def take(self, request_id: str) -> Reservation:
        """Hand a fully written reservation over to the request that commits it."""
        return self.scheduler.take_incoming(request_id)

    def cancel(self, request_id: str) -> bool:
        """Drop a reservation (transfer failed or cancelled) and free its blocks."""
        return self.scheduler.cancel_incoming(request_id)

    # ----- external KV pool ------------------------------------------------------------------
    def cached_tokens(self, hashes: Seq[bytes]) -> int:
        """Leading tokens of these block hashes this engine holds (full blocks only)."""
        return len(self.bm.find_cached_prefix(list(hashes))) * self.bm.block_size

    def read_blocks(self, block_ids: Seq[int], layers: range | None = None) -> torch.Tensor:
        """``[L', 2, n_blocks, block_size, kvh, hd]`` copy of blocks (all layers by default)."""
        return self.runner.read_blocks(block_ids, layers)

    def drain_evicted(self) -> list[EvictedBlock]:
        """Evicted cached blocks, collected only with ``EngineConfig.collect_evicted_kv``."""
        out, self.evicted = self.evicted, []
        return out

    def drain_computed(self, limit: int = 0) -> list[EvictedBlock]:
        """Copies of the blocks recorded for the pool since the last call (computed here, by
        ``EngineConfig.pool_save``) that still hold their data; one evicted meanwhile
        went out through `drain_evicted` instead (its bytes were copied before reuse)."""
        got = self.bm.drain_computed(limit)
        if not got:
            return []
        data = self.runner.read_blocks([b for _, b in got]).cpu()
        return [EvictedBlock(h.hex(), data[:, :, i]) for i, (h, _) in enumerate(got)]
