"""What the prefill and decode services share: one task per submitted request, cancellable."""

from __future__ import annotations

import asyncio

from nats.aio.client import Client as NATS

from shared.protocol.errors import StrataError
from shared.protocol.work import SubmitAck, WorkItem
from shared.worker.runtime import ModelRuntime


class RequestTasks:
    """Accepts a submit (a `PrefillWork` or `DecodeWork`; the ack returns at once), runs
    ``_run(item)`` in its own task, and cancels that task on `cancel`. Subclasses implement
    ``_run``."""

    def __init__(self, rt: ModelRuntime, nc: NATS):
        self.rt = rt
        self.nc = nc
        self.tasks: dict[str, asyncio.Task] = {}

    @property
    def instance_id(self) -> str:
        return self.rt.cfg.instance_id

    async def submit(self, item: WorkItem) -> SubmitAck:
        if item.request_id in self.tasks:
            raise StrataError("bad_request", f"duplicate request id {item.request_id}")
        task = asyncio.create_task(self._run(item))
        self.tasks[item.request_id] = task
        task.add_done_callback(lambda _: self.tasks.pop(item.request_id, None))
        return SubmitAck(instance_id=self.instance_id)

    async def cancel(self, request_id: str) -> None:
        task = self.tasks.get(request_id)
        if task is not None:
            task.cancel()

    async def _run(self, item: WorkItem) -> None:
        raise NotImplementedError
