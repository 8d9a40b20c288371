"""KV that moves in and out of the engine: swap, eviction to the pool, disaggregated prefill.

Mixed into :class:`~shared.engine.engine.LLMEngine`; everything here works on block ids and
``[L, 2, n, block_size, kvh, hd]`` tensors, never on the scheduler's tables.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from shared.engine.block_manager import KVEvent
from shared.engine.hashing import from_hex, hash_blocks, mm_extra_keys, to_hex
from shared.engine.params import SamplingParams
from shared.engine.sequence import MMInput


@dataclass
class _Reserved:
    block_table: list[int]
    num_tokens: int
    num_cached: int  # leading tokens already in shared cached blocks (not rewritten)


def _spans(mm) -> list[tuple[int, int, str]]:
    return [
        (m.offset, m.length, m.content_hash) if isinstance(m, MMInput) else tuple(m) for m in mm
    ]


class KVTransferMixin:
    def _init_kv_io(self) -> None:
        self.swap_store: dict[str, torch.Tensor] = {}
        self.evicted_kv: list[tuple[str, torch.Tensor]] = []
        self.collect_evicted = self.config.collect_evicted_kv
        self.reserved: dict[str, _Reserved] = {}

    def _move_kv(self, sched) -> None:
        """Copy out what must leave before this step's forward overwrites it, then copy in."""
        self._collect_evicted()
        for seq, blocks in sched.swap_out:
            self.swap_store[seq.request_id] = self.runner.read_blocks(blocks).cpu()
        for seq, blocks in sched.swap_in:
            self.runner.write_blocks(blocks, self.swap_store.pop(seq.request_id))

    def _collect_evicted(self) -> None:
        ev = self.bm.drain_evicted()
        if ev and self.collect_evicted:
            data = self.runner.read_blocks([b for _, b in ev]).cpu()
            self.evicted_kv += [(h.hex(), data[:, :, i]) for i, (h, _) in enumerate(ev)]

    # ----- prefill side ----------------------------------------------------------------------
    def request_blocks(self, request_id: str) -> tuple[list[int], int]:
        """Blocks and number of tokens with KV of a (held) request."""
        seq = self.seqs[request_id]
        return list(seq.block_table), seq.num_computed_tokens

    def read_kv(self, block_ids: Seq[int], layers: range | None = None) -> torch.Tensor:
        """``[L', 2, n_blocks, block_size, kvh, hd]`` copy of blocks (all layers by default)."""
        return self.runner.read_blocks(block_ids, layers)

    def release(self, request_id: str) -> None:
        """Free a finished request's held blocks (``hold_kv=True``)."""
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.scheduler.release(seq)

    # ----- decode side -----------------------------------------------------------------------
    def add_prefilled_request(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        first_token_id: int,
        params: SamplingParams | None,
        kv: torch.Tensor,
        priority: int = 0,
        mm_inputs: Seq[MMInput] = (),
    ) -> None:
        """Start decoding a request prefilled elsewhere; ``kv`` is ``[L, 2, n_prompt, kvh, hd]``.

        Cached prefix blocks are reused. ``first_token_id`` was emitted by the prefill side, so
        outputs start with the token after it.
        """
        self.reserve_prefilled(request_id, len(prompt_token_ids), prompt_token_ids, mm_inputs)
        for layer in range(kv.shape[0]):
            self.write_prefilled_layer(request_id, layer, kv[layer, 0], kv[layer, 1])
        self.commit_prefilled(
            request_id, prompt_token_ids, first_token_id, params, priority, mm_inputs
        )

    def reserve_prefilled(
        self,
        request_id: str,
        num_tokens: int,
        prompt_token_ids: Seq[int] | None = None,
        mm_inputs: Seq[MMInput] = (),
    ) -> torch.Tensor:
        """Allocate blocks for incoming KV; returns the ``num_tokens`` slots. With the prompt
        given, cached prefix blocks are shared and their tokens are not rewritten."""
        if request_id in self.seqs or request_id in self.reserved:
            raise ValueError(f"duplicate request id {request_id!r}")
        cached: list[int] = []
        if prompt_token_ids is not None:
            hashes = self._hashes(prompt_token_ids, mm_inputs)
            cached = self.bm.find_cached_prefix(hashes[: num_tokens // self.bm.block_size])
        table: list[int] = []
        if not self.bm.allocate_slots(table, num_tokens, cached):
            raise MemoryError(f"no KV blocks for {num_tokens} prefilled tokens")
        self._collect_evicted()
        self.reserved[request_id] = _Reserved(table, num_tokens, len(cached) * self.bm.block_size)
        return self.runner.slots_for(table, 0, num_tokens)

    def write_prefilled_layer(
        self, request_id: str, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write one layer's K/V ``[num_tokens, kvh, hd]`` of a reserved request."""
        r = self.reserved[request_id]
        c = r.num_cached
        slots = self.runner.slots_for(r.block_table, c, r.num_tokens)
        self.runner.write_tokens(slots, layer, k[c : r.num_tokens], v[c : r.num_tokens])

    def commit_prefilled(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        first_token_id: int,
        params: SamplingParams | None = None,
        priority: int = 0,
        mm_inputs: Seq[MMInput] = (),
    ) -> None:
        """Turn a reserved, fully written request into a running decode."""
        r = self.reserved.pop(request_id)
        seq = self._new_seq(request_id, prompt_token_ids, params, priority, mm_inputs, False)
        seq.block_table = r.block_table
        seq.num_computed_tokens = r.num_tokens
        seq.num_cached_tokens = r.num_cached
        self._track(seq)
        self.scheduler.add_running(seq)
        before = seq.num_tokens
        self.scheduler.postprocess_prefilled(seq, first_token_id)
        tracker = self.trackers.get(seq.request_id)
        if tracker is not None:
            tracker.add(first_token_id)  # emitted by the prefill side
        if seq.is_finished:
            self.pending.append(self._emit(seq, before + 1, None))

    def cancel_prefilled(self, request_id: str) -> None:
        """Drop a reservation (transfer failed or cancelled) and free its blocks."""
        r = self.reserved.pop(request_id, None)
        if r is not None:
            self.bm.free(r.block_table)

    # ----- external KV pool ------------------------------------------------------------------
    def _hashes(self, token_ids: Seq[int], mm) -> list[bytes]:
        bs = self.bm.block_size
        return hash_blocks(list(token_ids), bs, self.salt, mm_extra_keys(_spans(mm), bs))

    def block_hashes_for(self, token_ids: Seq[int], mm=()) -> list[str]:
        """Hex hashes of the full blocks of a prompt (``mm``: MMInput or (offset, n, hash))."""
        return to_hex(self._hashes(token_ids, mm))

    def match_prefix(self, token_ids: Seq[int], mm_hashes=()) -> int:
        """Tokens of this prompt whose KV this engine holds (full blocks only)."""
        return (
            len(self.bm.find_cached_prefix(self._hashes(token_ids, mm_hashes))) * self.bm.block_size
        )

    def insert_cached_blocks(self, hashes: Seq[str | bytes], kv: torch.Tensor) -> int:
        """Load pool blocks ``[L, 2, n, block_size, kvh, hd]`` as cached blocks; returns how many
        were new (already-cached hashes are skipped)."""
        n = 0
        for i, h in enumerate(hashes):
            hb = from_hex([h])[0] if isinstance(h, str) else h
            b = self.bm.insert_cached(hb)
            if b is None:
                continue
            self._collect_evicted()
            self.runner.write_blocks([b], kv[:, :, i : i + 1])
            n += 1
        return n

    def drain_kv_events(self) -> list[KVEvent]:
        return self.bm.drain_events()

    def drain_evicted_kv(self) -> list[tuple[str, torch.Tensor]]:
        """Evicted cached blocks as (hex hash, ``[L, 2, block_size, kvh, hd]``); collected only
        when ``EngineConfig.collect_evicted_kv`` is set."""
        out, self.evicted_kv = self.evicted_kv, []
        return out
