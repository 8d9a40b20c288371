"""The gateway's bus side: tokenize + encode concurrently, route, submit, stream with failover.

`Pipeline.prepare` turns one validated prompt into a `Prepared` (token ids, image refs, block
hashes, sampling); `Pipeline.stream` routes it, submits the `WorkItem` and yields the request's
`TokenChunk`s in index order with duplicates dropped (the pure `StreamAssembler`, assembly.py).
When an instance serving the request is declared down (`SchedulerState.down`), refuses the
submit or its stream stalls, the request is re-routed with that instance excluded (`Failover`:
a dead prefill instance is excluded, not the decode one, so the scheduler picks another prefill
or lets decode prefill) and resubmitted with the tokens already sent, so the caller sees one
uninterrupted stream. Closing the stream before it finished publishes `strata.req.<id>.cancel`.

Chunks arrive two ways: decode batches one engine step's chunks of every request this gateway
owns into one `TokenChunkBatch` on ``strata.gw.<instance_id>.out`` (the `WorkItem` names this
gateway: ``gateway_id``), which `Pipeline` demultiplexes into the requests' queues; prefill's
first token, errors of prefill and old instances use the request's ``strata.req.<id>.out``.
Both feed the same `StreamAssembler`, so dedup by index and failover do not care which.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError

from services.gateway import metrics as m
from services.gateway.assembly import Failover, StreamAssembler
from services.gateway.config import GatewayConfig
from services.gateway.constraints import constraint_error
from services.gateway.core import GenerateSpec, block_hashes, sampling_for
from services.gateway.reasoning import PARSERS, opens_in_reasoning
from services.gateway.schedulers import SchedulerReplicas
from shared import bus
from shared.protocol import subjects
from shared.protocol.codec import decode
from shared.protocol.errors import StrataError
from shared.protocol.sampling import SamplingParams
from shared.protocol.sched import DegradeRules, RouteReply, RouteRequest, SchedulerState
from shared.protocol.stream import Cancel, TokenChunk, TokenChunkBatch
from shared.protocol.tok import TokenizeReply, TokenizeRequest
from shared.protocol.vision import VisionEncodeReply, VisionEncodeRequest
from shared.protocol.work import HeldQuery, HeldReply, ImageRef, SubmitAck, WorkItem

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Down:
    """Queue item: the scheduler declared ``instance_id`` (watched by this request) down."""

    instance_id: str


@dataclass(frozen=True)
class _Lost:
    """Queue item: this gateway's NATS connection dropped (chunks sent meanwhile are lost)."""


_SUBJECT_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,128}")

NATS_LOST = "gateway lost its NATS connection mid-stream (the stream cannot continue; retry)"


@dataclass
class Prepared:
    """One prompt ready to route: what the WorkItem and RouteRequest need."""

    prompt_token_ids: list[int]
    sampling: SamplingParams
    images: list[ImageRef] = field(default_factory=list)
    block_hashes: list[str] = field(default_factory=list)
    prompt_text: str = ""  # the (rendered, truncated) prompt as text: completions' echo
    fingerprint: str = ""  # the tokenizer's model fingerprint (response cache key)
    kv_dtype: str = ""


class Pipeline:
    """Bus client of one gateway; also tracks the scheduler's degradation level and down set."""

    def __init__(self, nc: NATS, cfg: GatewayConfig):
        self.nc = nc
        self.cfg = cfg
        self.reasoning = bool(PARSERS.get(cfg.reasoning_parser))  # chat answers may think first
        self.degrade_level = 0
        self.degrade_rules = DegradeRules()  # replaced by the scheduler's with its first state
        self.down: set[str] = set()
        self.schedulers = SchedulerReplicas()  # whose state came lately: where routes go
        self._watchers: dict[str, set[asyncio.Queue]] = {}
        self._cancel_cbs: dict[str, Callable[[bytes], None]] = {}
        self._open: set[asyncio.Queue] = set()  # every stream's queue, for `nats_lost`
        self._streams: dict[str, asyncio.Queue] = {}  # request id -> queue (batched chunks)
        # Decode batches chunks to ``strata.gw.<gateway_id>.out``; an id that cannot be one
        # subject token leaves every request on its own ``strata.req.<id>.out``.
        iid = cfg.instance_id
        self.gateway_id = iid if _SUBJECT_TOKEN.fullmatch(iid) else ""
        if iid and not self.gateway_id:
            log.warning("instance id %r is not a subject token: chunks come unbatched", iid)
        self._sub = None
        self._cancel_sub = None
        self._out_sub = None
        m.STREAMS_BY_INSTANCE.pipelines.add(self)

    def streams_by_instance(self) -> dict[str, int]:
        """Streams not ended per instance they were routed to (``/metrics`` reads it from the
        metrics thread: a copy of the dict, each set's size)."""
        return {inst: len(qs) for inst, qs in list(self._watchers.items())}

    async def start(self) -> None:
        async def on_state(msg) -> None:
            try:
                st = decode(msg.data, SchedulerState)
            except (StrataError, ValueError):  # garbage on the subject (pydantic: a ValueError)
                return
            self.schedulers.heard(st.scheduler_id, time.monotonic())
            self.degrade_level = st.degrade_level
            self.degrade_rules = st.rules
            self.down = set(st.down)
            for inst in st.down:
                for q in self._watchers.get(inst, ()):
                    q.put_nowait(_Down(inst))

        async def on_cancel(msg) -> None:
            cb = self._cancel_cbs.get(msg.subject.split(".")[2])  # strata.req.<id>.cancel
            if cb is not None:
                cb(msg.data)

        async def on_batch(msg) -> None:
            try:
                batch = decode(msg.data, TokenChunkBatch)
            except (StrataError, ValueError):  # a peer bug: its streams stall and fail over
                log.warning("dropping a malformed chunk batch on %s", msg.subject)
                return
            for chunk in batch.chunks:
                q = self._streams.get(chunk.request_id)
                if q is not None:  # else: a stream that ended (stragglers are dropped anyway)
                    q.put_nowait(chunk)

        self._sub = await self.nc.subscribe(subjects.SCHED_STATE, cb=on_state)
        if self.gateway_id:
            self._out_sub = await self.nc.subscribe(subjects.gw_out(self.gateway_id), cb=on_batch)
        # One subscription for every request's cancel subject (cancels are rare; a per-request
        # SUB/UNSUB pair would sit on every request's path).
        self._cancel_sub = await self.nc.subscribe(subjects.REQ_CANCEL_ALL, cb=on_cancel)

    async def stop(self) -> None:
        for sub in (self._sub, self._cancel_sub, self._out_sub):
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    def nats_lost(self) -> None:
        """The NATS connection dropped: every open stream ends with an ``unavailable`` error
        (chunks published while it was down are gone, so waiting would only end in a stall)."""
        for q in self._open:
            q.put_nowait(_Lost())

    def watch_cancel(self, rid: str, cb: Callable[[bytes], None]) -> None:
        """Call ``cb(payload)`` when something publishes ``strata.req.<rid>.cancel``."""
        self._cancel_cbs[rid] = cb

    def unwatch_cancel(self, rid: str) -> None:
        self._cancel_cbs.pop(rid, None)

    async def prepare(
        self, spec: GenerateSpec, prompt: object, images: list[bytes], rid: str
    ) -> Prepared:
        """Tokenize and vision-encode at the same time, then build sampling and block hashes."""
        r = spec.request
        common = dict(
            request_id=rid,
            truncate_prompt_tokens=r.truncate_prompt_tokens,
            bad_words=list(r.bad_words or []),
            constraint=spec.constraint,  # compiled (validated) by the tokenizer, not here
            constraint_param=spec.constraint_param,
        )
        if r.add_special_tokens is not None:
            common["add_special_tokens"] = r.add_special_tokens
        if spec.kind == "chat":
            from services.gateway.schemas import dump_messages, dump_tools

            tok_req = TokenizeRequest(
                messages=dump_messages(r),
                add_generation_prompt=r.add_generation_prompt,
                continue_final_message=r.continue_final_message,
                chat_template_kwargs=r.chat_template_kwargs,
                tools=dump_tools(r),
                **common,
            )
        elif isinstance(prompt, list):
            tok_req = TokenizeRequest(prompt_token_ids=prompt, **common)
        else:
            tok_req = TokenizeRequest(prompt=str(prompt), **common)

        async def timed(coro):
            t0 = time.perf_counter()
            out = await coro
            return out, (t0, time.perf_counter())

        timeout = self.cfg.bus_timeout
        calls = [timed(bus.request(self.nc, subjects.TOK_ENCODE, tok_req, TokenizeReply, timeout))]
        if images:
            vreq = VisionEncodeRequest(request_id=rid, images=images)
            calls.append(
                timed(
                    bus.request(self.nc, subjects.VISION_ENCODE, vreq, VisionEncodeReply, timeout)
                )
            )
        try:
            results = await asyncio.gather(*calls)
        except StrataError as exc:
            raise constraint_error(exc, spec.constraint_param) from None
        tok, tok_win = results[0]
        m.TOKENIZE.observe(tok_win[1] - tok_win[0])
        refs: list[ImageRef] = []
        vis_win = None
        if images:
            vis, vis_win = results[1]
            m.VISION.observe(vis_win[1] - vis_win[0])
            m.EPD_OVERLAP.observe(
                max(0.0, min(tok_win[1], vis_win[1]) - max(tok_win[0], vis_win[0]))
            )
            if len(vis.images) != len(tok.image_spans):
                raise StrataError(
                    "bad_request",
                    f"{len(tok.image_spans)} image placeholders but {len(vis.images)} images",
                )
            refs = [
                ImageRef(offset=s.offset, length=s.length, hash=i.hash, source_addr=vis.source_addr)
                for s, i in zip(tok.image_spans, vis.images, strict=True)
            ]
        sampling = sampling_for(
            spec,
            len(tok.token_ids),
            tok.max_model_len,
            self.cfg,
            self.degrade_level,
            self.degrade_rules,
            tok.bad_words_ids,
            tok.vocab_size,
        )
        if sampling.structured is not None and spec.kind == "chat" and self.reasoning:
            # the grammar holds after the reasoning (a block the template opened, or one the
            # answer may start with), as vLLM applies it with a reasoning parser on
            think = "open" if opens_in_reasoning(tok.text) else "optional"
            structured = sampling.structured.model_copy(update={"think": think})
            sampling = sampling.model_copy(update={"structured": structured})
        hashes = block_hashes(
            tok.token_ids,
            [(r.offset, r.length, r.hash) for r in refs],
            tok.model_fingerprint,
            tok.kv_dtype or "float32",
            tok.block_size,
            sampling.cache_salt,
        )
        return Prepared(
            tok.token_ids, sampling, refs, hashes, tok.text, tok.model_fingerprint, tok.kv_dtype
        )

    async def cancel(
        self, rid: str, reason: str = "client disconnected", attempt: int | None = None
    ) -> None:
        """Stop ``rid`` on every instance; with ``attempt``, only that route's work."""
        with contextlib.suppress(Exception):
            await bus.publish(
                self.nc,
                subjects.req_cancel(rid),
                Cancel(request_id=rid, reason=reason, attempt=attempt),
            )
            m.CANCELS.inc()

    async def stream(self, rid: str, p: Prepared, spec: GenerateSpec) -> AsyncIterator[TokenChunk]:
        """Index-ordered chunks of one request, surviving decode failures (see module doc)."""
        q: asyncio.Queue = asyncio.Queue()

        async def on_msg(msg) -> None:
            q.put_nowait(msg)

        # One subscription for the request's chunks (.out) and its submit ack (.ack); taken
        # before the route request goes out, in the same write to the server.
        sub = await self.nc.subscribe(subjects.req_any(rid), cb=on_msg)
        self._open.add(q)
        self._streams[rid] = q
        asm = StreamAssembler(self.cfg.max_failovers)
        finished = False  # the consumer took the last chunk
        watched: list[str] = []
        try:
            while True:
                route = await self._route(rid, p, spec, asm.exclude, asm.sent, asm.attempt + 1)
                asm.begin(route)
                watched = [i for i in (route.decode_instance, route.prefill_instance) if i]
                for inst in watched:
                    self._watchers.setdefault(inst, set()).add(q)
                fo = None
                async for chunk in self._drain(rid, q, asm):
                    if isinstance(chunk, Failover):
                        fo = chunk
                        break
                    yield chunk
                    if asm.finished:
                        finished = True
                        return
                self._unwatch(q, watched)
                assert fo is not None  # _drain ends with a finished chunk or a Failover
                asm.fail(fo, rid)
                log.warning("rid=%s failover from %s: %s", rid, fo.instance, fo.why)
                m.FAILOVERS.labels(fo.why.split(":")[0]).inc()
                # Only this route's work stops: the next one may use the same instance.
                await self.cancel(rid, f"failover from {fo.instance}: {fo.why}", asm.attempt)
        finally:
            self._open.discard(q)
            if self._streams.get(rid) is q:
                del self._streams[rid]
            self._unwatch(q, watched)
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            if not finished:
                await self.cancel(rid)

    def _unwatch(self, q: asyncio.Queue, insts: list[str]) -> None:
        for inst in insts:
            self._watchers.get(inst, set()).discard(q)
            if not self._watchers.get(inst):
                self._watchers.pop(inst, None)

    async def _route(
        self,
        rid: str,
        p: Prepared,
        spec: GenerateSpec,
        exclude: list[str],
        sent: list[int],
        attempt: int,
    ) -> RouteReply:
        """Route and submit in one hop: the scheduler forwards the `WorkItem` to the instance it
        chose, which acks on ``strata.req.<rid>.ack`` (read by `_drain`)."""
        item = WorkItem(
            request_id=rid,
            prompt_token_ids=p.prompt_token_ids,
            sampling=p.sampling,
            priority=spec.priority,
            images=p.images,
            output_token_ids=list(sent),
            attempt=attempt,
            tenant=spec.tenant,
            tenant_weight=spec.tenant_weight,
            gateway_id=self.gateway_id,
        )
        req = RouteRequest(
            request_id=rid,
            num_prompt_tokens=len(p.prompt_token_ids),
            block_hashes=p.block_hashes,
            priority=spec.priority,
            slo_class=spec.slo_class,
            max_tokens=p.sampling.max_tokens,
            exclude=list(exclude),
            ttft_slo_ms=spec.ttft_slo_ms,
            submit=item,
        )
        # To a replica whose state came lately (`SchedulerReplicas`; the queue group before any
        # did). One that dies mid-request leaves the request unanswered, so a timed-out route
        # is asked once more, of another replica.
        tried: list[str] = []
        for attempt in (0, 1):
            sid = self.schedulers.pick(time.monotonic(), tried)
            tried.append(sid)
            subject = subjects.sched_route(sid) if sid else subjects.SCHED_ROUTE
            try:
                route = await bus.request(
                    self.nc, subject, req, RouteReply, self.cfg.bus_timeout / 2
                )
                break
            except StrataError as exc:
                # no responders on a replica's own subject: it stopped; ask another
                gone = sid and isinstance(exc.__cause__, NoRespondersError)
                if exc.code != "timeout" and not gone:
                    raise
                if attempt == 1:
                    raise StrataError(
                        "unavailable", f"scheduler did not answer: {exc.message}"
                    ) from None
        if not route.decode_instance:
            raise StrataError("unavailable", "no decode instance is available")
        return route

    async def _still_worked_on(self, rid: str, asm: StreamAssembler) -> bool:
        """Whether a route that sent nothing for a while is still worked on: one of its
        instances holds the request (queued, preempted, prefilling, handing off, decoding) and
        its engine stepped since the last time we asked (the first answer only needs the
        request held). No answer, not held, or an engine that stopped stepping: stalled."""
        route = asm.route
        for inst in dict.fromkeys(i for i in (route.decode_instance, route.prefill_instance) if i):
            try:
                rep = await bus.request(
                    self.nc,
                    subjects.work_probe(inst),
                    HeldQuery(request_id=rid, attempt=asm.attempt),
                    HeldReply,
                    min(2.0, self.cfg.bus_timeout),
                )
            except StrataError:
                continue
            if rep.held and asm.engine_progressed(inst, rep.engine_steps):
                return True
        return False

    def _ack_problem(self, msg, route: RouteReply) -> str | None:
        """A failover reason when the forwarded submit was not taken; None when it was."""
        target = route.prefill_instance or route.decode_instance
        if msg.headers and msg.headers.get("Status") == "503":  # the server: no responders
            return f"submit: no service is listening on {target}'s submit subject"
        try:
            ack = decode(msg.data, SubmitAck)
        except StrataError as exc:
            if exc.code in ("unavailable", "timeout"):
                return f"submit: {exc.message}"
            raise
        if not ack.accepted:
            return f"submit: {ack.instance_id or target} refused the request"
        return None

    async def _drain(
        self, rid: str, q: asyncio.Queue, asm: StreamAssembler
    ) -> AsyncIterator[TokenChunk | Failover]:
        """Decode the queue's messages and feed them to ``asm``; yields the client-visible
        chunks in order, and a `Failover` that ends the route."""
        ack_subject = subjects.req_ack(rid)
        cfg = self.cfg
        while True:
            timeout = asm.wait_limit(cfg.bus_timeout, cfg.first_token_timeout, cfg.stall_timeout)
            try:
                msg = await asyncio.wait_for(q.get(), timeout)
            except TimeoutError:
                if not asm.awaiting_ack and await self._still_worked_on(rid, asm):
                    m.STALLS_WAITED.inc()
                    continue  # queued, preempted or behind long forwards: not stalled
                yield asm.timed_out(timeout)
                return
            if isinstance(msg, _Lost):
                raise StrataError("unavailable", NATS_LOST)
            if isinstance(msg, _Down):
                fo = asm.down(msg.instance_id)
                if fo is None:
                    continue
                yield fo
                return
            if isinstance(msg, TokenChunk):  # demultiplexed from a batch (`start`)
                out = asm.chunk(msg)
                if out is None:
                    continue
                yield out
                if isinstance(out, Failover) or asm.finished:
                    return
                continue
            if msg.subject == ack_subject:
                if asm.acked:
                    continue
                why = self._ack_problem(msg, asm.route)
                if why is not None:
                    yield Failover(asm.target, why)
                    return
                with contextlib.suppress(Exception):
                    asm.ack(decode(msg.data, SubmitAck).instance_id)
                continue
            if not msg.subject.endswith(".out"):
                continue  # .cancel: handled by the run
            try:
                chunk = decode(msg.data, TokenChunk)
            except Exception:  # noqa: BLE001 - a malformed chunk is a peer bug; skip it
                asm.acked = True  # a chunk implies the submit was taken
                log.warning("dropping malformed chunk", exc_info=True)
                continue
            out = asm.chunk(chunk)
            if out is None:
                continue
            yield out
            if isinstance(out, Failover) or asm.finished:
                return
