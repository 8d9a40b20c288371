"""``AsyncEngine``: the step loop in one worker thread, streams on the event loop.

The event loop never runs model code. Requests and aborts enter through a thread-safe queue
that the worker drains between steps; outputs are handed back with ``call_soon_threadsafe``, so
request intake, output fan-out and network I/O on the loop overlap the worker's forward (torch
releases the GIL inside kernels). ``stats()`` reports forward time, step time and the idle gap
between steps.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Sequence

from shared.engine.engine import LLMEngine
from shared.engine.outputs import EngineStats, RequestOutput
from shared.engine.params import SamplingParams


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        # Called as ``layer_hook(engine, layer)`` on the worker thread after each layer of every
        # step has written its K/V (``engine.current`` is that step): layer-wise KV streaming.
        self.layer_hook = None
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="strata-engine", daemon=True)
        self._thread.start()

    async def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        **kwargs,
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request; leaving the iterator early aborts it."""
        async for out in self._stream(request_id, ("add", request_id, list(prompt_ids), params,
                                                   kwargs)):
            yield out

    async def generate_prefilled(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        first_token_id: int,
        params: SamplingParams,
        kv,
        **kwargs,
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs of a request prefilled elsewhere (``kv``: ``[L, 2, n, kvh, hd]``, or
        None when it was already written into blocks reserved for ``request_id``); outputs start
        after ``first_token_id``. See ``LLMEngine.add_prefilled_request`` / ``commit_prefilled``."""
        item = ("prefilled", request_id, list(prompt_ids), params,
                dict(kwargs, first_token_id=first_token_id, kv=kv))
        async for out in self._stream(request_id, item):
            yield out

    async def _stream(self, request_id: str, item) -> AsyncIterator[RequestOutput]:
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        self._submit(item)
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    def call(self, fn, *args):
        """Run ``fn(engine, *args)`` on the worker thread between steps (KV hooks etc.)."""
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._submit(("call", fn, args, fut))
        return fut

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)
        self.engine.close()

    # ----- worker thread ---------------------------------------------------------------------
    def _on_layer(self, layer: int) -> None:
        hook = self.layer_hook
        if hook is not None:
            hook(self.engine, layer)

    def _submit(self, item) -> None:
        self._inbox.put(item)
        self._wake.set()

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            kind = item[0]
            try:
                if kind == "add":
                    _, rid, ids, params, kw = item
                    self.engine.add_request(rid, ids, params, **kw)
                elif kind == "prefilled":
                    _, rid, ids, params, kw = item
                    first, kv = kw.pop("first_token_id"), kw.pop("kv")
                    if kv is None:  # KV already written into blocks reserved for rid
                        self.engine.commit_prefilled(rid, ids, first, params, **kw)
                    else:
                        self.engine.add_prefilled_request(rid, ids, first, params, kv, **kw)
                elif kind == "abort":
                    self.engine.abort_request(item[1])
                else:
                    _, fn, args, fut = item
                    res = fn(self.engine, *args)
                    fut.get_loop().call_soon_threadsafe(_resolve, fut, res, None)
            except Exception as e:  # noqa: BLE001 - delivered to the caller, not swallowed
                if kind in ("add", "prefilled"):
                    self._deliver(item[1], e)
                elif kind == "call":
                    item[3].get_loop().call_soon_threadsafe(_resolve, item[3], None, e)
                else:
                    raise

    def _deliver(self, rid: str, item) -> None:
        target = self._streams.get(rid)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_inbox()
            if not self.engine.has_unfinished_requests():
                self._wake.wait(timeout=0.05)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step(self._on_layer if self.layer_hook else None)
            except Exception as e:  # noqa: BLE001 - fail every open stream loudly
                for rid in list(self._streams):
                    self._deliver(rid, e)
                    self.engine.abort_request(rid)
                continue
            for o in outputs:
                self._deliver(o.request_id, o)


def _resolve(fut: asyncio.Future, res, err) -> None:
    if fut.done():
        return
    if err is not None:
        fut.set_exception(err)
    else:
        fut.set_result(res)
