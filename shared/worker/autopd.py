"""AutoPD on the instance: a `RoleChange` from the scheduler (`services.scheduler.planner`)
moves this prefill / decode instance to the other role without reloading the model (both roles
run the same engine).

The change, in order:

1. drain: the load reports say ``draining`` (the scheduler that ordered the change already
   stopped routing here; the others stop at the next report), and after two report intervals
   the old role's requests run to completion: nothing is cancelled or moved;
2. flip: once the old role's service is idle, the new role's submit subject is served, the
   instance registers again with the new role and a new incarnation, and its load reports carry
   the new role (on the new role's subject);
3. linger: the old role's submit subject stays served until it has been idle for
   ``autopd_linger_s`` (a decode instance chosen before the change for a request whose prompt
   was still queued on a prefill instance gets that request's decode work afterwards).

Each role's service object is made once and kept, so a later change back reuses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import time

from prometheus_client import Counter, Gauge

from shared import bus
from shared.config import new_incarnation
from shared.kvtransfer.server import KVTransferHandler
from shared.protocol import subjects
from shared.protocol.sched import RETIRED, RoleChange
from shared.protocol.work import DecodeWork, PrefillWork

log = logging.getLogger(__name__)

FLIPS = Counter(
    "strata_autopd_flips_total", "AutoPD role changes this instance made", ["from_role", "to_role"]
)
ROLE = Gauge("strata_autopd_role", "1 for the role this instance serves now", ["role"])
OPEN_AT_SWITCH = Gauge(
    "strata_autopd_open_at_switch",
    "Requests of the old role still running when the last role change switched (0: drained)",
)
RETIREMENTS = Counter(
    "strata_autoscale_retirements_total",
    "Times this instance was retired, by autoscaling or `strata drain` (drained, then stopped; "
    "at most 1 per process)",
)
IGNORED = Counter(
    "strata_autopd_ignored_total",
    "Role changes ignored (another incarnation, another role, or a change already under way)",
)

SERVICES = {
    "prefill": ("services.prefill.service", "PrefillService", PrefillWork),
    "decode": ("services.decode.service", "DecodeService", DecodeWork),
}


def service_class(role: str):
    mod, name, _ = SERVICES[role]
    return getattr(importlib.import_module(mod), name)


class CurrentKV(KVTransferHandler):
    """The gRPC KVTransfer handler of an instance whose role can change: KV pushed here goes to
    the decode service's receiver whenever that service exists (serving or lingering)."""

    def __init__(self, services: dict) -> None:
        self.services = services

    def _target(self) -> KVTransferHandler:
        dec = self.services.get("decode")
        return getattr(dec, "receiver", None) or KVTransferHandler()

    async def push(self, frames):
        return await self._target().push(frames)

    def pull(self, req):
        return self._target().pull(req)

    async def query(self, req):
        return await self._target().query(req)


class RoleSwitcher:
    """Holds the instance's role, its services by role and their submit subscriptions; `on_change`
    runs one role change at a time. ``register()`` writes the registry record of the current
    role and incarnation; ``heartbeat`` (optional) gets its subject moved to the new role."""

    def __init__(self, rt, nc, register, heartbeat=None, retire=None) -> None:
        self.rt, self.nc, self.register, self.heartbeat = rt, nc, register, heartbeat
        self.retire = retire  # called once a retirement has drained (the process then exits)
        self.retired = False
        self._retiring: asyncio.Future | None = None  # the retirement's drain, once started
        self.services: dict[str, object] = {}
        self.subs: dict[str, object] = {}
        self.busy = False
        self.lingering: set[asyncio.Task] = set()
        ROLE.labels(rt.role).set(1)

    @property
    def svc(self):
        return self.services[self.rt.role]

    async def serve(self, role: str) -> object:
        """Make (once) and subscribe ``role``'s service; returns it."""
        svc = self.services.get(role)
        if svc is None:
            svc = self.services[role] = service_class(role)(self.rt, self.nc)
        if role not in self.subs:
            subject = (subjects.prefill_submit if role == "prefill" else subjects.decode_submit)(
                self.rt.cfg.instance_id
            )
            self.subs[role] = await bus.serve(self.nc, subject, SERVICES[role][2], svc.submit)
        return svc

    async def cancel(self, request_id: str, attempt: int | None = None) -> None:
        for svc in list(self.services.values()):
            await svc.cancel(request_id, attempt)

    async def held(self, q):
        for svc in self.services.values():
            rep = await svc.held(q)
            if rep.held:
                return rep
        return await self.svc.held(q)

    async def on_change(self, msg: RoleChange) -> None:
        rt = self.rt
        if (
            self.busy
            or msg.instance_id != rt.cfg.instance_id
            or msg.incarnation != rt.incarnation
            or msg.from_role != rt.role
            or msg.to_role not in (*SERVICES, RETIRED)
            or msg.to_role == rt.role
            or (msg.to_role == RETIRED and self.retire is None)
        ):
            IGNORED.inc()
            log.info("AutoPD: ignoring %s -> %s (role %s)", msg.from_role, msg.to_role, rt.role)
            return
        if msg.to_role == RETIRED:
            await self._retire()  # marks the instance busy itself, for good
            return
        self.busy = True
        try:
            await self._flip(msg.to_role)
        finally:
            self.busy = False

    async def _drain(self, why: str, timeout: float | None = None) -> None:
        """Report ``draining`` (every scheduler stops routing here), then wait until the current
        role's requests have all finished, or ``timeout`` seconds: nothing is cancelled or
        moved here."""
        rt = self.rt
        log.info("%s: draining %s", why, rt.role)
        rt.draining = True
        await asyncio.sleep(2 * rt.cfg.load_interval)  # every scheduler has seen "draining"
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.svc.idle():
            if deadline is not None and time.monotonic() >= deadline:
                return
            await asyncio.sleep(0.05)

    def open_requests(self) -> int:
        """Requests the current role's service holds now."""
        return len(self.svc.tasks)

    async def retire_drain(self) -> int:
        """The drain of a retirement (the scheduler's `RoleChange` to ``RETIRED``, or `strata
        drain`'s, `shared.worker.drain`), run once: a later caller waits for the same one.
        Returns the requests still open when it ended: 0, or those ``drain_timeout_s`` gave up
        on (the stop that follows cancels them; their streams fail over)."""
        if self._retiring is None:
            self._retiring = asyncio.ensure_future(self._retire_drain())
        return await asyncio.shield(self._retiring)

    async def _retire_drain(self) -> int:
        while self.busy:  # a role change under way: it finishes, then its new role drains
            await asyncio.sleep(0.05)
        self.busy = True  # no role change from here on
        t0 = time.monotonic()
        await self._drain("retiring", self.rt.cfg.drain_timeout_s)
        still = self.open_requests()
        OPEN_AT_SWITCH.set(still)
        log.info("retire: drained in %.2fs, %d requests still open", time.monotonic() - t0, still)
        return still

    def finish_retire(self) -> None:
        """After `retire_drain`: hand over to ``retire`` once (the worker stops as on SIGTERM:
        pool flush, deregistration, and exits with `RETIRED_EXIT`)."""
        if self.retired:
            return
        self.retired = True
        RETIREMENTS.inc()
        log.info("retire: stopping")
        self.retire()

    async def _retire(self) -> None:
        """Autoscaling retired this instance: drain, then stop."""
        await self.retire_drain()
        self.finish_retire()

    async def _flip(self, to_role: str) -> None:
        rt, old = self.rt, self.rt.role
        t0 = time.monotonic()
        await self._drain(f"AutoPD: becoming {to_role}")
        old_svc = self.svc
        OPEN_AT_SWITCH.set(len(old_svc.tasks))
        await self.serve(to_role)
        rt.role, rt.incarnation, rt.draining = to_role, new_incarnation(), False
        # the measured prefill rate counts forward time from here (decode forwards are not it)
        rt._rate_mark = (rt.prefilled_tokens, rt.port.stats().forward_time_s)
        if self.heartbeat is not None:
            self.heartbeat.subject = subjects.load_report(to_role, rt.cfg.instance_id)
        await self.register()
        FLIPS.labels(old, to_role).inc()
        ROLE.labels(old).set(0)
        ROLE.labels(to_role).set(1)
        log.info("AutoPD: now %s (drained in %.2fs)", to_role, time.monotonic() - t0)
        t = asyncio.create_task(self._linger(old, old_svc))
        self.lingering.add(t)
        t.add_done_callback(self.lingering.discard)

    async def _linger(self, role: str, svc) -> None:
        """Serve ``role``'s subject until ``svc`` has been idle for the linger time (or the
        instance went back to ``role`` meanwhile), then stop serving it."""
        linger = self.rt.cfg.autopd_linger_s
        while self.rt.role != role:
            quiet = time.monotonic() - svc.last_submit
            if svc.idle() and quiet >= linger:
                sub = self.subs.pop(role, None)
                if sub is not None:
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()
                return
            await asyncio.sleep(min(0.5, max(0.05, linger - quiet)))
