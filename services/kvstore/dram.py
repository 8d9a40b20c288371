"""The DRAM tier: a byte-budgeted LRU of immutable blocks, with read leases. Pure Python.

A block is identified by ``(fingerprint, hash)`` so blocks of different models never mix. Its
payload is an opaque object with a byte size (the kvstore stores assembled `BlockFrame`s).

Contract:
- ``put`` of a present key is idempotent: it refreshes recency and stores nothing new.
- A put that needs room evicts least-recently-used, *unleased* blocks; evicted blocks are
  returned to the caller (who spills them). If room cannot be made (block larger than the
  budget, or everything else is leased) the put is refused and nothing is evicted.
- ``acquire`` leases blocks for reading; a leased block is never evicted until ``release``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

BlockKey = tuple[str, str]  # (fingerprint, hash hex)


@dataclass
class Entry:
    key: BlockKey
    payload: Any
    nbytes: int
    leases: int = 0


@dataclass(frozen=True)
class PutResult:
    """``stored``: newly stored (False for a duplicate or a refused put); ``refused``: no room;
    ``evicted``: blocks pushed out to make room, oldest first (payloads, for spilling)."""

    stored: bool
    refused: bool = False
    evicted: list[Entry] = field(default_factory=list)


class DramTier:
    """LRU over ``budget_bytes``; see the module docstring for the contract."""

    def __init__(self, budget_bytes: int):
        if budget_bytes <= 0:
            raise ValueError("budget_bytes must be positive")
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self._lru: OrderedDict[BlockKey, Entry] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._lru

    def keys(self) -> list[BlockKey]:
        """Keys from least to most recently used."""
        return list(self._lru)

    def put(self, key: BlockKey, payload: Any, nbytes: int) -> PutResult:
        if key in self._lru:
            self._lru.move_to_end(key)
            return PutResult(stored=False)
        if nbytes > self.budget_bytes:
            return PutResult(stored=False, refused=True)
        need = self.used_bytes + nbytes - self.budget_bytes
        victims: list[BlockKey] = []
        if need > 0:
            freed = 0
            for k, e in self._lru.items():
                if e.leases == 0:
                    victims.append(k)
                    freed += e.nbytes
                    if freed >= need:
                        break
            if freed < need:
                return PutResult(stored=False, refused=True)
        evicted = [self._pop(k) for k in victims]
        self._lru[key] = Entry(key, payload, nbytes)
        self.used_bytes += nbytes
        return PutResult(stored=True, evicted=evicted)

    def get(self, key: BlockKey) -> Any | None:
        """Payload of ``key`` (refreshing its recency), or None."""
        e = self._lru.get(key)
        if e is None:
            return None
        self._lru.move_to_end(key)
        return e.payload

    def entry(self, key: BlockKey) -> Entry | None:
        """The stored entry (payload and size) without touching recency."""
        return self._lru.get(key)

    def peek(self, key: BlockKey) -> Any | None:
        """Payload without touching recency."""
        e = self._lru.get(key)
        return None if e is None else e.payload

    def acquire(self, key: BlockKey) -> Any | None:
        """Lease ``key`` for reading (refreshes recency); None when absent. Pair with release."""
        e = self._lru.get(key)
        if e is None:
            return None
        e.leases += 1
        self._lru.move_to_end(key)
        return e.payload

    def release(self, key: BlockKey) -> None:
        e = self._lru.get(key)
        if e is None or e.leases == 0:
            raise KeyError(f"release of {key} without a lease")
        e.leases -= 1

    def leased(self) -> int:
        return sum(1 for e in self._lru.values() if e.leases)

    def remove(self, key: BlockKey) -> Entry | None:
        """Drop ``key`` (even if leased readers hold its payload, which stays valid for them)."""
        return self._pop(key) if key in self._lru else None

    def _pop(self, key: BlockKey) -> Entry:
        e = self._lru.pop(key)
        self.used_bytes -= e.nbytes
        return e

    def count_by_fingerprint(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for fp, _ in self._lru:
            out[fp] = out.get(fp, 0) + 1
        return out
