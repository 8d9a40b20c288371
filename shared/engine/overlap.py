"""``OverlapStepper``: the engine's step with the forward on a forward thread.

The plain step (``LLMEngine.step``) is schedule -> run -> postprocess on one thread. This class
runs the same parts in another order: the forward (``LLMEngine._run``: forward + sampling) goes
to a forward thread, and while it runs the engine thread schedules and prepares the next step
when that one can be known before the tokens exist (a pure-decode batch that nothing could
change: ``Scheduler.schedule_decode_ahead``). When the forward lands its tokens are applied
(``LLMEngine._advance``), filled into the prepared step, which launches at once, and only then
are outputs built (``LLMEngine._outputs``: detokenization, stop strings), during that forward.

A sequence finished or aborted while a forward that writes to it is in flight keeps its blocks
until the forward lands (``Scheduler.in_flight`` / ``end_flight``), so no block is handed out
while it is still being written. Outputs are token-for-token those of the plain step.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from shared.engine.sequence import SequenceStatus

if TYPE_CHECKING:
    from shared.engine.engine import LLMEngine, StepResult
    from shared.engine.model_runner import PreparedBatch
    from shared.engine.outputs import RequestOutput
    from shared.engine.scheduler import SchedulerOutput


class OverlapStepper:
    """The overlapped variant of ``LLMEngine.step`` (``EngineConfig.async_scheduling``)."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="strata-forward")
        # the step whose forward runs now, and its result (forward + sampling) to come
        self.flight: tuple[SchedulerOutput, Future[StepResult]] | None = None

    def step(self, t0: float, layer_callback) -> list[RequestOutput]:
        """The outputs of the forward that lands in this call: the one in flight, else the one
        this call schedules and launches (none when nothing is scheduled)."""
        e = self.engine
        if self.flight is None:
            sched = e._schedule(t0)
            if not sched.is_empty:
                self._launch(sched, e.runner.prepare(sched), layer_callback)
        if self.flight is None:
            return []
        return self._land(layer_callback)

    def _launch(self, sched: SchedulerOutput, batch: PreparedBatch, layer_callback) -> None:
        e = self.engine
        e.current = sched  # what a layer callback of this step may look at
        e.scheduler.in_flight = {id(s.seq) for s in sched.scheduled}
        self.flight = (sched, self.thread.submit(e._run, sched, batch, layer_callback))

    def _land(self, layer_callback) -> list[RequestOutput]:
        """Prepare the next step while the forward runs, wait for it, apply its tokens, launch
        the prepared step, then build the outputs."""
        e = self.engine
        sched, fut = self.flight
        ahead = None
        # drafts and a layer callback (the KV connector) need the step's outcome to schedule
        if layer_callback is None and e.proposer is None:
            nxt = e.scheduler.schedule_decode_ahead(sched)
            if nxt is not None:
                e.kv.move(nxt)  # blocks it evicted are read out before anyone writes them
                ahead = (nxt, e.runner.prepare_decode_ahead(nxt))
        try:
            ran = fut.result()
        finally:
            self.flight = None
            e.scheduler.end_flight()
        touched = e._advance(ran)
        if ahead is not None and _each_decodes_one(ahead[0]):
            e.runner.fill_ahead_tokens(ahead[1], ahead[0])
            self._launch(*ahead, layer_callback)
            e.times.ahead_steps += 1
        # Detokenize and build outputs while the next forward runs. A stop string found here
        # finishes a sequence that may be in that forward: its blocks wait for end_flight().
        return e._outputs(touched)

    def close(self) -> None:
        """Stop the forward thread (after the forward in flight, if any)."""
        self.thread.shutdown(wait=True)


def _each_decodes_one(sched: SchedulerOutput) -> bool:
    """Every sequence of a step scheduled ahead is still running with exactly its newest token
    to compute (none finished, hit a stop or got more than one token meanwhile)."""
    return all(
        s.seq.status == SequenceStatus.RUNNING and s.seq.num_computed_tokens == s.seq.num_tokens - 1
        for s in sched.scheduled
    )
