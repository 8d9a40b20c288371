"""One request end to end, shared by REST and the NATS API: validate -> auth -> admit ->
ready? -> images -> tokenize+encode -> route/submit -> OpenAI chunks or a full response.

`GatewayService.open` does every step that can fail with a 4xx/5xx *before* a response starts;
`Run.events()` then yields OpenAI stream chunks and `Run.complete()` the whole response. Closing
a run early (client gone) cancels every unfinished choice on the bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from pydantic import ValidationError

from services.gateway import metrics as m
from services.gateway import response_cache
from services.gateway.audit import AuditLog
from services.gateway.auth import Auth
from services.gateway.config import GatewayConfig
from services.gateway.core import (
    ApiError,
    GenerateSpec,
    admit,
    build_spec,
    echo_scores_prompt,
    validation_error,
)
from services.gateway.images import load_image
from services.gateway.pipeline import Pipeline, Prepared
from services.gateway.prefilter import PatternFileError, Prefilter
from services.gateway.readiness import Readiness
from services.gateway.reasoning import PARSERS, ThinkSplitter, opens_in_reasoning
from services.gateway.responses import ChoiceState, Formatter, usage
from services.gateway.schemas import DetokenizeBody, TokenizeBody, dump_messages
from services.gateway.tenants import Tenants
from services.gateway.tools import ToolStream, parses_tools
from shared import bus
from shared.protocol import subjects
from shared.protocol.codec import decode
from shared.protocol.errors import StrataError
from shared.protocol.stream import Cancel, TokenChunk
from shared.protocol.tok import (
    DetokenizeReply,
    DetokenizeRequest,
    TokenizeReply,
    TokenizeRequest,
)
from shared.service import StartupError

_CANCELLED = object()  # queue item: the request was cancelled on the bus
_CLOSED = object()  # queue item: close() was called

# A caller-chosen id (REST ``x-request-id``, NATS API ``request_id``) is used in subject names
# (``strata.req.<id>.*``): a dot or a wildcard would reach other requests' subjects.
_REQUEST_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


class GatewayService:
    """Validation, auth and admission in front of a `Pipeline`."""

    def __init__(
        self,
        pipeline: Pipeline,
        cfg: GatewayConfig,
        served_model: str,
        auth: Auth,
        token_str: Callable[[int], str],
        readiness: Readiness,
        tokenizer=None,
        tool_format: str = "hermes",
        tenants: Tenants | None = None,
    ):
        self.pipeline = pipeline
        self.cfg = cfg
        self.served_model = served_model
        self.auth = auth
        self.token_str = token_str
        self.readiness = readiness
        self.tokenizer = tokenizer  # the checkpoint's; None without one (detokenize: the service)
        self.tool_format = tool_format
        self.audit: AuditLog | None = None  # set by the app (services.gateway.audit)
        self.response_cache = response_cache.ResponseCache.from_config(cfg)  # None: off
        self.tenants = tenants or Tenants()
        self._ids: set[str] = set()  # caller-chosen request ids of the runs open here
        try:
            self.prefilter = Prefilter.from_specs(cfg.prefilter_lists, cfg.prefilter_reload_s)
        except PatternFileError as exc:
            raise StartupError(f"STRATA_PREFILTER_LISTS: {exc}") from None

    async def open(
        self,
        kind: str,
        body: dict[str, Any],
        headers: dict[str, str],
        api_key: str | None,
        request_id: str = "",
        *,
        transport: str = "http",
        client: str = "",
    ) -> Run:
        """Validate, authenticate and admit one request; its `Run`. Every call leaves one audit
        entry (`services.gateway.audit`): here when refused, at `Run.close` otherwise."""
        arrival = time.perf_counter()
        who = {"identity": "unauthenticated", "transport": transport, "client": client}
        held = False
        try:
            if request_id:  # ids name bus subjects: one open run per id, REST or NATS alike
                if request_id in self._ids:
                    raise ApiError("bad_request", f"request id {request_id!r} is in use")
                self._ids.add(request_id)
                held = True
            run = await self._open(kind, body, headers, api_key, request_id, arrival, who)
        except BaseException as exc:
            if held:
                self._ids.discard(request_id)
            if isinstance(exc, StrataError) and self.audit is not None:
                self.audit.refused(kind, body, request_id, exc, who, arrival)
            raise
        if held:
            run.on_close = lambda: self._ids.discard(request_id)
        run.audit, run.audit_who = self.audit, who
        return run

    async def _open(
        self,
        kind: str,
        body: dict[str, Any],
        headers: dict[str, str],
        api_key: str | None,
        request_id: str,
        arrival: float,
        who: dict[str, str],
    ) -> Run:
        model = body.get("model") if isinstance(body.get("model"), str) else ""
        policy = self.auth.authenticate(api_key, model)
        if policy is not None:
            who["identity"] = policy.name
        else:
            who["identity"] = "anonymous"  # API keys are off
        if self.prefilter is not None:  # before tokenization: a refused prompt costs no GPU work
            body = self.prefilter.body(body)
        spec = build_spec(kind, body, self.cfg, self.served_model, headers, self.tool_format)
        admit(spec, self.pipeline.degrade_level, self.pipeline.degrade_rules)
        cache_wanted = response_cache.wanted(spec.request, headers)  # a bad header: 400 here
        tenant, weight = self.tenants.of(policy, who.get("client", ""))
        spec = dataclasses.replace(spec, tenant=tenant, tenant_weight=weight)
        if self.cfg.cache_isolation == "tenant":  # the tenant roots every hash chain it has
            salt = f"tenant\x1f{tenant}\x1f{spec.cache_salt}"
            spec = dataclasses.replace(spec, cache_salt=salt)
        if request_id and not _REQUEST_ID.fullmatch(request_id):
            raise StrataError(
                "bad_request",
                "request id must be 1-128 characters from "
                "[A-Za-z0-9_-] (it becomes part of NATS subjects)",
            )
        await self.readiness.require()  # 503 naming what is missing while the cluster starts
        rid = request_id or uuid.uuid4().hex
        images = await asyncio.gather(*(load_image(u, self.cfg) for u in spec.image_urls))
        prepared = await asyncio.gather(
            *(self.pipeline.prepare(spec, p, list(images), rid) for p in spec.prompts)
        )
        self.auth.charge(
            policy, sum(len(p.prompt_token_ids) + p.sampling.max_tokens for p in prepared)
        )
        fmt = Formatter(kind, rid, self.served_model, self.token_str, spec.logprobs)
        if kind == "chat" and parses_tools(spec.request):
            fmt.tool_format = spec.tool_format
        fmt.token_ids = spec.request.return_token_ids
        if echo_scores_prompt(spec):  # the echoed prompt's tokens get logprobs too
            fmt.echo_prompt_ids = [
                prepared[i // spec.n].prompt_token_ids for i in range(len(prepared) * spec.n)
            ]
            fmt.prompt_logprobs_field = spec.request.prompt_logprobs is not None
        if kind == "chat" and PARSERS.get(self.cfg.reasoning_parser):
            fmt.reasoning = [
                opens_in_reasoning(prepared[i // spec.n].prompt_text)
                for i in range(len(prepared) * spec.n)
            ]
        run = Run(self.pipeline, spec, rid, prepared, fmt, arrival)
        if cache_wanted:  # lazy: response_cache_run subclasses Run
            from services.gateway.response_cache_run import cached_run

            run = await cached_run(self.response_cache, run)
        m.TENANT_REQUESTS.labels(tenant).inc()
        if self.prefilter is not None:
            run.masks = [self.prefilter.output() for _ in run.choices]
        run.start()  # no await after this: the caller owns the run (and closes it)
        return run

    def close_audit(self) -> None:
        """Stop the audit publisher and close the audit file (shutdown)."""
        if self.audit is not None:
            self.audit.close()

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model:
            raise ApiError(
                "not_found",
                f"model '{model}' does not exist; this gateway serves '{self.served_model}'",
                param="model",
            )

    async def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """vLLM's ``/tokenize``: ``{count, max_model_len, tokens, token_strs}`` from the
        tokenizer service (the chat template renders ``messages`` and ``tools``)."""
        try:
            req = TokenizeBody.model_validate(body)
        except ValidationError as exc:
            raise validation_error(exc) from None
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError("bad_request", "give exactly one of 'prompt' or 'messages'")
        chat = req.messages is not None
        if chat and req.continue_final_message and req.add_generation_prompt:
            raise ApiError(
                "bad_request",
                "cannot set both continue_final_message and add_generation_prompt to true",
                param="continue_final_message",
            )
        special = req.add_special_tokens if req.add_special_tokens is not None else not chat
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        msgs = dump_messages(req) if chat else None  # type: ignore[arg-type]
        tok_req = TokenizeRequest(
            request_id=uuid.uuid4().hex,
            prompt=req.prompt,
            messages=msgs,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template_kwargs=req.chat_template_kwargs,
            add_special_tokens=special,
            tools=tools,
        )
        reply = await bus.request(
            self.pipeline.nc, subjects.TOK_ENCODE, tok_req, TokenizeReply, self.cfg.bus_timeout
        )
        strs = [self.token_str(t) for t in reply.token_ids] if req.return_token_strs else None
        return {
            "count": len(reply.token_ids),
            "max_model_len": reply.max_model_len,
            "tokens": reply.token_ids,
            "token_strs": strs,
        }

    async def detokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """vLLM's ``/detokenize``: ``{prompt}`` for ``tokens``, from the tokenizer service."""
        try:
            req = DetokenizeBody.model_validate(body)
        except ValidationError as exc:
            raise validation_error(exc) from None
        self._check_model(req.model)
        try:
            reply = await bus.request(
                self.pipeline.nc,
                subjects.TOK_DECODE,
                DetokenizeRequest(request_id=uuid.uuid4().hex, token_ids=req.tokens),
                DetokenizeReply,
                self.cfg.bus_timeout,
            )
        except StrataError as exc:
            if exc.code == "bad_request":
                raise ApiError("bad_request", exc.message, param="tokens") from None
            raise
        return {"prompt": reply.text}


def _without_outputs(c: TokenChunk) -> TokenChunk:
    """``c`` less its generated text, ids and logprobs (its prompt logprobs kept), counted as
    no completion token and ended by length (`GenerateSpec.echo_only`)."""
    update: dict[str, Any] = {"text": "", "token_ids": [], "logprobs": None}
    if c.finish_reason is not None:
        update["finish_reason"] = "length"
    if c.usage is not None:
        update["usage"] = c.usage.model_copy(update={"completion_tokens": 0})
    return c.model_copy(update=update)


class Run:
    """An admitted request: ``len(prompts) * n`` choices streaming on the bus.

    `start` (called by `GatewayService.open`) sets every choice's stream going at once, so the
    route and submit round trips overlap the response start; `events` / `complete` consume what
    the streams produced. `close` is synchronous and idempotent: it cancels every open stream
    (each publishes its bus cancel) and ends the consumer; whoever opened the run calls it when
    the response is over, however it ended.
    """

    def __init__(
        self,
        pipeline: Pipeline,
        spec: GenerateSpec,
        rid: str,
        prepared: list[Prepared],
        fmt: Formatter,
        arrival: float,
    ):
        self.pipeline = pipeline
        self.spec = spec
        self.request_id = rid
        self.prepared = prepared
        self.fmt = fmt
        self.arrival = arrival
        n = spec.n
        self.choices = [
            ChoiceState(i, len(prepared[i // n].prompt_token_ids)) for i in range(len(prepared) * n)
        ]
        self.first_token_at: float | None = None
        self._last: float | None = None
        self.closed = False  # close() was called: the consumer stops, no more events
        self._q: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._open = 0  # choices whose stream has not ended yet
        self._done = False  # no more chunks will come (see _take)
        self._began = False  # next_events returned its first batch
        self._ended = False  # next_events returned its last batch
        self._offsets = [0] * len(self.choices)  # text offset per choice (logprobs)
        self.masks: list | None = None  # per choice, the pre-filter's output mask
        self.audit: AuditLog | None = None  # set by GatewayService.open
        self.audit_who: dict[str, str] = {}
        self.error: StrataError | None = None  # what a stream ended with (the audit's outcome)
        self.on_close: Callable[[], None] | None = None  # GatewayService frees the id
        tf = fmt.tool_format  # tool calls parsed out of each choice's stream
        self._tools = [ToolStream(tf) for _ in self.choices] if tf else None
        # reasoning split off each choice's stream before its tool calls are looked for
        self._think = [ThinkSplitter(f) for f in fmt.reasoning] if fmt.reasoning else None

    def _sub_id(self, i: int) -> str:
        return self.request_id if len(self.choices) == 1 else f"{self.request_id}-{i}"

    def start(self) -> None:
        """Start every choice's stream (route, submit, chunks) in its own task; idempotent."""
        if self._tasks or self.closed:
            return
        self.pipeline.watch_cancel(self.request_id, self._on_cancel)
        m.QUEUE.observe(time.perf_counter() - self.arrival)
        m.WAITING.inc()
        self._tasks = [asyncio.create_task(self._pump(i)) for i in range(len(self.choices))]
        self._open = len(self._tasks)

    def _source(self, i: int) -> AsyncIterator[TokenChunk]:
        """Choice ``i``'s chunks: from the bus (a response cache hit replays stored ones)."""
        return self.pipeline.stream(self._sub_id(i), self.prepared[i // self.spec.n], self.spec)

    async def _pump(self, i: int) -> None:
        q = self._q
        try:
            async for c in self._source(i):
                q.put_nowait((i, c))
            q.put_nowait((i, None))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            q.put_nowait((i, exc))

    def _on_cancel(self, data: bytes) -> None:
        with contextlib.suppress(Exception):
            if decode(data, Cancel).reason.startswith("failover"):
                return  # our own failover notice to a dead instance, not a user cancel
        self._q.put_nowait((-1, _CANCELLED))

    def close(self) -> None:
        """End the run now (see the class doc); a no-op the second time."""
        if self.closed:
            return
        self.closed = True
        self.pipeline.unwatch_cancel(self.request_id)
        for t in self._tasks:
            t.cancel()  # no await: each stream publishes its bus cancel on its own
        self._q.put_nowait((-1, _CLOSED))
        if self._tasks:
            (m.WAITING if self.first_token_at is None else m.RUNNING).dec()
        self._record()
        if self.on_close is not None:
            self.on_close()
        if self.audit is not None:
            self.audit.finished(self, self.audit_who)

    async def _take(self, timeout: float | None = None) -> list[tuple[int, TokenChunk]] | None:
        """Every chunk that is ready now, waiting for the first up to ``timeout`` (None: no
        limit; ``[]`` when it passed); None once every choice ended, the run was cancelled on
        the bus or closed. A stream's error is raised (and the run closed)."""
        self.start()
        if self._done:
            return None
        try:
            if timeout is None:
                item = await self._q.get()
            else:
                item = await asyncio.wait_for(self._q.get(), timeout)
        except TimeoutError:
            return []
        out: list[tuple[int, TokenChunk]] = []
        while True:
            self._add(*item, out)
            if self._done or self._q.empty():
                break
            item = self._q.get_nowait()
        if self._done:
            self.close()
        return out if out or not self._done else None

    def _add(self, i: int, item: Any, out: list[tuple[int, TokenChunk]]) -> None:
        if item is _CLOSED:
            self._done = True
        elif item is _CANCELLED:  # cancelled on the bus: end every open choice cleanly
            self._done = True
            for c in self.choices:
                if c.finish_reason is None:
                    abort = TokenChunk(
                        request_id=self._sub_id(c.index),
                        index=len(c.token_ids),
                        finish_reason="abort",
                    )
                    c.add(abort)
                    out.append((c.index, abort))
        elif item is None:
            self._open -= 1
            self._done = self._open == 0
        elif isinstance(item, BaseException):
            if isinstance(item, StrataError):
                self.error = item
            self.close()
            raise item
        else:
            now = time.perf_counter()
            if self.first_token_at is None:
                self.first_token_at = now
                m.TTFT.observe(now - self.arrival)
                m.WAITING.dec()
                m.RUNNING.inc()
            elif self._last is not None and item.token_ids:
                m.ITL.observe(now - self._last)
            self._last = now
            if self.masks is not None:
                final = item.finish_reason is not None
                item = item.model_copy(update={"text": self.masks[i].feed(item.text, final)})
            if self.spec.echo_only:  # the prompt alone: the engine's one token is dropped
                item = _without_outputs(item)
            self.choices[i].add(item)
            out.append((i, item))

    def _record(self) -> None:
        done = [c for c in self.choices if c.finish_reason is not None]
        if len(done) != len(self.choices):
            return
        end = time.perf_counter()
        m.E2E.observe(end - self.arrival)
        gen = sum(len(c.token_ids) for c in done)
        if self.first_token_at is not None and gen > 1:
            m.TPOT.observe((end - self.first_token_at) / max(1, gen - 1))
        m.GENERATION_TOKENS.inc(gen)
        m.PROMPT_TOKENS.inc(sum(len(p.prompt_token_ids) for p in self.prepared))
        m.CACHED_TOKENS.inc(max(c.cached_tokens for c in done))
        for c in done:
            m.REQUESTS.labels(c.finish_reason).inc()

    @property
    def ended(self) -> bool:
        """`next_events` returned the last batch."""
        return self._ended

    def _finished(self) -> bool:
        """Every choice ended (not cut short by `close`)."""
        return all(c.finish_reason is not None for c in self.choices)

    def _prompt_lens(self) -> list[int]:
        return [len(p.prompt_token_ids) for p in self.prepared]

    async def next_events(self, timeout: float | None = None) -> list[dict[str, Any]] | None:
        """The OpenAI stream chunks ready now, in order (the chat role chunks come first, at
        once; a usage chunk with the last tokens when ``stream_options.include_usage``); waits
        for at least one up to ``timeout`` (``[]`` when it passed); None when the stream is over.
        Batches let the SSE writer send what is ready in one write."""
        if not self._began:
            self._began = True
            ids = self._choice_prompt_ids()
            echo = self._echo()
            if self.spec.kind == "chat":
                out = [self.fmt.role_chunk(i, ids[i]) for i in range(len(self.choices))]
                for i in range(len(self.choices)) if echo and echo[0] else ():
                    text = TokenChunk(request_id=self.request_id, index=0, text=echo[i])
                    out.append(self.fmt.chunk(i, text))
                return out
            if echo is not None:  # the outputs' text offsets start after the echoed prompt
                self._offsets = [len(e) for e in echo]
            if echo is not None or self.fmt.token_ids:
                return [
                    self.fmt.prompt_chunk(i, echo[i] if echo else "", ids[i])
                    for i in range(len(self.choices))
                ]
        if self._ended:
            return None
        got = await self._take(timeout)
        out = []
        opts = self.spec.request.stream_options
        continuous = self.spec.include_usage and opts is not None and opts.continuous_usage_stats
        if continuous:  # vLLM: each chunk carries the usage as of that chunk
            prompt = sum(self._prompt_lens())
            done = sum(len(c.token_ids) for c in self.choices)
            done -= sum(len(c.token_ids) for _, c in got or ())
        for i, c in got or ():
            if not c.token_ids and not c.text and c.finish_reason is None:
                continue
            width, reasoning = len(c.text), ""
            if self._think is not None:
                reasoning, content = self._think[i].feed(c.text)
                if c.finish_reason is not None:
                    r2, c2 = self._think[i].finish()
                    reasoning, content = reasoning + r2, content + c2
                c = c.model_copy(update={"text": content})
            if self._tools is not None:
                made = self._tool_chunks(i, c)
            else:
                made = [self.fmt.chunk(i, c, self._offsets[i])]
            if reasoning:  # on the chunk's first event (its content, if any, rides with it)
                if not made:
                    made = [self.fmt.chunk(i, c.model_copy(update={"text": ""}))]
                made[0]["choices"][0]["delta"]["reasoning_content"] = reasoning
            self._offsets[i] += width
            if continuous:
                done += len(c.token_ids)
                use = {"prompt_tokens": prompt, "completion_tokens": done}
                for ev in made:
                    ev["usage"] = {**use, "total_tokens": prompt + done}
            out += made
        if self._done:
            self._ended = True
            if self.spec.include_usage and self._finished():
                out.append(self.fmt.usage_chunk(usage(self.choices, self._prompt_lens())))
            return out or None
        return out

    def _tool_chunks(self, i: int, c: TokenChunk) -> list[dict[str, Any]]:
        """A chunk of a choice whose output is parsed for tool calls: its content (text outside
        calls), then each completed call as ``delta.tool_calls`` fragments (id and name, then
        the arguments), then the finish reason ("tool_calls" when the output called tools)."""
        ts = self._tools[i]
        events = ts.feed(c.text) + (ts.finish() if c.finish_reason is not None else [])
        content = "".join(e for kind, e in events if kind == "content")
        out = []
        if content or c.logprobs or c.prompt_logprobs:
            plain = c.model_copy(update={"text": content, "finish_reason": None})
            out.append(self.fmt.chunk(i, plain, self._offsets[i]))
        for kind, call in events:
            if kind == "tool":
                out += self.fmt.tool_call_chunks(i, ts.calls_sent, call)
                ts.calls_sent += 1
        if c.finish_reason is not None:
            reason = "tool_calls" if ts.calls and c.finish_reason == "stop" else c.finish_reason
            out.append(self.fmt.finish_chunk(i, reason))
        return out

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """`next_events`, one chunk at a time."""
        while (batch := await self.next_events()) is not None:
            for ev in batch:
                yield ev

    async def complete(self) -> dict[str, Any]:
        while await self._take() is not None:
            pass
        return self.fmt.final(
            self.choices, self._prompt_lens(), self._echo(), self._choice_prompt_ids()
        )

    def _choice_prompt_ids(self) -> list[list[int]]:
        return [self.prepared[i // self.spec.n].prompt_token_ids for i in range(len(self.choices))]

    def _echo(self) -> list[str] | None:
        """Per choice, the text ``echo`` prepends (None: no echo): completions, the prompt;
        chat (vLLM), the last message's content when it is the assistant's."""
        req = self.spec.request
        if not req.echo:
            return None
        if self.spec.kind == "completion":
            return [self.prepared[i // self.spec.n].prompt_text for i in range(len(self.choices))]
        last = req.messages[-1]
        if last.role != "assistant":
            return None
        content = last.content
        if isinstance(content, list):
            content = "".join(p.text or "" for p in content if p.type != "image_url")
        return [content or ""] * len(self.choices)
