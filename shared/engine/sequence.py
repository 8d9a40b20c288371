"""One request's state as the scheduler and block manager see it (plain Python, no torch)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from shared.engine.fair_queue import Tenant
from shared.protocol.hashing import hash_blocks, mm_extra_keys, request_salt
from shared.protocol.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not started, or preempted by recompute
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV copied out
    FINISHED = "finished"


@dataclass
class MMInput:
    """Precomputed image embeddings spliced in at prompt positions ``[offset, offset + n)``."""

    offset: int
    embeds: Any  # torch.Tensor [n, hidden]
    content_hash: str

    @property
    def length(self) -> int:
        return int(self.embeds.shape[0])


_arrival = itertools.count()


@dataclass(eq=False)
class Sequence:
    """Token ids (prompt then outputs) and how much of them has KV in the cache.

    ``num_computed_tokens`` tokens have K/V written (cached prefix included). Tokens past it are
    scheduled next; the last sampled token always sits past it until the next step writes it.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    priority: int = 0
    mm_inputs: list[MMInput] = field(default_factory=list)
    hold_kv: bool = False
    arrival: int = field(default_factory=lambda: next(_arrival))
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at (first) admission, in tokens
    num_committed_blocks: int = 0  # leading blocks registered in the prefix cache
    block_hashes: list[bytes] = field(default_factory=list)
    draft_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_preemptions: int = 0
    # Tokens that were given as already emitted (failover resume); not re-emitted.
    num_resumed_outputs: int = 0
    # Grammar state of a structured request (`shared.engine.structured.Constraint`), built at
    # its first sampling by replaying the outputs so far.
    constraint: Any = None
    # KV of some of its prompt's blocks from outside (`port_types.ExternalKV`, the pool), taken
    # in at admission like a prefix hit and dropped then (`Scheduler._admit`).
    external: Any = None
    # Speculative decoding (`spec_decode.DraftBackoff`): moving share of drafts accepted, steps left
    # in the current pause, and that pause's length.
    spec_rate: float = 1.0
    spec_pause: int = 0
    spec_backoff: int = 0
    # prompt_logprobs: position p (1..) -> ({token: logprob}, rank of prompt token p), filled
    # chunk by chunk; handed out once, with the first output (``prompt_lps_sent``).
    prompt_lps: dict[int, tuple[dict[int, float], int]] = field(default_factory=dict)
    prompt_lps_sent: bool = False
    # Fair queuing (`shared.engine.fair_queue`): whose request it is, its start tag in the
    # waiting queue, and when it was queued (``time.perf_counter``; the queue-wait metric).
    tenant: Tenant = field(default_factory=Tenant)
    vstart: float = 0.0
    queued_at: float = 0.0

    def __post_init__(self) -> None:
        self.num_resumed_outputs = len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def mm_spans(self) -> list[tuple[int, int, str]]:
        return [(m.offset, m.length, m.content_hash) for m in self.mm_inputs]

    def update_block_hashes(self, salt: bytes, block_size: int) -> list[bytes]:
        """Extend ``block_hashes`` to cover every full block of ``token_ids`` (the chain rooted
        at ``salt`` and the request's ``cache_salt``)."""
        done = len(self.block_hashes)
        if (done + 1) * block_size <= self.num_tokens:
            start = done * block_size
            extra = mm_extra_keys(self.mm_spans, block_size, first_block=done)
            parent = self.block_hashes[-1] if done else None
            root = salt if done else request_salt(salt, self.params.cache_salt)
            self.block_hashes += hash_blocks(
                self.token_ids[start:], block_size, root, extra, parent=parent
            )
        return self.block_hashes
