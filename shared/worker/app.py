"""Wiring shared by `strata serve prefill` and `strata serve decode`: load, connect, serve, drain."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from nats.aio.client import Client as NATS

from shared import bus, metrics
from shared.kvtransfer.client import close_clients
from shared.kvtransfer.server import start_kv_server
from shared.logs import setup_logging
from shared.model.validate import validate_checkpoint
from shared.omp import in_fresh_thread, serial_torch_here
from shared.protocol import subjects
from shared.protocol.sched import RETIRED_EXIT, InstanceRecord, RoleChange
from shared.protocol.work import HeldQuery
from shared.registry import deregister_instance, register_instance
from shared.service import StartupError, announce_ready, run
from shared.worker.autopd import CurrentKV, RoleSwitcher
from shared.worker.config import WorkerConfig
from shared.worker.drain import DrainEndpoint
from shared.worker.heartbeat import Heartbeat
from shared.worker.runtime import (
    ModelRuntime,
    housekeeping,
    start_heartbeat,
    subscribe_cancels,
)

log = logging.getLogger(__name__)


@dataclass
class Worker:
    """A running instance: its runtime, role switcher (its services by role), gRPC server and
    background tasks."""

    rt: ModelRuntime
    roles: RoleSwitcher
    nc: NATS
    server: object
    addr: str
    tasks: list[asyncio.Task]
    heartbeat: Heartbeat | None = None
    drain: DrainEndpoint | None = None

    @property
    def svc(self):
        """The service of the role the instance serves now."""
        return self.roles.svc

    async def stop(self) -> None:
        if self.drain is not None:
            await self.drain.close()
        for t in [*self.tasks, *self.roles.lingering]:
            t.cancel()
        if self.heartbeat is not None:
            await asyncio.to_thread(self.heartbeat.stop)
        with contextlib.suppress(Exception):
            await deregister_instance(self.nc.jetstream(), self.rt.cfg.instance_id)
        for svc in self.roles.services.values():
            svc.hand_off()  # what is still open fails over to another instance
        pool = self.rt.pool_link() if self.rt.port is not None else None
        if pool is not None and self.rt.cfg.kv_pool_flush_s > 0:
            try:  # what engine memory holds and the pool lacks, so a restart finds it
                sent = await pool.flush(self.rt.cfg.kv_pool_flush_s)
                log.info("stop: %d KV bytes handed to the pool", sent)
            except Exception as exc:  # a cache: the stop goes on
                log.warning("stop: pool flush failed: %s", exc)
        await self.server.stop(1.0)
        self.rt.close()


async def start_worker(
    cfg: WorkerConfig,
    role: str,
    make_service=None,
    nc: NATS | None = None,
    rt: ModelRuntime | None = None,
    stop: asyncio.Event | None = None,
) -> Worker:
    """Bring an instance up on an open NATS connection (used by the app and by tests).

    ``make_service(runtime, nc)`` (default: the role's class, `shared.worker.autopd.SERVICES`)
    returns an object with ``submit(work)`` (a `PrefillWork` or `DecodeWork`),
    ``cancel(request_id)``, ``held(query)``, ``idle()``, ``hand_off()``, ``tasks`` and
    optionally ``receiver`` (its KVTransfer handler). A role change (AutoPD) makes the other
    role's service from its class. With ``stop`` and ``cfg.drain_socket``, `strata drain`
    reaches the instance there (`shared.worker.drain`)."""
    if rt is None:
        rt = ModelRuntime(cfg, role)
        # The load and warm-up forward lead an OpenMP team; on a thread that then exits, so the
        # engine thread's team stays the process's only one (shared/omp.py).
        await asyncio.to_thread(in_fresh_thread, rt.load)
    addr = ""

    async def register() -> None:
        m = rt.loaded.config
        await register_instance(
            nc.jetstream(),
            InstanceRecord(
                instance_id=cfg.instance_id,
                role=rt.role,
                incarnation=rt.incarnation,
                grpc_addr=addr,
                model=rt.model_name,
                capacity={
                    "kv_blocks": rt.port.stats().kv_blocks_total,
                    "max_num_seqs": cfg.max_num_seqs,
                    "max_model_len": m.max_model_len,
                },
            ),
            replicas=cfg.js_replicas,
        )

    # a retirement (autoscaling) ends in the same stop as SIGTERM, when the caller gave one
    roles = RoleSwitcher(rt, nc, register, retire=None if stop is None else stop.set)
    if make_service is not None:
        roles.services[role] = make_service(rt, nc)
    await roles.serve(role)
    server, addr = await start_kv_server(CurrentKV(roles.services), cfg.grpc_host, cfg.grpc_port)
    await subscribe_cancels(nc, roles.cancel)
    await bus.serve(nc, subjects.work_probe(cfg.instance_id), HeldQuery, roles.held)
    await bus.serve(nc, subjects.role_change(cfg.instance_id), RoleChange, _no_reply(roles))
    await register()
    # Liveness from its own thread and connection; engine-bound chores on the main loop.
    hb = await asyncio.to_thread(start_heartbeat, rt, nc, addr)
    roles.heartbeat = hb
    chores = asyncio.create_task(housekeeping(nc, rt, stop or asyncio.Event()))
    drain = None
    if cfg.drain_socket and roles.retire is not None:  # `strata drain` (a preStop hook)
        drain = await DrainEndpoint(roles, cfg.drain_socket, cfg.instance_id).start()
    return Worker(rt, roles, nc, server, addr, [chores], hb, drain)


def _no_reply(roles: RoleSwitcher):
    """The role-change handler: runs the change in the background (a drain takes a while)."""

    async def handle(msg: RoleChange) -> None:
        t = asyncio.create_task(roles.on_change(msg))
        roles.lingering.add(t)
        t.add_done_callback(roles.lingering.discard)

    return handle


def check_tp(cfg: WorkerConfig) -> None:
    """``--tp N`` / ``--ep N`` this checkpoint and device can run, else one clear start-up
    error."""
    from shared.model.config import load_config
    from shared.model.ep import check_ep
    from shared.model.parallel import check_shardable
    from shared.worker.tp import world_size

    if cfg.tp > 1 and cfg.ep > 1 and cfg.tp != cfg.ep:
        raise StartupError(
            f"--tp {cfg.tp} with --ep {cfg.ep}: together they run over the same ranks, so they "
            "must be equal"
        )
    c = load_config(cfg.model)
    check_ep(c, cfg.ep)
    check_shardable(c, cfg.tp, experts=cfg.ep > 1)
    if cfg.device.startswith("cuda"):
        import torch

        from shared.worker.tp import rank_device

        n, flag = world_size(cfg), "--ep" if cfg.ep > 1 else "--tp"
        last = int(rank_device(cfg.device, n - 1).split(":")[1])
        if last >= torch.cuda.device_count():
            raise StartupError(
                f"{flag} {n} on {cfg.device} needs CUDA devices up to cuda:{last}; "
                f"{torch.cuda.device_count()} visible"
            )


def run_worker(role: str, argv: list[str], make_service) -> None:
    """`strata serve <role>` for a model instance whose logic is ``make_service``."""
    cfg = WorkerConfig.load(argv, role=role)
    if not cfg.model:
        raise StartupError("no model: pass --model DIR (STRATA_MODEL), a checkpoint directory")
    validate_checkpoint(cfg.model)  # a bad checkpoint fails here, before NATS or torch work
    if cfg.tp > 1 or cfg.ep > 1:  # heads/experts that do not split: refused before ranks start
        check_tp(cfg)
    setup_logging(role, cfg.instance_id, cfg.log_level)
    metrics.serve_metrics(cfg.metrics_port, cfg.metrics_bind)

    async def main(stop: asyncio.Event) -> None:
        # The loop and its executor threads copy KV blocks with torch; never as a second
        # OpenMP team beside the engine's (shared/omp.py).
        serial_torch_here()
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(4, initializer=serial_torch_here))
        nc = await bus.connect(cfg.nats_url, f"{role}:{cfg.instance_id}")
        worker = await start_worker(cfg, role, make_service, nc, stop=stop)
        metrics.SERVICE_INFO.labels(role, cfg.instance_id).set(1)
        announce_ready(role, cfg.instance_id, f"grpc={worker.addr}")
        await stop.wait()
        log.info("stopping")
        await worker.stop()
        await nc.drain()
        await close_clients()
        retired[0] = worker.roles.retired

    retired = [False]
    run(main)
    if retired[0]:  # drained and stopped by the autoscaler: a launcher must not restart it
        raise SystemExit(RETIRED_EXIT)
