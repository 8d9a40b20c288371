"""`CacheRun`: a `Run` that asked for the response cache (`response_cache`).

A hit replays the stored chunks instead of routing the request (nothing reaches the scheduler
or an engine); a miss records the chunks the bus delivers and stores them once every choice
finished normally ("stop" or "length": never an error, a cancel or a client that left). Either
way ``cache_state`` says what happened: the ``X-Strata-Cache`` response header and
``usage.response_cache`` carry it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from services.gateway.response_cache import (
    CACHE,
    HEADER,
    CachedResponse,
    ResponseCache,
    cache_key,
    deterministic,
    namespace,
)
from services.gateway.service import Run
from shared.protocol.stream import TokenChunk

FINISHED = frozenset({"stop", "length"})
"""Finish reasons of a response worth keeping (an "abort" is a cancel)."""


class CacheRun(Run):
    """``cache_state``: "hit-hot" | "hit-warm" | "hit-cold" | "miss" (stored when it finishes)
    | "bypass" (not deterministic) | "disabled" (the deployment has the cache off)."""

    def __init__(
        self,
        base: Run,
        state: str,
        cache: ResponseCache | None = None,
        ns: str = "",
        key: str = "",
        replay: list[list[TokenChunk]] | None = None,
    ):
        super().__init__(
            base.pipeline, base.spec, base.request_id, base.prepared, base.fmt, base.arrival
        )
        self.cache_state = state
        self.cache = cache
        self.cache_ns = ns
        self.cache_key = key
        self.replay = replay
        self._got: list[list[TokenChunk]] | None = None
        if state == "miss":
            self._got = [[] for _ in self.choices]

    def _source(self, i: int) -> AsyncIterator[TokenChunk]:
        if self.replay is not None:
            return _replay(self.replay[i])
        if self._got is not None:
            return self._recorded(i)
        return super()._source(i)

    async def _recorded(self, i: int) -> AsyncIterator[TokenChunk]:
        assert self._got is not None
        async for c in super()._source(i):
            self._got[i].append(c)
            yield c

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        got = self._got
        if got is None or self.cache is None:
            return
        self._got = None  # stored once at most
        if all(c.finish_reason in FINISHED for c in self.choices) and all(
            g and g[-1].finish_reason in FINISHED for g in got
        ):
            fp = self.prepared[0].fingerprint
            resp = CachedResponse(key=self.cache_key, fingerprint=fp, choices=got)
            self.cache.store(self.cache_ns, resp)

    def _mark(self, use: dict[str, Any] | None) -> None:
        if use is not None:
            use["response_cache"] = self.cache_state

    async def next_events(self, timeout: float | None = None) -> list[dict[str, Any]] | None:
        out = await super().next_events(timeout)
        for ev in out or ():
            self._mark(ev.get("usage"))
        return out

    async def complete(self) -> dict[str, Any]:
        body = await super().complete()
        self._mark(body.get("usage"))
        return body


async def _replay(chunks: list[TokenChunk]) -> AsyncIterator[TokenChunk]:
    for c in chunks:
        yield c


async def cached_run(cache: ResponseCache | None, run: Run) -> CacheRun:
    """``run`` (not started yet) as a `CacheRun`: looked up in the tiers when the deployment
    has the cache on and the request is deterministic."""
    if cache is None:
        return CacheRun(run, "disabled")
    if not deterministic(run.prepared):
        CACHE.labels("none", "bypass").inc()
        return CacheRun(run, "bypass")
    ns, key = namespace(run.prepared), cache_key(run.spec.n, run.prepared)
    found = await cache.get(ns, key)
    if found is None or len(found[0].choices) != len(run.choices):
        return CacheRun(run, "miss", cache, ns, key)
    resp, tier = found
    return CacheRun(run, f"hit-{tier}", cache, ns, key, resp.choices)


def headers(run: Any) -> dict[str, str]:
    """The response header of a run that asked for the cache (none for the others)."""
    state = getattr(run, "cache_state", None)
    return {HEADER: state} if state else {}
