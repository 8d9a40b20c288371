"""Exact-match cache of whole responses for deterministic requests (opt-in; docs/api.md).

What is cached is the generation, not the formatted body: each choice's `TokenChunk`s as the
bus delivered them. A hit replays them through the same `Run` and `Formatter` a live request
uses (`response_cache_run.CacheRun`), so a hit streams and formats exactly like a miss (chat or
completions, SSE or not, echo, logprobs, tool calls, the pre-filter's masks) with a new id.

The key (`cache_key`) is sha256 over canonical JSON of everything that decides the tokens: the
model fingerprint and KV dtype the tokenizer reported (a new model is a new key space), ``n``,
and per prompt the token ids after templating and truncation, the image hashes and offsets, and
the final `SamplingParams` (max_tokens, stop, seed, temperature, logprobs, grammar, ...: all of
it). Only deterministic requests are cached: temperature 0, or a fixed seed (`deterministic`).

Tiers (`ResponseCache.get` looks in this order; a hit in a lower tier is copied up):
- hot: this gateway's memory, an LRU bounded by bytes (`HotTier`);
- warm: the kvstore's DRAM, cold: its MinIO bucket (`response_tiers.KVStoreTier`): the object
  is a content-addressed block in the namespace ``resp-<model fingerprint>``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections import OrderedDict
from typing import Any

from prometheus_client import Counter
from pydantic import BaseModel

from services.gateway.config import GatewayConfig
from services.gateway.core import ApiError
from services.gateway.pipeline import Prepared
from shared.protocol.base import Msg
from shared.protocol.codec import decode, encode
from shared.protocol.stream import TokenChunk

log = logging.getLogger(__name__)

CACHE = Counter(
    "strata_response_cache",
    "Response cache lookups and stores by tier (hot, warm, cold; none for bypass) and outcome "
    "(hit, miss, store, error, bypass)",
    ["tier", "outcome"],
)
HEADER = "X-Strata-Cache"
"""Request header (``use`` / ``off``) and response header (the `CacheRun.cache_state`)."""
KEY_VERSION = 1  # bump when the key's contents or the stored object's shape change


class CachedResponse(Msg):
    """What a tier stores: every choice's chunks, with the key and model they belong to (checked
    on read, so a corrupt or misplaced object is a miss, never a wrong answer)."""

    key: str
    fingerprint: str
    choices: list[list[TokenChunk]]


def wanted(req: BaseModel, headers: dict[str, str]) -> bool:
    """Whether the request asks for the cache: the ``cache`` body field, else the
    ``X-Strata-Cache`` header (``use`` or ``off``; anything else is a 400 naming it)."""
    value = {k.lower(): v for k, v in headers.items()}.get(HEADER.lower())
    if value is not None and value.strip().lower() not in ("use", "off"):
        raise ApiError(
            "bad_request",
            f"{HEADER} must be 'use' or 'off' (got {value[:40]!r})",
            param="cache",
        )
    field = getattr(req, "cache", None)
    if field is not None:
        return bool(field)
    return value is not None and value.strip().lower() == "use"


def deterministic(prepared: list[Prepared]) -> bool:
    """Greedy (temperature 0) or seeded sampling for every prompt: the same request gives the
    same tokens, so a stored answer is the answer."""
    return all(p.sampling.temperature == 0.0 or p.sampling.seed is not None for p in prepared)


def namespace(prepared: list[Prepared]) -> str:
    """The kvstore fingerprint response objects live under (one per model)."""
    return f"resp-{prepared[0].fingerprint or 'none'}"


def cache_key(n: int, prepared: list[Prepared]) -> str:
    """sha256 (hex) of the canonical JSON of every output-deciding input (module doc)."""
    doc: dict[str, Any] = {
        "v": KEY_VERSION,
        "fingerprint": prepared[0].fingerprint,
        "kv_dtype": prepared[0].kv_dtype,
        "n": n,
        "prompts": [
            {
                "ids": p.prompt_token_ids,
                "images": [[r.offset, r.length, r.hash] for r in p.images],
                "sampling": p.sampling.model_dump(mode="json"),
            }
            for p in prepared
        ],
    }
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


class HotTier:
    """Serialized responses by key, least recently used first out, within ``budget`` bytes
    (an object larger than the budget is not kept). Synchronous; one per gateway."""

    def __init__(self, budget: int):
        self.budget = budget
        self.used = 0
        self._items: OrderedDict[str, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def get(self, key: str) -> bytes | None:
        data = self._items.get(key)
        if data is not None:
            self._items.move_to_end(key)
        return data

    def put(self, key: str, data: bytes) -> list[str]:
        """Store ``data``; returns the keys evicted to make room (oldest first)."""
        if len(data) > self.budget:
            return []
        old = self._items.pop(key, None)
        if old is not None:
            self.used -= len(old)
        self._items[key] = data
        self.used += len(data)
        evicted = []
        while self.used > self.budget:
            k, v = self._items.popitem(last=False)
            self.used -= len(v)
            evicted.append(k)
        return evicted

    def clear(self) -> None:
        self._items.clear()
        self.used = 0


class ResponseCache:
    """The tiers of one gateway; `from_config` gives None when the deployment has it off."""

    def __init__(self, cfg: GatewayConfig, lower=None):
        self.cfg = cfg
        self.hot = HotTier(cfg.response_cache_bytes)
        self.lower = lower  # response_tiers.KVStoreTier, or None (hot tier only)
        self._writes: set[asyncio.Task] = set()

    @classmethod
    def from_config(cls, cfg: GatewayConfig) -> ResponseCache | None:
        if not cfg.response_cache:
            return None
        lower = None
        if cfg.kvstore_addrs:
            from services.gateway.response_tiers import KVStoreTier

            lower = KVStoreTier(cfg.kvstore_addrs, cfg.response_cache_timeout)
        return cls(cfg, lower)

    async def get(self, ns: str, key: str) -> tuple[CachedResponse, str] | None:
        """``(response, tier)`` with tier "hot", "warm" or "cold"; None on a miss. A failing
        kvstore is a miss (counted as an error), never an error to the client."""
        data = self.hot.get(key)
        hot = None if data is None else self._decode(data, key, ns)
        if hot is not None:
            CACHE.labels("hot", "hit").inc()
            return hot, "hot"
        CACHE.labels("hot", "miss" if data is None else "error").inc()
        if self.lower is None:
            return None
        try:
            found = await self.lower.get(ns, key)
        except Exception as exc:  # noqa: BLE001 - a cache outage costs a recompute only
            CACHE.labels("warm", "error").inc()
            log.warning("response cache read of %s failed (a miss): %s", key[:16], exc)
            return None
        if found is None:
            CACHE.labels("warm", "miss").inc()
            CACHE.labels("cold", "miss").inc()
            return None
        data, tier = found
        if tier == "cold":
            CACHE.labels("warm", "miss").inc()
        resp = self._decode(data, key, ns)
        if resp is None:
            CACHE.labels(tier, "error").inc()
            return None
        CACHE.labels(tier, "hit").inc()
        self.hot.put(key, data)
        return resp, tier

    def _decode(self, data: bytes, key: str, ns: str) -> CachedResponse | None:
        try:
            resp = decode(data, CachedResponse)
        except Exception as exc:  # noqa: BLE001 - a corrupt object is a miss
            log.warning("response cache object %s unreadable: %s", key[:16], exc)
            return None
        if resp.key != key or f"resp-{resp.fingerprint or 'none'}" != ns:
            log.warning("response cache object %s belongs to another key", key[:16])
            return None
        return resp

    def store(self, ns: str, resp: CachedResponse) -> None:
        """Keep a finished response: in the hot tier now, in the kvstore in the background."""
        data = encode(resp)
        if len(data) > self.cfg.response_cache_max_entry_bytes:
            return
        self.hot.put(resp.key, data)
        CACHE.labels("hot", "store").inc()
        if self.lower is None:
            return
        task = asyncio.get_running_loop().create_task(self._write(ns, resp.key, data))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, ns: str, key: str, data: bytes) -> None:
        try:
            await self.lower.put(ns, key, data)
            CACHE.labels("warm", "store").inc()
        except Exception as exc:  # noqa: BLE001 - the hot tier still has it
            CACHE.labels("warm", "error").inc()
            log.warning("response cache write of %s failed: %s", key[:16], exc)

    async def drain(self) -> None:
        """Wait for the kvstore writes in flight (shutdown, tests)."""
        while self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)
