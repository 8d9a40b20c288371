"""What every model instance (prefill or decode) shares: load the model, host the engine off the
event loop, serve KVTransfer over gRPC, heartbeat load reports, publish KV events, honour cancels.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from nats.aio.client import Client as NATS

from shared import bus, metrics
from shared.config import new_incarnation
from shared.engine.port import EnginePort
from shared.protocol import subjects
from shared.protocol.errors import StrataError
from shared.protocol.kv import KVEvent
from shared.protocol.load import LoadReport
from shared.protocol.stream import Cancel, TokenChunk
from shared.worker.config import WorkerConfig
from shared.worker.cost import ReuseCostModel
from shared.worker.heartbeat import Heartbeat
from shared.worker.kv_budget import kv_budget_for
from shared.worker.metrics import EngineMetrics
from shared.worker.pool_link import PoolLink
from shared.worker.tp import TPRanks

log = logging.getLogger(__name__)


def warn_emulated_half(dtype: torch.dtype, device: str) -> bool:
    """Log (and return True) when the model runs bf16/fp16 on a CPU with no native unit for it:
    torch emulates those matrix products, several times slower than float32."""
    from shared.model.cpu_kernels import native_half
    from shared.protocol.dtypes import dtype_name

    name = dtype_name(dtype)
    if device != "cpu" or native_half(name):
        return False
    log.warning(
        "running %s on a CPU without a native %s matrix unit (AVX512 / AMX): torch emulates it, "
        "several times slower than float32 (STRATA_DTYPE=float32 / --dtype float32)",
        name,
        name,
    )
    return True


LONGEST_FORWARD = metrics.Gauge(
    "strata:engine_longest_forward_seconds",
    "Longest single forward seen (the last forward's duration, sampled every load interval)",
    ["role", "instance"],
)


@dataclass
class ModelRuntime:
    """The loaded model and its engine, shared by the prefill and decode cores."""

    cfg: WorkerConfig
    role: str
    loaded: object = None
    port: EnginePort | None = None
    tokenizer: object = None
    incarnation: str = field(default_factory=new_incarnation)
    kv_seq: int = 0
    cost: ReuseCostModel | None = None
    metrics: EngineMetrics | None = None
    prefilled_tokens: int = 0  # prompt tokens this instance computed (cached ones excluded)
    draining: bool = False  # AutoPD: draining its role before a change (`shared.worker.autopd`)
    _rate_mark: tuple[int, float] = (0, 0.0)
    _mixed_mark: tuple[int, float] = (0, 0.0)  # (prompt tokens, s) of mostly-prefill forwards
    _step_mark: tuple[int, float] = (0, 0.0)  # (steps, step seconds) at the last load report
    _longest_forward: float = 0.0
    decode_rate: RateMeter = field(default_factory=lambda: RateMeter(5.0))
    _pool: PoolLink | None = None
    tp: TPRanks | None = None  # rank 0's tensor-parallel group (``--tp N`` > 1)

    def load(self) -> None:
        from shared.model.loader import load_model
        from shared.model.parallel import WORLD_SIZE
        from shared.model.tokenizer import Tokenizer
        from shared.worker.tp import rank_threads, world_size

        WORLD_SIZE.set(self.cfg.tp)
        if world_size(self.cfg) > 1:  # the followers start loading while this rank does
            self.tp = TPRanks(self.cfg, self.role)
        torch.set_num_threads(rank_threads(self.cfg.torch_threads, world_size(self.cfg)))
        dtype = getattr(torch, self.cfg.dtype) if self.cfg.dtype else None
        t0 = time.perf_counter()
        self.loaded = load_model(self.cfg.model, dtype=dtype, device=self.cfg.device)
        warn_emulated_half(self.loaded.model.dtype, self.cfg.device)
        self.tokenizer = Tokenizer.from_dir(self.cfg.model)
        engine_cfg = self._engine_config()  # the whole model's: the instance's KV budget
        if self.tp is not None:
            from shared.worker.tp import shard, world_size

            shard(self.loaded.model, self.tp.group, self.cfg)
            # --tp: each rank holds 1/N of every block: N ranks, the budget's blocks in all;
            # --ep alone: every rank holds the same whole blocks, 1/N of the budget's count, so
            # the instance's N ranks still use the budget's memory
            engine_cfg = dataclasses.replace(
                engine_cfg, kv_cache_bytes=engine_cfg.kv_cache_bytes // world_size(self.cfg)
            )
        # One prefill before serving: first-call overheads are paid there, and its measured
        # seconds per token seed the load-vs-recompute cost model.
        self.port = EnginePort.open(
            self.loaded,
            engine_cfg,
            self.tokenizer,
            warm_up_tokens=128,
        )
        self.cost = ReuseCostModel(self.cfg.block_size)
        self.cost.prefill_s_per_token = self.port.warm_up_s_per_token
        st = self.port.stats()
        self._rate_mark = (0, st.forward_time_s)
        self._mixed_mark = (st.prefill_tokens, st.prefill_forward_s)  # the warm-up is its own
        log.info(
            "loaded %s (%s) in %.1fs",
            self.cfg.model,
            self.loaded.fingerprint[:12],
            time.perf_counter() - t0,
        )

    def close(self) -> None:
        """Stop the engine, then release the tensor-parallel ranks (if any)."""
        if self.port is not None:
            self.port.shutdown()
        if self.tp is not None:
            self.tp.stop()

    def _engine_config(self):
        """The engine settings, with the KV budget resolved (auto when 0) and logged."""
        budget, why = kv_budget_for(self.cfg, self.loaded)
        log.info("KV cache %s", why)
        return self.cfg.engine_config(budget)

    def pool_link(self) -> PoolLink | None:
        """The link to the kvstore instances, when the instance is configured with some."""
        if self._pool is None and self.cfg.kvstore_addrs:
            self._pool = PoolLink(
                self.cfg.kvstore_addrs,
                self.fingerprint,
                self.cost,
                self.port,
                int8=self.cfg.kv_int8,
                load_mode=self.cfg.kv_pool_load,
            )
        return self._pool

    @property
    def fingerprint(self) -> str:
        return self.loaded.fingerprint

    @property
    def model_name(self) -> str:
        import os

        return self.cfg.model_name or os.path.basename(os.path.normpath(self.cfg.model))

    def load_report(self, grpc_addr: str, connected: bool = True) -> LoadReport:
        """The load report (heartbeat). Runs on the heartbeat thread while a forward may be
        running: lock-free reads of engine counters only, nothing that waits for the engine."""
        s = self.port.stats()
        return LoadReport(
            instance_id=self.cfg.instance_id,
            role=self.role,
            incarnation=self.incarnation,
            grpc_addr=grpc_addr,
            model=self.model_name,
            ts=time.time(),
            num_running=s.running,
            num_waiting=s.waiting,
            kv_blocks_total=s.kv_blocks_total,
            kv_blocks_free=s.kv_blocks_free,
            waiting_tokens=self.port.queued_tokens(),
            prefill_tokens_per_s=1.0 / self.cost.prefill_s_per_token,
            decode_tokens_per_s=self.decode_rate.per_second(),
            max_model_len=self.loaded.config.max_model_len,
            block_size=self.cfg.block_size,
            connected=connected,
            tp_size=self.cfg.tp,
            draining=self.draining,
            step_s=self._step_s(s),
        )

    def _step_s(self, s) -> float:
        """Mean engine step seconds since the previous report (0 when no step ran)."""
        steps, total = self._step_mark
        self._step_mark = (s.steps, s.step_time_s)
        n = s.steps - steps
        return (s.step_time_s - total) / n if n > 0 else 0.0

    def observe_stats(self) -> None:
        """Engine metrics and the measured prefill rate (main loop, `housekeeping`)."""
        s = self.port.stats()
        if self.metrics is None:
            self.metrics = EngineMetrics(self.role, self.cfg.instance_id)
        self.metrics.update(s)
        self.metrics.admitted(self.port.drain_admissions())
        self.metrics.stepped(self.port.drain_step_times())
        if s.last_forward_s > self._longest_forward:
            self._longest_forward = s.last_forward_s
            LONGEST_FORWARD.labels(self.role, self.cfg.instance_id).set(s.last_forward_s)
        if self.role == "prefill":
            self._observe_prefill_rate(s)
        else:
            self._observe_mixed_prefill_rate(s)

    def _observe_prefill_rate(self, s) -> None:
        """Seconds per prompt token from the engine's own forward time (not queue time): on a
        prefill instance every forward is prefill work."""
        tokens = self.prefilled_tokens - self._rate_mark[0]
        seconds = s.forward_time_s - self._rate_mark[1]
        if tokens >= self.cfg.block_size and seconds > 0:
            self.cost.observe_prefill(tokens, seconds)
            self._rate_mark = (self.prefilled_tokens, s.forward_time_s)

    def _observe_mixed_prefill_rate(self, s) -> None:
        """Seconds per prompt token on an instance that prefills beside its decodes (the
        colocated shape, short prompts in PD): from its forwards that were mostly prompt chunks
        (`shared.engine.engine.StepTimes`). Without it the instance would report its warm-up's
        rate for its whole life, taken while every instance of the box started at once, and the
        scheduler's prefill rule would send one instance more than its share of prompts for as
        long as it runs (`loadtests.simulator.realreplay`: 1.3-1.5x the mean)."""
        tokens = s.prefill_tokens - self._mixed_mark[0]
        seconds = s.prefill_forward_s - self._mixed_mark[1]
        if tokens >= self.cfg.block_size and seconds > 0:
            self.cost.observe_prefill(tokens, seconds)
            self._mixed_mark = (s.prefill_tokens, s.prefill_forward_s)

    async def kv_events(self) -> list[KVEvent]:
        """The engine's block events since the last call (drained on the engine thread)."""
        out = []
        for ev in await self.port.drain_kv_events():
            self.kv_seq += 1
            out.append(
                KVEvent(
                    instance_id=self.cfg.instance_id,
                    incarnation=self.incarnation,
                    seq=self.kv_seq,
                    tier="engine",
                    kind=ev.kind,
                    hashes=ev.hashes,
                    ts=time.time(),
                )
            )
        return out


class RateMeter:
    """Events per second over a sliding window (token rates for load reports). Thread-safe:
    added to on the event loop, read by the heartbeat thread."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self._events.append((time.monotonic(), n))

    def per_second(self) -> float:
        cutoff = time.monotonic() - self.window_s
        with self._lock:
            while self._events and self._events[0][0] < cutoff:
                self._events.popleft()
            return sum(n for _, n in self._events) / self.window_s


def start_heartbeat(rt: ModelRuntime, nc: NATS, grpc_addr: str) -> Heartbeat:
    """Start the load-report thread (see `shared.worker.heartbeat`): its own loop and NATS
    connection, reporting whether ``nc`` (the main connection) is connected. Blocks until its
    connection is up: call it with ``asyncio.to_thread``."""
    iid = rt.cfg.instance_id
    hb = Heartbeat(
        rt.cfg.nats_url,
        f"{rt.role}:{iid}:heartbeat",
        subjects.load_report(rt.role, iid),
        lambda: rt.load_report(grpc_addr, connected=nc.is_connected),
        rt.cfg.load_interval,
        labels=(rt.role, iid),
    )
    hb.start()
    return hb


async def housekeeping(nc: NATS, rt: ModelRuntime, stop: asyncio.Event) -> None:
    """Every ``load_interval`` on the main loop: engine metrics, KV events, computed and evicted
    blocks to the pool. These wait for the engine thread (up to one forward); liveness does not depend on
    them, the heartbeat thread reports load meanwhile."""

    async def once() -> None:
        rt.observe_stats()
        for ev in await rt.kv_events():
            await bus.publish(nc, subjects.kv_events(rt.cfg.instance_id), ev)
        pool = rt.pool_link()
        if pool is not None:
            await pool.offer()

    from shared.service import periodic

    await periodic(rt.cfg.load_interval, once, stop)


async def publish_error(
    nc: NATS, request_id: str, err: Exception, instance_id: str, attempt: int = 0
) -> None:
    """Tell the gateway a request failed here, with a typed error it can map to a status."""
    chunk = error_chunk(request_id, err, instance_id, attempt)
    await bus.publish(nc, subjects.req_out(request_id), chunk)


def error_chunk(request_id: str, err: Exception, instance_id: str, attempt: int) -> TokenChunk:
    """The final chunk of a request that failed here: a typed error (an unknown exception is
    ``internal``) the gateway maps to a status."""
    if not isinstance(err, StrataError):
        err = StrataError("internal", f"{type(err).__name__}: {err}")
    return TokenChunk(
        request_id=request_id,
        index=0,
        finish_reason="abort",
        error=err.info(),
        instance_id=instance_id,
        attempt=attempt,
    )


async def subscribe_cancels(nc: NATS, on_cancel) -> None:
    """``strata.req.*.cancel``: abort the request if it runs here (a no-op otherwise); a
    failover's cancel (``attempt`` set) only that route's work."""

    async def handle(msg: Cancel):
        await on_cancel(msg.request_id, msg.attempt)
        return None

    await bus.serve(nc, subjects.REQ_CANCEL_ALL, Cancel, handle)


REQUESTS_FAILED = metrics.Counter(
    "strata_worker_requests_failed_total", "Requests that failed on this instance", ["role"]
)
