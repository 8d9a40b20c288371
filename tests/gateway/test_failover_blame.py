"""A failover excludes the instance that failed. `Pipeline.stream` against a real nats-server
with a fake scheduler (honours ``exclude``; routes to a prefill instance while one is left, else
lets decode prefill, as the real one does) and fake prefill / decode instances: a prefill instance
declared down before decode streamed is excluded (not the decode one) and the request completes
on decode; a prefill declared down once decode streams is ignored; a dead decode is excluded.
Plus the pure rules (`owing_instance`, `down_failover`) at toy size."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from services.gateway.assembly import Failover, StreamAssembler, down_failover, owing_instance
from services.gateway.config import GatewayConfig
from services.gateway.metrics import STREAMS_BY_INSTANCE
from services.gateway.pipeline import Pipeline, Prepared
from shared import bus
from shared.protocol import subjects
from shared.protocol.codec import encode
from shared.protocol.errors import StrataError
from shared.protocol.sampling import SamplingParams
from shared.protocol.sched import RouteReply, RouteRequest, SchedulerState, routed_submit
from shared.protocol.stream import TokenChunk
from shared.protocol.work import (
    DecodeWork,
    HeldQuery,
    HeldReply,
    PrefillWork,
    SubmitAck,
    WorkItem,
)
from shared.worker.runtime import error_chunk

DISAGG = RouteReply(decode_instance="dec-a", decode_addr="h:1", prefill_instance="pre-a")
SELF = RouteReply(decode_instance="dec-a", decode_addr="h:1")


def test_owing_instance_is_prefill_until_a_chunk_then_decode():
    assert owing_instance(DISAGG, got_chunk=False) == "pre-a"
    assert owing_instance(DISAGG, got_chunk=True) == "dec-a"
    assert owing_instance(SELF, got_chunk=False) == "dec-a"


def test_down_failover_names_the_dead_instance():
    assert down_failover(DISAGG, "pre-a", decode_streamed=False).instance == "pre-a"
    assert down_failover(DISAGG, "dec-a", decode_streamed=False).instance == "dec-a"
    assert down_failover(DISAGG, "dec-a", decode_streamed=True).instance == "dec-a"
    assert down_failover(DISAGG, "pre-a", decode_streamed=True) is None  # lives on decode now
    assert down_failover(DISAGG, "dec-z", decode_streamed=False) is None  # not this route's
    assert down_failover(SELF, "", decode_streamed=False) is None


class Fleet:
    """Fake scheduler + instances. Prefill modes: "hang" (acks, never answers: a long forward
    that then dies), "handoff" (first token, then the request goes to its decode instance).
    A decode instance streams one token every ``gap`` s, and stops after ``stall_after``."""

    def __init__(self, nc) -> None:
        self.nc = nc
        self.prefills: dict[str, str] = {}
        self.decodes: dict[str, dict] = {}
        self.routes: list[tuple[RouteRequest, RouteReply]] = []
        self.submits: list[tuple[str, WorkItem]] = []  # (instance, item)
        self.subs = []
        self.dead: set[str] = set()  # decode instances a "handoff-fails" prefill cannot reach

    async def start(self) -> Fleet:
        self.subs.append(await bus.serve(self.nc, subjects.SCHED_ROUTE, RouteRequest, self.route))
        return self

    async def stop(self) -> None:
        for s in self.subs:
            await s.unsubscribe()

    async def route(self, req: RouteRequest) -> RouteReply:
        pre = next((p for p in self.prefills if p not in req.exclude), "")
        dec = next((d for d in self.decodes if d not in req.exclude), "")
        reply = RouteReply(decode_instance=dec, decode_addr="h:1", prefill_instance=pre)
        self.routes.append((req, reply))
        if dec:
            target, item = routed_submit(req.submit, reply)
            await self.nc.publish(target, encode(item), reply=subjects.req_ack(req.request_id))
        return reply

    async def add_prefill(self, inst: str, mode: str) -> None:
        self.prefills[inst] = mode

        async def submit(item: PrefillWork) -> SubmitAck:
            self.submits.append((inst, item))
            if mode == "handoff":
                asyncio.get_running_loop().create_task(self._handoff(inst, item))
            elif mode == "handoff-fails" and item.decode_instance in self.dead:
                asyncio.get_running_loop().create_task(self._handoff_fails(inst, item))
            elif mode == "handoff-fails":
                asyncio.get_running_loop().create_task(self._handoff(inst, item))
            return SubmitAck(instance_id=inst)

        subject = subjects.prefill_submit(inst)
        self.subs.append(await bus.serve(self.nc, subject, PrefillWork, submit))

    async def add_decode(
        self,
        inst: str,
        gap: float = 0.0,
        stall_after: int | None = None,
        pause: tuple[int, float] | None = None,
    ):
        """``pause``: (token index, seconds) to go silent before that token, then go on."""
        self.decodes[inst] = {"gap": gap, "stall_after": stall_after, "pause": pause}

        async def submit(item: DecodeWork) -> SubmitAck:
            self.submits.append((inst, item))
            asyncio.get_running_loop().create_task(self._generate(inst, item))
            return SubmitAck(instance_id=inst)

        self.subs.append(await bus.serve(self.nc, subjects.decode_submit(inst), DecodeWork, submit))

    async def add_probe(self, inst: str, stepping: bool) -> None:
        """Answer the gateway's probe as a live instance holding the request does: its engine
        steps on (each answer one step later), or is stuck (always the same count)."""
        self.probes = 0

        async def held(q: HeldQuery) -> HeldReply:
            self.probes += 1
            return HeldReply(held=True, engine_steps=self.probes if stepping else 7)

        self.subs.append(await bus.serve(self.nc, subjects.work_probe(inst), HeldQuery, held))

    async def _chunk(self, inst: str, item: WorkItem, i: int) -> None:
        last = i == item.sampling.max_tokens - 1
        await bus.publish(
            self.nc,
            subjects.req_out(item.request_id),
            TokenChunk(
                request_id=item.request_id,
                index=i,
                token_ids=[100 + i],
                text=f"t{i} ",
                finish_reason="length" if last else None,
                instance_id=inst,
                attempt=item.attempt,
            ),
        )

    async def _handoff(self, inst: str, item: WorkItem) -> None:
        i = len(item.output_token_ids)
        await self._chunk(inst, item, i)
        nxt = item.model_copy(update={"output_token_ids": [*item.output_token_ids, 100 + i]})
        self.submits.append((item.decode_instance, nxt))
        await self._generate(item.decode_instance, nxt)

    async def _handoff_fails(self, inst: str, item: WorkItem) -> None:
        """What prefill does when its decode instance died after routing: the first token,
        then an error chunk naming the unreachable decode instance (`services/prefill`)."""
        await self._chunk(inst, item, len(item.output_token_ids))
        err = StrataError("unavailable", f"decode instance {item.decode_instance} not available")
        chunk = error_chunk(item.request_id, err, item.decode_instance, item.attempt)
        await bus.publish(self.nc, subjects.req_out(item.request_id), chunk)

    async def _generate(self, inst: str, item: WorkItem) -> None:
        b = self.decodes[inst]
        for i in range(len(item.output_token_ids), item.sampling.max_tokens):
            if b["stall_after"] is not None and i >= b["stall_after"]:
                return
            if b["pause"] is not None and b["pause"][0] == i:
                await asyncio.sleep(b["pause"][1])
            await asyncio.sleep(b["gap"])
            await self._chunk(inst, item, i)


async def _run(nats_url: str, setup, during, max_tokens: int = 6, stall_timeout: float = 20.0):
    """Stream one request through a real `Pipeline`; ``during(fleet, got)`` runs alongside.
    Returns (token ids, fleet)."""
    nc = await bus.connect(nats_url, "failover-blame-test")
    fleet = await Fleet(nc).start()
    await setup(fleet)
    cfg = GatewayConfig.load(
        [],
        role="gateway",
        nats_url=nats_url,
        bus_timeout=5.0,
        first_token_timeout=20.0,
        stall_timeout=stall_timeout,
    )
    pipe = Pipeline(nc, cfg)
    await pipe.start()
    got: list[int] = []
    prep = Prepared(prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=max_tokens))
    spec = SimpleNamespace(
        priority=0, slo_class="interactive", ttft_slo_ms=0.0, tenant="default", tenant_weight=1.0
    )

    async def consume() -> None:
        async for chunk in pipe.stream("rid-1", prep, spec):
            got.extend(chunk.token_ids)

    try:
        task = asyncio.create_task(consume())
        await during(fleet, got)
        await asyncio.wait_for(task, 20)
    finally:
        await pipe.stop()
        await fleet.stop()
        await nc.drain()
    return got, fleet


async def _down(fleet: Fleet, inst: str) -> None:
    await bus.publish(fleet.nc, subjects.SCHED_STATE, SchedulerState(down=[inst]))


async def _until(cond, what: str) -> None:
    for _ in range(500):
        if cond():
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"timed out waiting for {what}")


async def test_prefill_declared_down_mid_forward_is_excluded_and_decode_prefills(nats_url, caplog):
    async def setup(f: Fleet) -> None:
        await f.add_prefill("pre-a", "hang")
        await f.add_decode("dec-a")

    async def during(f: Fleet, got: list[int]) -> None:
        await _until(lambda: f.submits, "the prefill submit")
        await _down(f, "pre-a")

    with caplog.at_level(logging.WARNING, logger="services.gateway.pipeline"):
        got, f = await _run(nats_url, setup, during)
    assert got == [100, 101, 102, 103, 104, 105]  # no client-visible error, nothing repeated
    assert [r.exclude for r, _ in f.routes] == [[], ["pre-a"]]  # the prefill, not dec-a
    assert f.routes[1][1].prefill_instance == "" and f.routes[1][1].decode_instance == "dec-a"
    assert [inst for inst, _ in f.submits] == ["pre-a", "dec-a"]  # re-prefilled on decode
    assert any("failover from pre-a: down" in r.getMessage() for r in caplog.records)
    assert not any("failover from dec-a" in r.getMessage() for r in caplog.records)


async def test_prefill_declared_down_after_decode_streamed_is_ignored(nats_url):
    async def setup(f: Fleet) -> None:
        await f.add_prefill("pre-a", "handoff")
        await f.add_decode("dec-a", gap=0.05)

    async def during(f: Fleet, got: list[int]) -> None:
        await _until(lambda: len(got) >= 3, "decode streaming")  # token 0 from pre-a, 1+ dec-a
        await _down(f, "pre-a")

    got, f = await _run(nats_url, setup, during, max_tokens=12)
    assert got == [100 + i for i in range(12)]
    assert len(f.routes) == 1  # the request lives on decode: no failover


async def test_decode_declared_down_is_excluded(nats_url, caplog):
    async def setup(f: Fleet) -> None:
        await f.add_prefill("pre-a", "handoff")
        await f.add_decode("dec-a", stall_after=3)
        await f.add_decode("dec-b")

    async def during(f: Fleet, got: list[int]) -> None:
        await _until(lambda: len(got) >= 3, "decode streaming")
        await _down(f, "dec-a")

    with caplog.at_level(logging.WARNING, logger="services.gateway.pipeline"):
        got, f = await _run(nats_url, setup, during)
    assert got == [100, 101, 102, 103, 104, 105]
    assert [r.exclude for r, _ in f.routes] == [[], ["dec-a"]]
    assert f.routes[1][1].decode_instance == "dec-b"
    assert any("failover from dec-a: down" in r.getMessage() for r in caplog.records)


def _by_instance(base: dict[str, float] | None = None) -> dict[str, float]:
    """``strata_gateway_streams_by_instance`` as a scrape reads it, less ``base`` (what other
    tests' pipelines in this process still hold)."""
    base = base or {}
    now = {s.labels["instance"]: s.value for f in STREAMS_BY_INSTANCE.collect() for s in f.samples}
    return {k: v - base.get(k, 0) for k, v in now.items() if v != base.get(k, 0)}


async def test_streams_by_instance_follow_the_route_and_its_failover(nats_url):
    seen: list[dict[str, float]] = []
    base = _by_instance()

    async def setup(f: Fleet) -> None:
        await f.add_prefill("pre-a", "handoff")
        await f.add_decode("dec-a", stall_after=3)
        # silent for a second before its last token: the stream is surely live when counted
        await f.add_decode("dec-b", gap=0.05, pause=(5, 1.0))

    async def during(f: Fleet, got: list[int]) -> None:
        await _until(lambda: len(got) >= 3, "decode streaming")
        seen.append(_by_instance(base))
        await _down(f, "dec-a")
        await _until(lambda: len(f.routes) == 2 and len(got) >= 4, "dec-b streaming")
        seen.append(_by_instance(base))

    got, f = await _run(nats_url, setup, during)
    assert got == [100, 101, 102, 103, 104, 105]
    assert seen == [{"dec-a": 1, "pre-a": 1}, {"dec-b": 1, "pre-a": 1}]  # the failed one left
    assert _by_instance(base) == {}  # the stream ended: it counts nowhere


async def test_a_handoff_to_a_dead_decode_fails_over_excluding_it(nats_url, caplog):
    """Prefill's hand-off to the routed decode instance fails (it died after routing): the
    error chunk names that instance, and the gateway re-routes with it excluded instead of
    ending the stream with the error (before: a 503 to the client)."""

    async def setup(f: Fleet) -> None:
        await f.add_prefill("pre-a", "handoff-fails")
        await f.add_decode("dec-a")
        await f.add_decode("dec-b")
        f.dead.add("dec-a")

    with caplog.at_level(logging.WARNING, logger="services.gateway.pipeline"):
        got, f = await _run(nats_url, setup, _nothing)
    assert [r.exclude for r, _ in f.routes] == [[], ["dec-a"]]
    assert f.routes[1][1].decode_instance == "dec-b"
    assert got == [100, 101, 102, 103, 104, 105]  # the first token once, no duplicate
    assert any("failover from dec-a: unavailable" in r.getMessage() for r in caplog.records)


def test_only_an_instance_error_chunk_fails_over():
    """`StreamAssembler.chunk`: ``unavailable`` / ``timeout`` naming an instance is a failover
    excluding it; an error that is the request's (``bad_request``) still ends the stream."""
    asm = StreamAssembler(max_failovers=2)
    asm.route, asm.attempt = DISAGG, 0
    down = error_chunk("r", StrataError("unavailable", "decode instance dec-a gone"), "dec-a", 0)
    fo = asm.chunk(down)
    assert isinstance(fo, Failover) and fo.instance == "dec-a" and fo.why.startswith("unavailable")
    bad = error_chunk("r", StrataError("bad_request", "prompt too long"), "dec-a", 0)
    with pytest.raises(StrataError) as exc:
        asm.chunk(bad)
    assert exc.value.code == "bad_request"


async def _nothing(f: Fleet, got: list[int]) -> None:
    return None


async def test_a_silent_decode_that_still_works_on_the_request_is_waited_for(nats_url):
    """dec-a goes silent for 4 stall timeouts (preempted, queued behind long forwards) but
    answers the probe: it holds the request and its engine steps. No failover: the stream
    completes from dec-a, and each stall is counted as waited."""
    from services.gateway import metrics as m

    async def setup(f: Fleet) -> None:
        await f.add_decode("dec-a", pause=(3, 2.0))
        await f.add_probe("dec-a", stepping=True)
        await f.add_decode("dec-b")

    waited = m.STALLS_WAITED._value.get()
    got, f = await _run(nats_url, setup, _nothing, stall_timeout=0.5)
    assert got == [100, 101, 102, 103, 104, 105]
    assert len(f.routes) == 1 and [i for i, _ in f.submits] == ["dec-a"]
    assert f.probes >= 3 and m.STALLS_WAITED._value.get() - waited >= 3


async def test_a_silent_decode_whose_engine_stopped_stepping_is_failed_over(nats_url, caplog):
    """The same silence, but dec-a's engine count stands still: the first probe is given the
    benefit of the doubt, the second is a stall, and the request moves to dec-b."""

    async def setup(f: Fleet) -> None:
        await f.add_decode("dec-a", pause=(3, 30.0))
        await f.add_probe("dec-a", stepping=False)
        await f.add_decode("dec-b")

    with caplog.at_level(logging.WARNING, logger="services.gateway.pipeline"):
        got, f = await _run(nats_url, setup, _nothing, stall_timeout=0.5)
    assert got == [100, 101, 102, 103, 104, 105]
    assert [r.exclude for r, _ in f.routes] == [[], ["dec-a"]]
    assert f.probes == 2
    assert any("failover from dec-a: stall" in r.getMessage() for r in caplog.records)
