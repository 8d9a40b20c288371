"""The engine thread's inbox: one small command class per kind of work.

`shared.engine.port.EnginePort` puts commands in the inbox from the event loop; the engine
thread runs them between steps with ``cmd.run(engine)``. Stream commands (`Add`,
`AddPrefilled`) start a request whose outputs flow to its stream, and their errors go there
too; `Abort` needs no answer; every other command is a `Query` whose result (or exception)
resolves its ``reply`` future on the caller's loop. This module is the only code besides the
engine itself that reads the engine's tables, always on the engine thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shared.engine.engine import LLMEngine
from shared.engine.port_types import (
    BlockEvent,
    EvictedBlock,
    ExternalKV,
    MMInput,
    RequestKV,
    Tenant,
)
from shared.protocol.sampling import SamplingParams


class Command:
    """Something the engine thread does between steps."""

    def run(self, e: LLMEngine):
        raise NotImplementedError


@dataclass
class Add(Command):
    """Queue a request to compute (see `LLMEngine.add_request`)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    mm_inputs: Sequence[MMInput] = ()
    output_token_ids: Sequence[int] = ()
    hold_kv: bool = False
    tenant: Tenant | None = None
    external_kv: ExternalKV | None = None

    def run(self, e: LLMEngine) -> None:
        e.add_request(
            self.request_id,
            self.prompt_token_ids,
            self.params,
            self.priority,
            self.mm_inputs,
            self.output_token_ids,
            self.hold_kv,
            self.tenant,
            self.external_kv,
        )


@dataclass
class AddPrefilled(Command):
    """Start decoding a request whose KV was written into its reservation (`CommitKV` by
    another name: `LLMEngine.commit_prefilled`)."""

    request_id: str
    prompt_token_ids: list[int]
    first_token_id: int
    params: SamplingParams
    priority: int = 0
    mm_inputs: Sequence[MMInput] = ()

    def run(self, e: LLMEngine) -> None:
        e.commit_prefilled(
            self.request_id,
            self.prompt_token_ids,
            self.first_token_id,
            self.params,
            self.priority,
            self.mm_inputs,
        )


@dataclass
class Abort(Command):
    """Stop a request and free its blocks (a no-op for an unknown id)."""

    request_id: str

    def run(self, e: LLMEngine) -> None:
        e.abort_request(self.request_id)


@dataclass
class Query(Command):
    """A command with an answer: the port sets ``reply`` and awaits it."""

    reply: asyncio.Future | None = field(default=None, init=False, repr=False, compare=False)


@dataclass
class ReserveKV(Query):
    """Reserve blocks for ``num_tokens`` of KV computed elsewhere; with the prompt given, its
    cached prefix blocks are shared. Answers the leading tokens already cached (not rewritten)."""

    request_id: str
    num_tokens: int
    prompt_token_ids: Sequence[int] | None = None
    mm_inputs: Sequence[MMInput] = ()
    cache_salt: str = ""

    def run(self, e: LLMEngine) -> int:
        if self.request_id in e.seqs:
            raise ValueError(f"duplicate request id {self.request_id!r}")
        hashes = (
            ()
            if self.prompt_token_ids is None
            else e.kv.hashes(self.prompt_token_ids, self.mm_inputs, self.cache_salt)
        )
        return e.kv.reserve(self.request_id, self.num_tokens, hashes).num_cached


@dataclass
class WriteKV(Query):
    """Write ``kv`` = ``[len(layers), 2, n, kvh, hd]`` at tokens ``[token_start, +n)`` of a
    reservation. Answers the tokens written (those in shared cached blocks are skipped)."""

    request_id: str
    layers: range
    token_start: int
    kv: torch.Tensor

    def run(self, e: LLMEngine) -> int:
        return e.kv.write(self.request_id, self.layers, self.token_start, self.kv)


@dataclass
class CancelKV(Query):
    """Drop a reservation and free its blocks; answers whether there was one."""

    request_id: str

    def run(self, e: LLMEngine) -> bool:
        return e.kv.cancel(self.request_id)


@dataclass
class ReadKV(Query):
    """Copy a held request's KV: ``layers`` (all by default) of its blocks at ``block_indices``
    (positions in the request, all by default)."""

    request_id: str
    layers: range | None = None
    block_indices: Sequence[int] | None = None

    def run(self, e: LLMEngine) -> RequestKV:
        seq = e.seqs.get(self.request_id)
        if seq is None:
            raise KeyError(f"no request {self.request_id!r} holds KV here")
        table = seq.block_table
        ids = table if self.block_indices is None else [table[i] for i in self.block_indices]
        return RequestKV(e.kv.read_blocks(ids, self.layers), seq.num_computed_tokens)


@dataclass
class Release(Query):
    """Free the blocks a finished ``hold_kv`` request still holds."""

    request_id: str

    def run(self, e: LLMEngine) -> None:
        e.release(self.request_id)


@dataclass
class DrainEvicted(Query):
    """Evicted cached blocks since the last drain (with ``collect_evicted_kv``)."""

    def run(self, e: LLMEngine) -> list[EvictedBlock]:
        return e.kv.drain_evicted()


@dataclass
class DrainComputed(Query):
    """Blocks recorded for the pool since the last drain (``pool_save``), at most ``limit``."""

    limit: int = 0

    def run(self, e: LLMEngine) -> list[EvictedBlock]:
        return e.kv.drain_computed(self.limit)


@dataclass
class OfferAll(Query):
    """Record every cached block the pool has not been given (a graceful stop)."""

    def run(self, e: LLMEngine) -> int:
        return e.bm.offer_all()


@dataclass
class DrainKVEvents(Query):
    """Cached blocks stored / removed since the last drain."""

    def run(self, e: LLMEngine) -> list[BlockEvent]:
        return [BlockEvent(ev.kind, list(ev.hashes)) for ev in e.bm.drain_events()]
