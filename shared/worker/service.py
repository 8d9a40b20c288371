"""What the prefill and decode services share: one task per submitted request, cancellable."""

from __future__ import annotations

import asyncio

from nats.aio.client import Client as NATS

from shared.protocol.errors import StrataError
from shared.protocol.work import HeldQuery, HeldReply, SubmitAck, WorkItem, engine_id
from shared.worker.runtime import ModelRuntime


class RequestTasks:
    """Accepts a submit (a `PrefillWork` or `DecodeWork`; the ack returns at once), runs
    ``_run(item)`` in its own task, and cancels that task on `cancel`. Subclasses implement
    ``_run``."""

    def __init__(self, rt: ModelRuntime, nc: NATS):
        self.rt = rt
        self.nc = nc
        self.tasks: dict[str, asyncio.Task] = {}  # by `WorkItem.engine_id`
        self.attempts: dict[str, set[int]] = {}  # request id -> attempts running here

    @property
    def instance_id(self) -> str:
        return self.rt.cfg.instance_id

    async def submit(self, item: WorkItem) -> SubmitAck:
        rid, eid = item.request_id, item.engine_id
        if eid in self.tasks:
            raise StrataError("bad_request", f"duplicate request id {rid} (attempt {item.attempt})")
        task = asyncio.create_task(self._run(item))
        self.tasks[eid] = task
        self.attempts.setdefault(rid, set()).add(item.attempt)

        def done(_: asyncio.Task) -> None:
            self.tasks.pop(eid, None)
            left = self.attempts.get(rid, set())
            left.discard(item.attempt)
            if not left:
                self.attempts.pop(rid, None)

        task.add_done_callback(done)
        return SubmitAck(instance_id=self.instance_id)

    def running(self, request_id: str, attempt: int | None = None) -> list[str]:
        """Engine ids of ``request_id``'s work here: every attempt, or only ``attempt``."""
        attempts = self.attempts.get(request_id, set())
        if attempt is not None:
            attempts = attempts & {attempt}
        return [engine_id(request_id, a) for a in sorted(attempts)]

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
            task = self.tasks.get(eid)
            if task is not None:
                task.cancel()

    async def _run(self, item: WorkItem) -> None:
        raise NotImplementedError
