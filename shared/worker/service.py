"""What the prefill and decode services share: one task per submitted request, cancellable."""

from __future__ import annotations

import asyncio
import time

from nats.aio.client import Client as NATS

from shared.protocol.errors import StrataError
from shared.protocol.work import HeldQuery, HeldReply, SubmitAck, WorkItem, engine_id, engine_ids_of
from shared.worker.runtime import ModelRuntime


class RequestTasks:
    """Accepts a submit (a `PrefillWork` or `DecodeWork`; the ack returns at once), runs
    ``_run(item)`` in its own task, and cancels that task on `cancel`. Subclasses implement
    ``_run``."""

    def __init__(self, rt: ModelRuntime, nc: NATS):
        self.rt = rt
        self.nc = nc
        self.tasks: dict[str, asyncio.Task] = {}  # by `WorkItem.engine_id`
        self.last_submit = 0.0  # monotonic time of the last submit (AutoPD drains until quiet)
        self.stopping = False  # set by `hand_off`: a cancelled request goes on elsewhere

    @property
    def instance_id(self) -> str:
        return self.rt.cfg.instance_id

    async def submit(self, item: WorkItem) -> SubmitAck:
        rid, eid = item.request_id, item.engine_id
        self.last_submit = time.monotonic()
        if eid in self.tasks:
            raise StrataError("bad_request", f"duplicate request id {rid} (attempt {item.attempt})")
        task = asyncio.create_task(self._run(item))
        self.tasks[eid] = task
        task.add_done_callback(lambda _: self.tasks.pop(eid, None))
        return SubmitAck(instance_id=self.instance_id)

    def running(self, request_id: str, attempt: int | None = None) -> set[str]:
        """Engine ids of ``request_id``'s work here: every attempt, or only ``attempt``."""
        return engine_ids_of(request_id, attempt, self.tasks)

    async def held(self, q: HeldQuery) -> HeldReply:
        """`subjects.work_probe`: whether route ``q.attempt`` of the request runs here."""
        return HeldReply(
            held=engine_id(q.request_id, q.attempt) in self.tasks,
            engine_steps=self.rt.port.stats().steps,
        )

    async def cancel(self, request_id: str, attempt: int | None = None) -> None:
        """Cancel ``request_id``'s work here: all of it, or only route ``attempt`` (a failover:
        a later route of the same request may run here too and must go on)."""
        for eid in self.running(request_id, attempt):
            self.tasks[eid].cancel()

    def hand_off(self) -> None:
        """The instance stops (SIGTERM, or a drain that reached ``drain_timeout_s``): cancel
        every request here, each ending with an ``unavailable`` error that names this instance,
        so the gateway fails its stream over (resuming after the tokens sent), not an abort."""
        self.stopping = True
        for t in list(self.tasks.values()):
            t.cancel()

    def stopped_error(self) -> StrataError:
        return StrataError("unavailable", f"instance {self.instance_id} stopped")

    def idle(self) -> bool:
        """No request runs here (and, for decode, no KV transfer is arriving)."""
        return not self.tasks

    async def _run(self, item: WorkItem) -> None:
        raise NotImplementedError
