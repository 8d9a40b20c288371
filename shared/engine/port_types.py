"""The types that cross the engine's port (`shared.engine.port.EnginePort`).

Services and the worker library see the engine only through the port's methods and these types:
token ids, request ids, hex block hashes and KV tensors, never block tables, the scheduler's
lists or the model runner. KV tensor layouts:

- blocks: ``[layers, 2 (k/v), num_blocks, block_size, kv_heads, head_dim]``
- tokens: ``[layers, 2 (k/v), num_tokens, kv_heads, head_dim]``
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from shared.engine.fair_queue import Tenant
from shared.engine.outputs import EngineStats, RequestOutput
from shared.engine.sequence import MMInput

__all__ = [
    "BlockEvent",
    "EngineStats",
    "EvictedBlock",
    "KVConnector",
    "KVSpec",
    "LayerKV",
    "ExternalKV",
    "MMInput",
    "PrefixMatch",
    "RequestKV",
    "RequestOutput",
    "Tenant",
]


class KVSpec(NamedTuple):
    """Shape and dtype of the engine's KV cache (fixed for the engine's life)."""

    num_layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def token_bytes(self, num_layers: int | None = None) -> int:
        """Bytes of K and V of one token over ``num_layers`` layers (all by default)."""
        layers = self.num_layers if num_layers is None else num_layers
        return layers * 2 * self.kv_heads * self.head_dim * self.element_size


class PrefixMatch(NamedTuple):
    """A prompt's full-block hashes (hex, chained and salted) and how many leading tokens of it
    this engine already holds as cached blocks (a multiple of the block size)."""

    hashes: list[str]
    cached_tokens: int


class ExternalKV(NamedTuple):
    """KV of a prompt's consecutive full blocks that comes from outside the engine (the pool),
    handed over with the request (`EnginePort.generate`). The scheduler admits it like a prefix
    hit (`Scheduler._admit`): the blocks right after the engine's own cached prefix whose hashes
    match the prompt's are allocated with the request's other blocks, written before its first
    forward and cached; blocks the engine holds by then, or that do not continue its prefix, are
    skipped (counted in ``EngineStats.external_blocks``)."""

    hashes: list[str]  # hex, chained and salted (`PrefixMatch.hashes`), in prompt order
    kv: torch.Tensor  # [L, 2, len(hashes), block_size, kvh, hd], on the host
    source: str = "pool"  # a label for the counters (a pool tier)


class RequestKV(NamedTuple):
    """A copy of (some of) a held request's KV blocks and the request's tokens with KV."""

    blocks: torch.Tensor  # [L', 2, nb, block_size, kvh, hd]
    num_tokens: int

    def tokens(self) -> torch.Tensor:
        """The KV as ``[L', 2, num_tokens, kvh, hd]`` (when all the request's blocks were read)."""
        return self.blocks.flatten(2, 3)[:, :, : self.num_tokens]


class EvictedBlock(NamedTuple):
    """A cached block on its way to the pool (evicted, or newly computed): its hex hash and KV
    ``[L, 2, block_size, kvh, hd]``."""

    hash: str
    kv: torch.Tensor


class BlockEvent(NamedTuple):
    """Cached blocks that appeared (``stored``) or went away (``removed``), as hex hashes."""

    kind: str
    hashes: list[str]


@dataclass(frozen=True)
class LayerKV:
    """What one step computed for one request at one layer, handed to `KVConnector.save_layer`.

    ``[token_start, token_end)`` are the tokens whose K/V this step wrote (draft tokens excluded);
    ``final`` marks the last layer of the chunk that samples the request's next token. `read`
    copies K/V of any layers and token range of the request out of the paged cache (on the
    thread that runs the forward, so the copy is ordered with the layers' writes).
    """

    layer: int
    num_layers: int
    token_start: int
    token_end: int
    final: bool
    _read: Callable[[range, int, int], torch.Tensor]

    def read(self, layers: range, start: int, end: int) -> torch.Tensor:
        """``[len(layers), 2, end - start, kvh, hd]`` copy of the request's K/V."""
        return self._read(layers, start, end)

    def new_tokens(self) -> torch.Tensor:
        """This layer's K/V of the tokens this step computed: ``[1, 2, n, kvh, hd]``."""
        return self._read(range(self.layer, self.layer + 1), self.token_start, self.token_end)


class KVConnector:
    """Layer-wise KV saving, in the spirit of vLLM's KV connector (worker side).

    The engine calls `save_layer` right after each layer of a step has written its K/V, for every
    request of that step that `wants` says the connector handles, and `wait_for_save` once the
    step's forward is done. Both run on the thread that runs the forward: they must not block on
    the event loop (hand data over with ``loop.call_soon_threadsafe``) and should return fast.
    """

    def wants(self, request_id: str) -> bool:
        """Whether `save_layer` should be called for this request (checked per layer)."""
        return False

    def save_layer(self, request_id: str, layer: int, kv: LayerKV) -> None:
        """Take what ``kv`` describes (copy with ``kv.read``/``kv.new_tokens``) and send it."""

    def wait_for_save(self) -> None:
        """Block until every save of this step no longer needs the paged cache (the copies made
        in `save_layer` already are independent of it: the default does nothing)."""
