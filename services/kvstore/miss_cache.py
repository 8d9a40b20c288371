"""When a kvstore looks in the object store for blocks it does not know. Pure Python.

Another kvstore instance (or this one before a restart) may have written blocks to the shared
bucket since this instance last listed it. On a miss the store refreshes its view of one
fingerprint (list + read new chunk headers), at most once per ``refresh_interval`` seconds per
fingerprint, and remembers keys still missing after a refresh for ``negative_ttl`` seconds so
repeated queries for absent blocks (every prompt's uncached tail) cost nothing.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable

from services.kvstore.dram import BlockKey


class MissCache:
    """Rate limit of object-store refreshes per fingerprint plus a bounded negative cache."""

    def __init__(
        self,
        refresh_interval: float,
        negative_ttl: float,
        max_keys: int = 100_000,
        clock=time.monotonic,
    ):
        self.refresh_interval = refresh_interval
        self.negative_ttl = negative_ttl
        self.max_keys = max_keys
        self._clock = clock
        self._last: dict[str, float] = {}
        self._neg: OrderedDict[BlockKey, float] = OrderedDict()  # key -> expiry, oldest first

    def is_negative(self, key: BlockKey) -> bool:
        """True while ``key`` is remembered as absent."""
        exp = self._neg.get(key)
        if exp is None:
            return False
        if exp <= self._clock():
            del self._neg[key]
            return False
        return True

    def need_refresh(self, fingerprint: str, keys: Iterable[BlockKey]) -> bool:
        """Should a miss of ``keys`` (all of ``fingerprint``) refresh the view of the store?"""
        if all(self.is_negative(k) for k in keys):
            return False
        last = self._last.get(fingerprint)
        return last is None or self._clock() - last >= self.refresh_interval

    def refreshed(self, fingerprint: str) -> None:
        """A refresh of ``fingerprint`` started now (also after a failed one: no retry storm)."""
        self._last[fingerprint] = self._clock()

    def missed(self, keys: Iterable[BlockKey]) -> None:
        """``keys`` were absent after a refresh."""
        exp = self._clock() + self.negative_ttl
        for k in keys:
            self._neg[k] = exp
            self._neg.move_to_end(k)
        while len(self._neg) > self.max_keys:
            self._neg.popitem(last=False)

    def forget(self, key: BlockKey) -> None:
        """``key`` is present now (stored here)."""
        self._neg.pop(key, None)
