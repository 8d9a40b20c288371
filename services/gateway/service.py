"""One request end to end, shared by REST and the NATS API: validate -> auth -> admit ->
images -> tokenize+encode -> route/submit -> OpenAI chunks or a full response.

`GatewayService.open` does every step that can fail with a 4xx/5xx *before* a response starts;
`Run.events()` then yields OpenAI stream chunks and `Run.complete()` the whole response. Closing
a run early (client gone) cancels every unfinished choice on the bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from services.gateway import metrics as m
from services.gateway.auth import Auth
from services.gateway.config import GatewayConfig
from services.gateway.core import GenerateSpec, admit, build_spec
from services.gateway.images import load_image
from services.gateway.pipeline import Pipeline, Prepared
from services.gateway.responses import ChoiceState, Formatter, usage
from shared.protocol import subjects
from shared.protocol.codec import decode
from shared.protocol.stream import Cancel, TokenChunk

_CANCELLED = object()


class GatewayService:
    """Validation, auth and admission in front of a `Pipeline`."""

    def __init__(self, pipeline: Pipeline, cfg: GatewayConfig, served_model: str,
                 auth: Auth, token_str: Callable[[int], str]):  # fmt: skip
        self.pipeline = pipeline
        self.cfg = cfg
        self.served_model = served_model
        self.auth = auth
        self.token_str = token_str

    async def open(self, kind: str, body: dict[str, Any], headers: dict[str, str],
                   api_key: str | None, request_id: str = "") -> Run:  # fmt: skip
        arrival = time.perf_counter()
        model = body.get("model") if isinstance(body.get("model"), str) else ""
        policy = self.auth.authenticate(api_key, model)
        spec = build_spec(kind, body, self.cfg, self.served_model, headers)
        admit(spec, self.pipeline.degrade_level, self.cfg)
        rid = request_id or uuid.uuid4().hex
        images = await asyncio.gather(*(load_image(u, self.cfg) for u in spec.image_urls))
        prepared = await asyncio.gather(*(self.pipeline.prepare(spec, p, list(images), rid)
                                          for p in spec.prompts))  # fmt: skip
        self.auth.charge(policy, sum(len(p.prompt_token_ids) + p.sampling.max_tokens
                                     for p in prepared))  # fmt: skip
        fmt = Formatter(kind, rid, self.served_model, self.token_str, spec.logprobs)
        return Run(self.pipeline, spec, rid, prepared, fmt, arrival)


class Run:
    """An admitted request: ``len(prompts) * n`` choices streaming on the bus."""

    def __init__(self, pipeline: Pipeline, spec: GenerateSpec, rid: str,
                 prepared: list[Prepared], fmt: Formatter, arrival: float):  # fmt: skip
        self.pipeline = pipeline
        self.spec = spec
        self.request_id = rid
        self.prepared = prepared
        self.fmt = fmt
        self.arrival = arrival
        n = spec.n
        self.choices = [ChoiceState(i, len(prepared[i // n].prompt_token_ids))
                        for i in range(len(prepared) * n)]  # fmt: skip
        self.first_token_at: float | None = None

    def _sub_id(self, i: int) -> str:
        return self.request_id if len(self.choices) == 1 else f"{self.request_id}-{i}"

    async def _merged(self) -> AsyncIterator[tuple[int, TokenChunk]]:
        """Chunks of every choice as they arrive; all streams are closed on exit."""
        q: asyncio.Queue = asyncio.Queue()
        n = self.spec.n

        async def pump(i: int) -> None:
            try:
                async for c in self.pipeline.stream(self._sub_id(i), self.prepared[i // n],
                                                    self.spec):  # fmt: skip
                    q.put_nowait((i, c))
                q.put_nowait((i, None))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
                q.put_nowait((i, exc))

        async def on_cancel(msg) -> None:
            with contextlib.suppress(Exception):
                if decode(msg.data, Cancel).reason.startswith("failover"):
                    return  # our own failover notice to a dead instance, not a user cancel
            q.put_nowait((-1, _CANCELLED))

        cancel_sub = await self.pipeline.nc.subscribe(subjects.req_cancel(self.request_id),
                                                      cb=on_cancel)  # fmt: skip
        m.QUEUE.observe(time.perf_counter() - self.arrival)
        m.WAITING.inc()
        waiting = True
        tasks = [asyncio.create_task(pump(i)) for i in range(len(self.choices))]
        open_ = len(tasks)
        last = None
        try:
            while open_:
                i, item = await q.get()
                if item is _CANCELLED:  # cancelled on the bus: end every open choice cleanly
                    for c in self.choices:
                        if c.finish_reason is None:
                            abort = TokenChunk(
                                request_id=self._sub_id(c.index),
                                index=len(c.token_ids),
                                finish_reason="abort",
                            )
                            c.add(abort)
                            yield c.index, abort
                    return
                if item is None:
                    open_ -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                now = time.perf_counter()
                if self.first_token_at is None:
                    self.first_token_at = now
                    m.TTFT.observe(now - self.arrival)
                    m.WAITING.dec()
                    m.RUNNING.inc()
                    waiting = False
                elif last is not None and item.token_ids:
                    m.ITL.observe(now - last)
                last = now
                self.choices[i].add(item)
                yield i, item
        finally:
            with contextlib.suppress(Exception):
                await cancel_sub.unsubscribe()
            for t in tasks:
                t.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(*tasks, return_exceptions=True)
            if waiting:
                m.WAITING.dec()
            else:
                m.RUNNING.dec()
            self._record()

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

    def _prompt_lens(self) -> list[int]:
        return [len(p.prompt_token_ids) for p in self.prepared]

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """OpenAI stream chunks; a usage chunk last when ``stream_options.include_usage``."""
        offsets = [0] * len(self.choices)
        if self.spec.kind == "chat":
            for i in range(len(self.choices)):
                yield self.fmt.role_chunk(i)
        async for i, c in self._merged():
            if not c.token_ids and not c.text and c.finish_reason is None:
                continue
            yield self.fmt.chunk(i, c, offsets[i])
            offsets[i] += len(c.text)
        if self.spec.include_usage:
            yield self.fmt.usage_chunk(usage(self.choices, self._prompt_lens()))

    async def complete(self) -> dict[str, Any]:
        async for _ in self._merged():
            pass
        echo = None
        req = self.spec.request
        if self.spec.kind == "completion" and getattr(req, "echo", False):
            echo = [str(self.spec.prompts[i // self.spec.n]) for i in range(len(self.choices))]
        return self.fmt.final(self.choices, self._prompt_lens(), echo)
