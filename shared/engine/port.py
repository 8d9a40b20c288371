"""``EnginePort``: the engine as services see it, a narrow typed port.

The engine runs its step loop in one worker thread; the event loop never runs model code.
Every method here is a named command with typed arguments and a typed result
(`shared.engine.port_types`), executed on the engine thread between steps through a typed
inbox (`shared.engine.commands`); outputs and answers come back with ``call_soon_threadsafe``,
so request intake, output fan-out and network I/O on the loop overlap the forward (torch
releases the GIL inside kernels). Two reads skip the inbox because liveness must not wait for a
forward: `stats` and `queued_tokens` (lock-free estimates). Services import nothing else from
``shared.engine`` but this module, its types and the request parameters.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence

import torch

from shared.engine import commands as cmd
from shared.engine.engine import LLMEngine
from shared.engine.params import EngineConfig
from shared.engine.port_types import (
    BlockEvent,
    EngineStats,
    EvictedBlock,
    ExternalKV,
    KVConnector,
    KVSpec,
    MMInput,
    PrefixMatch,
    RequestKV,
    RequestOutput,
    Tenant,
)
from shared.protocol.errors import StrataError
from shared.protocol.hashing import to_hex
from shared.protocol.sampling import SamplingParams


class EnginePort:
    def __init__(self, engine: LLMEngine):
        self._engine = engine
        self._inbox: queue.Queue[cmd.Command] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()
        k = engine.runner.kv.k  # [layers, blocks, block_size, kv_heads, head_dim]
        # whole blocks: every rank's KV heads under tensor parallelism (`RawKV`)
        heads = engine.runner.kv_heads
        self.kv_spec = KVSpec(k.shape[0], heads, k.shape[4], k.shape[2], k.dtype)
        self.warm_up_s_per_token = 0.0
        self._thread = threading.Thread(target=self._run, name="strata-engine", daemon=True)
        self._thread.start()

    @classmethod
    def open(
        cls, loaded_model, config: EngineConfig, tokenizer=None, warm_up_tokens: int = 0
    ) -> EnginePort:
        """Build the engine and start its thread. With ``warm_up_tokens``, one prefill of that
        many tokens runs first (first-call overheads are paid here; ``warm_up_s_per_token`` is
        its measured seconds per token) and its blocks are neither announced as KV events nor
        written through to the pool."""
        engine = LLMEngine(loaded_model, config, tokenizer=tokenizer)
        spt = 0.0
        if warm_up_tokens > 0:
            cfg = loaded_model.config
            n = min(warm_up_tokens, cfg.max_model_len - 1)
            ids = [(i * 7919) % cfg.vocab_size for i in range(n)]
            t0 = time.perf_counter()
            engine.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))
            spt = (time.perf_counter() - t0) / n
            engine.bm.forget_unowned()  # synthetic tokens: nothing to find, nothing for the pool
            engine.bm.drain_events()
            engine.bm.drain_computed()
        port = cls(engine)
        port.warm_up_s_per_token = spt
        return port

    @staticmethod
    def follow(loaded_model) -> int:
        """A tensor-parallel rank > 0 (its model sharded by `shard_model`): build the runner
        rank 0's engine announces and run rank 0's batches and KV operations until it releases
        the rank; returns how many batches ran."""
        from shared.engine.model_runner import ModelRunner

        return ModelRunner.follower(loaded_model.model).follow()

    # ----- requests --------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        mm_inputs: Sequence[MMInput] = (),
        output_token_ids: Sequence[int] = (),
        hold_kv: bool = False,
        tenant: Tenant | None = None,
        external_kv: ExternalKV | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request; leaving the iterator early aborts it.
        ``output_token_ids`` resumes a request whose tokens were emitted elsewhere; with
        ``hold_kv`` its blocks stay after it finishes, until `release`; ``tenant`` is whose
        request it is (fair queuing among waiting requests); ``external_kv`` is KV of some of
        its prompt's blocks fetched from the pool, which the scheduler takes in at admission
        like a prefix hit (blocks held by then, or not continuing the engine's own prefix, are
        skipped)."""
        add = cmd.Add(
            request_id,
            list(prompt_ids),
            params,
            priority,
            list(mm_inputs),
            list(output_token_ids),
            hold_kv,
            tenant,
            external_kv,
        )
        async for out in self._stream(request_id, add):
            yield out

    async def generate_prefilled(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        first_token_id: int,
        params: SamplingParams,
        *,
        priority: int = 0,
        mm_inputs: Sequence[MMInput] = (),
    ) -> AsyncIterator[RequestOutput]:
        """Commit the KV written into ``request_id``'s reservation (`reserve_kv`, `write_kv`)
        and stream the decode; outputs start after ``first_token_id`` (emitted elsewhere)."""
        add = cmd.AddPrefilled(
            request_id, list(prompt_ids), first_token_id, params, priority, list(mm_inputs)
        )
        async for out in self._stream(request_id, add):
            yield out

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its blocks (its stream ends with finish "abort")."""
        self._submit(cmd.Abort(request_id))

    # ----- KV of a request -------------------------------------------------------------------
    async def reserve_kv(
        self,
        request_id: str,
        num_tokens: int,
        prompt_ids: Sequence[int] | None = None,
        mm_inputs: Sequence[MMInput] = (),
        cache_salt: str = "",
    ) -> int:
        """Reserve blocks for KV computed elsewhere; returns the leading tokens already cached
        here (given the prompt and its ``cache_salt``), which `write_kv` skips. MemoryError
        when the cache is full."""
        return await self._ask(
            cmd.ReserveKV(request_id, num_tokens, prompt_ids, mm_inputs, cache_salt)
        )

    async def write_kv(
        self, request_id: str, layers: range, token_start: int, kv: torch.Tensor
    ) -> int:
        """Write ``[len(layers), 2, n, kvh, hd]`` at tokens ``[token_start, +n)`` of a
        reservation; returns the tokens written."""
        return await self._ask(cmd.WriteKV(request_id, layers, token_start, kv))

    async def cancel_kv(self, request_id: str) -> bool:
        """Drop a reservation and free its blocks; False when there was none."""
        return await self._ask(cmd.CancelKV(request_id))

    async def read_kv(
        self,
        request_id: str,
        layers: range | None = None,
        block_indices: Sequence[int] | None = None,
    ) -> RequestKV:
        """Copy a held request's KV blocks (all layers and blocks by default)."""
        return await self._ask(cmd.ReadKV(request_id, layers, block_indices))

    async def release(self, request_id: str) -> None:
        """Free the blocks of a finished request run with ``hold_kv``."""
        await self._ask(cmd.Release(request_id))

    # ----- prefix cache and pool -------------------------------------------------------------
    async def match_prefix(
        self, token_ids: Sequence[int], mm_inputs: Sequence = (), cache_salt: str = ""
    ) -> PrefixMatch:
        """The prompt's block hashes (rooted at its ``cache_salt``) and how many of its leading
        tokens are cached here.

        Answered on the caller's thread, without waiting for the engine's step (a prompt's pool
        lookup before its submit would otherwise wait one more step, up to a whole prefill
        chunk's forward): the hashes are a pure function of the tokens, and the cached run is
        a lock-free read of the block manager's hash table (each lookup is one dict get). It is
        a snapshot: the engine may evict or cache blocks right after, which costs a recompute
        or a redundant load, never a wrong token."""
        kv = self._engine.kv
        hashes = kv.hashes(list(token_ids), list(mm_inputs), cache_salt)
        return PrefixMatch(to_hex(hashes), kv.cached_tokens(hashes))

    async def drain_evicted(self) -> list[EvictedBlock]:
        """Cached blocks evicted since the last call (``collect_evicted_kv``)."""
        return await self._ask(cmd.DrainEvicted())

    async def drain_computed(self, limit: int = 0) -> list[EvictedBlock]:
        """Copies of the blocks recorded for the pool since the last call (``pool_save``), the
        oldest ``limit`` when set (the rest stay recorded for the next call)."""
        return await self._ask(cmd.DrainComputed(limit))

    async def offer_all(self) -> int:
        """Record every cached block the pool has not been given, for the next
        `drain_computed` (a graceful stop); returns how many."""
        return await self._ask(cmd.OfferAll())

    async def drain_kv_events(self) -> list[BlockEvent]:
        """Cached blocks stored / removed since the last call."""
        return await self._ask(cmd.DrainKVEvents())

    # ----- lock-free reads, hooks, lifecycle -------------------------------------------------
    def stats(self) -> EngineStats:
        """Engine counters; safe from any thread while a step runs."""
        return self._engine.stats()

    def drain_admissions(self) -> list[tuple[str, float]]:
        """(tenant, seconds queued) of requests first admitted since the last call; any thread."""
        return self._engine.drain_admissions()

    def drain_step_times(self) -> list[float]:
        """Seconds of each engine step that ran a batch since the last call; any thread."""
        return self._engine.drain_step_times()

    def queued_tokens(self) -> int:
        """Tokens queued but not yet computed, including the rest of prompts being prefilled
        now. Read without locking (another thread may change the queues): an estimate for load
        reports, never used for correctness; may raise RuntimeError, then read again."""
        sched = self._engine.scheduler
        return sum(
            max(0, q.num_tokens - q.num_computed_tokens - 1)
            for q in list(sched.waiting) + list(sched.running)
        )

    def set_connector(self, connector: KVConnector | None) -> None:
        """Hand each step's per-layer K/V to ``connector`` (set before its requests arrive)."""
        self._engine.connector = connector

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)
        self._engine.close()

    # ----- event-loop side -------------------------------------------------------------------
    async def _ask(self, query: cmd.Query):
        query.reply = asyncio.get_running_loop().create_future()
        self._submit(query)
        return await query.reply

    async def _stream(self, request_id: str, add: cmd.Command) -> AsyncIterator[RequestOutput]:
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        self._submit(add)
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

    def _submit(self, command: cmd.Command) -> None:
        self._inbox.put(command)
        self._wake.set()

    # ----- engine thread ---------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        while True:
            try:
                c = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:
                res = c.run(self._engine)
            except Exception as e:  # noqa: BLE001 - delivered to the caller, not swallowed
                if isinstance(c, cmd.Add | cmd.AddPrefilled):
                    self._deliver([(c.request_id, e)])
                elif isinstance(c, cmd.Query):
                    c.reply.get_loop().call_soon_threadsafe(_resolve, c.reply, None, e)
                else:
                    raise
                continue
            if isinstance(c, cmd.Query):
                c.reply.get_loop().call_soon_threadsafe(_resolve, c.reply, res, None)

    def _deliver(self, items: list[tuple[str, object]]) -> None:
        """(request id, output or exception) to each request's stream, one wake-up per event
        loop: each ``call_soon_threadsafe`` writes the loop's self-pipe and takes the GIL on
        both threads, so a step of 16 running requests costs one hand-over, not 16."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for rid, item in items:
            target = self._streams.get(rid)
            if target is not None:
                batches.setdefault(target[0], []).append((target[1], item))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_put_all, batch)

    def _run(self) -> None:
        e = self._engine
        while not self._stop.is_set():
            self._drain_inbox()
            if not e.has_unfinished_requests():
                if e.idle_work():  # a chunk of idle-time work; then the inbox again
                    continue
                self._wake.wait(timeout=0.05)
                self._wake.clear()
                continue
            try:
                outputs = e.step()
            except Exception as exc:  # noqa: BLE001 - fail every open stream loudly
                exc = _group_failure(e, exc)
                rids = list(self._streams)
                self._deliver([(rid, exc) for rid in rids])
                for rid in rids:
                    e.abort_request(rid)
                continue
            self._deliver([(o.request_id, o) for o in outputs])


def _group_failure(engine: LLMEngine, exc: Exception) -> Exception:
    """A step of a model sharded over several ranks (``--tp`` / ``--ep``) that failed in the
    runtime (a collective whose peer rank died) is the instance's failure, not the requests':
    an ``unavailable`` error, which the gateway fails over with this instance excluded
    (`INSTANCE_ERRORS`), while the rank watcher stops the instance."""
    group = getattr(engine.runner.model, "tp", None)
    if group is not None and group.world_size > 1 and isinstance(exc, RuntimeError):
        return StrataError("unavailable", f"a parallel rank of this instance failed: {exc}")
    return exc


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in items:
        q.put_nowait(item)


def _resolve(fut: asyncio.Future, res, err) -> None:
    if fut.done():
        return
    if err is not None:
        fut.set_exception(err)
    else:
        fut.set_result(res)
