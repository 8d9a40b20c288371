"""`PoolClient`: the KV cache pool as one store spread over kvstore instances.

Each block hash lives on the instance chosen by rendezvous (highest-random-weight) hashing of
``(instance address, hash)``: every client picks the same owner without coordination, and adding
or removing an instance moves only the blocks it gains or loses. A dead or failing instance is a
miss (its error is counted in ``errors`` and a Prometheus counter), never an exception: serving
continues by recomputing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence

import torch
import xxhash
from prometheus_client import Counter

from protos.kv_transfer_pb2 import BlockFrame
from shared.kvtransfer.client import KVClient, get_client
from shared.kvtransfer.frames import frame_to_tensor, tensor_to_frames
from shared.protocol.errors import StrataError

log = logging.getLogger(__name__)

POOL_ERRORS = Counter("strata_kvpool_client_errors_total", "Failed pool calls", ["op"])


def rendezvous_owner(key: str, addrs: Sequence[str]) -> str:
    """The address with the highest ``xxh64(addr | key)`` (stable across processes)."""
    return max(addrs, key=lambda a: xxhash.xxh64_intdigest(f"{a}|{key}".encode()))


def prefix_hits(tiers: Sequence[str | None]) -> int:
    """Number of leading blocks present in some tier (only a prefix is reusable)."""
    n = 0
    for t in tiers:
        if t is None:
            break
        n += 1
    return n


class PoolClient:
    """Client of the kvstore instances at ``addrs`` (``"host:port"`` gRPC addresses)."""

    def __init__(self, addrs: Sequence[str], *, timeout: float = 10.0):
        if not addrs:
            raise ValueError("PoolClient needs at least one kvstore address")
        self.addrs = list(addrs)
        self.timeout = timeout
        self.errors = 0

    def owner(self, key: str) -> str:
        return rendezvous_owner(key, self.addrs)

    def _client(self, addr: str) -> KVClient:
        return get_client(addr)

    def _group(self, hashes: Iterable[str]) -> dict[str, list[str]]:
        groups: dict[str, list[str]] = {}
        for h in hashes:
            groups.setdefault(self.owner(h), []).append(h)
        return groups

    def _failed(self, op: str, addr: str, exc: Exception) -> None:
        self.errors += 1
        POOL_ERRORS.labels(op).inc()
        log.warning("kvstore %s %s failed (treated as miss): %s", addr, op, exc)

    async def lookup(self, hashes: Sequence[str], fingerprint: str = "") -> list[str | None]:
        """Tier of each hash ("dram" | "ssd") or None; see `prefix_hits` for the usable part."""

        async def one(addr: str, keys: list[str]) -> dict[str, str]:
            try:
                return await self._client(addr).query(keys, fingerprint, timeout=self.timeout)
            except StrataError as exc:
                self._failed("lookup", addr, exc)
                return {}

        groups = self._group(hashes)
        found: dict[str, str] = {}
        for part in await asyncio.gather(*(one(a, ks) for a, ks in groups.items())):
            found.update(part)
        return [found.get(h) for h in hashes]

    async def get(
        self, hashes: Sequence[str], fingerprint: str = "", *, dtype: torch.dtype | None = None
    ) -> dict[str, torch.Tensor]:
        """``hash -> tensor`` for the hashes some instance holds (int8 dequantized to ``dtype``)."""
        frames = await self.get_frames(hashes, fingerprint)
        return {h: frame_to_tensor(f, dtype=dtype) for h, f in frames.items()}

    async def get_frames(
        self, hashes: Sequence[str], fingerprint: str = ""
    ) -> dict[str, BlockFrame]:
        """``hash -> assembled frame`` for the hashes some instance holds (the wire form: its
        payload size is what the transfer moved)."""

        async def one(addr: str, keys: list[str]) -> dict[str, BlockFrame]:
            out: dict[str, BlockFrame] = {}
            try:
                async for f in self._client(addr).pull(keys, fingerprint, timeout=self.timeout):
                    out[f.key] = f
            except StrataError as exc:
                self._failed("get", addr, exc)
            return out

        result: dict[str, BlockFrame] = {}
        for part in await asyncio.gather(*(one(a, ks) for a, ks in self._group(hashes).items())):
            result.update(part)
        return result

    async def put(
        self,
        items: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        fingerprint: str = "",
        *,
        int8: bool = False,
    ) -> list[str]:
        """Store blocks on their owners; returns the hashes the pool accepted."""
        pairs = list(items.items()) if isinstance(items, Mapping) else list(items)
        by_owner: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for h, t in pairs:
            by_owner.setdefault(self.owner(h), []).append((h, t))

        async def one(addr: str, blocks: list[tuple[str, torch.Tensor]]) -> list[str]:
            frames = (
                f
                for h, t in blocks
                for f in tensor_to_frames(t, key=h, fingerprint=fingerprint, int8=int8)
            )
            try:
                rep = await self._client(addr).push(frames, timeout=self.timeout)
            except StrataError as exc:
                self._failed("put", addr, exc)
                return []
            return list(rep.stored)

        stored: list[str] = []
        for part in await asyncio.gather(*(one(a, b) for a, b in by_owner.items())):
            stored.extend(part)
        return stored
