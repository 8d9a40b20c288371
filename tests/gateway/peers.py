"""Small fake bus peers for gateway tests: tokenizer, vision, scheduler, decode instances.

They speak the real protocol over a real nats-server; the decode fake emits token ``100 + i``
with text ``"t<i> "`` for output position ``i`` so streams are easy to check exactly.
"""

from __future__ import annotations

import asyncio
import time

from shared import bus
from shared.protocol import subjects
from shared.protocol.codec import decode, encode
from shared.protocol.errors import StrataError
from shared.protocol.sched import (
    InstanceInfo,
    InstancesReply,
    InstancesRequest,
    RouteReply,
    RouteRequest,
    routed_submit,
)
from shared.protocol.stream import Cancel, TokenChunk, TokenChunkBatch, Usage
from shared.protocol.tok import (
    DetokenizeReply,
    DetokenizeRequest,
    ImageSpan,
    TokenizeReply,
    TokenizeRequest,
)
from shared.protocol.vision import ImageInfo, VisionEncodeReply, VisionEncodeRequest
from shared.protocol.work import DecodeWork, SubmitAck

IMG_TOKENS = 4
ROLES = ("tokenizer", "vision", "scheduler")


class Peers:
    def __init__(self, nc, max_model_len: int = 64, delay: float = 0.0):
        self.nc = nc
        self.max_model_len = max_model_len
        self.delay = delay  # seconds tokenizer and vision each take (EPD overlap test)
        self.decodes: dict[str, dict] = {}  # instance -> behaviour
        self.alive: list[str] = []
        self.routes: list[RouteRequest] = []
        self.items: list[DecodeWork] = []
        self.tok_reqs: list[TokenizeRequest] = []
        self.cancels: list[str] = []
        self.windows: dict[str, tuple[float, float]] = {}
        self.subs = []
        self.role_subs: dict[str, list] = {}
        self.script: list[str] | None = None  # texts decode emits instead of "t<i> " (then stops)
        self.batches = 0  # `TokenChunkBatch` messages the batched decodes sent
        self.fingerprint = "fp"  # the model fingerprint the tokenizer reports
        self.chat_prompt_text = ""  # the rendered prompt text it reports for chat messages

    async def start(self, roles: tuple[str, ...] = ROLES) -> Peers:
        for role in roles:
            await self.start_role(role)

        async def on_cancel(msg):
            self.cancels.append(decode(msg.data, Cancel).request_id)

        self.subs.append(await self.nc.subscribe(subjects.REQ_CANCEL_ALL, cb=on_cancel))
        return self

    async def start_role(self, role: str) -> None:
        """Serve one of `ROLES` (its requests and, like the real services, its readiness)."""
        nc, s = self.nc, self.role_subs.setdefault(role, [])
        if role == "tokenizer":
            s.append(await bus.serve(nc, subjects.TOK_ENCODE, TokenizeRequest, self.tok))
            s.append(await bus.serve(nc, subjects.TOK_DECODE, DetokenizeRequest, self.detok))
            s.append(await bus.serve_ping(nc, subjects.TOK_PING, "tokenizer", "tok"))
        elif role == "vision":
            s.append(await bus.serve(nc, subjects.VISION_ENCODE, VisionEncodeRequest, self.vis))
            s.append(await bus.serve_ping(nc, subjects.VISION_PING, "vision", "vis"))
        else:
            s.append(await bus.serve(nc, subjects.SCHED_ROUTE, RouteRequest, self.route))
            s.append(await bus.serve(nc, subjects.SCHED_INSTANCES, InstancesRequest, self.insts))
        await nc.flush()

    async def stop_role(self, role: str) -> None:
        for sub in self.role_subs.pop(role, []):
            await sub.unsubscribe()
        await self.nc.flush()

    async def stop(self) -> None:
        for role in list(self.role_subs):
            await self.stop_role(role)
        for sub in self.subs:
            await sub.unsubscribe()

    async def add_decode(
        self,
        inst: str,
        stall_after: int | None = None,
        resend: bool = False,
        gap: float = 0.0,
        refuse: bool = False,
        batched: bool = False,
    ) -> None:
        """``batched``: chunks go as decode sends them, in a `TokenChunkBatch` on the owning
        gateway's ``strata.gw.<id>.out`` (counted in ``batches``), not on the request's own."""
        self.decodes[inst] = {
            "stall_after": stall_after,
            "resend": resend,
            "gap": gap,
            "batched": batched,
        }
        self.alive.append(inst)

        async def submit(item: DecodeWork) -> SubmitAck:
            self.items.append(item)
            if refuse:
                return SubmitAck(instance_id=inst, accepted=False)
            asyncio.get_running_loop().create_task(self.generate(inst, item))
            return SubmitAck(instance_id=inst)

        self.subs.append(await bus.serve(self.nc, subjects.decode_submit(inst), DecodeWork, submit))

    async def tok(self, req: TokenizeRequest) -> TokenizeReply:
        t0 = time.time()
        self.tok_reqs.append(req)
        await asyncio.sleep(self.delay)
        ids, spans = [], []
        if req.prompt is not None:
            ids = [ord(c) % 500 for c in req.prompt]
        if req.prompt_token_ids is not None:  # checked against the vocabulary, as the real one
            if any(t >= 500 for t in req.prompt_token_ids):
                raise StrataError("bad_request", "prompt: token id is not in the vocabulary")
            ids = list(req.prompt_token_ids)
        for msg in req.messages or []:
            content = msg.get("content") or ""
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
            for p in parts:
                if p["type"] == "image":
                    spans.append(ImageSpan(offset=len(ids), length=IMG_TOKENS))
                    ids += [999] * IMG_TOKENS
                else:
                    ids += [ord(c) % 500 for c in p["text"]]
        self.windows["tok"] = (t0, time.time())
        if req.truncate_prompt_tokens is not None and req.truncate_prompt_tokens > 0:
            ids = ids[-req.truncate_prompt_tokens :]
        return TokenizeReply(
            token_ids=ids,
            text="".join(chr(t) for t in ids) if req.messages is None else self.chat_prompt_text,
            vocab_size=500,
            bad_words_ids=[[ord(c) % 500 for c in w] for w in req.bad_words],
            image_spans=spans,
            model_fingerprint=self.fingerprint,
            kv_dtype="float32",
            block_size=4,
            max_model_len=self.max_model_len,
        )

    async def detok(self, req: DetokenizeRequest) -> DetokenizeReply:
        if any(t >= 500 for t in req.token_ids):
            raise StrataError("bad_request", "tokens: token id is not in the vocabulary (size 500)")
        return DetokenizeReply(text="".join(chr(t) for t in req.token_ids))

    async def vis(self, req: VisionEncodeRequest) -> VisionEncodeReply:
        t0 = time.time()
        await asyncio.sleep(self.delay)
        self.windows["vis"] = (t0, time.time())
        infos = [
            ImageInfo(hash=f"h{len(b)}", num_tokens=IMG_TOKENS, width=1, height=1)
            for b in req.images
        ]
        return VisionEncodeReply(images=infos, instance_id="vis", source_addr="127.0.0.1:1")

    async def route(self, req: RouteRequest) -> RouteReply:
        """First live instance not excluded; like the real scheduler, a request that carries its
        DecodeWork is submitted there (ack to ``strata.req.<id>.ack``)."""
        self.routes.append(req)
        for inst in self.alive:
            if inst not in req.exclude:
                reply = RouteReply(decode_instance=inst, decode_addr="127.0.0.1:2")
                if req.submit is not None:
                    target, item = routed_submit(req.submit, reply)
                    await self.nc.publish(
                        target, encode(item), reply=subjects.req_ack(item.request_id)
                    )
                return reply
        return RouteReply(decode_instance="", decode_addr="")

    async def insts(self, req: InstancesRequest) -> InstancesReply:
        return InstancesReply(
            instances=[
                InstanceInfo(
                    instance_id=i, role="decode", incarnation="x", grpc_addr="", alive=True
                )
                for i in self.alive
            ]
        )

    async def generate(self, inst: str, item: DecodeWork) -> None:
        b = self.decodes[inst]
        start = len(item.output_token_ids)
        if b["resend"] and start:  # a resumed instance that repeats what was already sent
            start = max(0, start - 2)
        n = item.sampling.max_tokens
        script = self.script
        if script is not None:
            n = min(n, len(script))
        for i in range(start, n):
            if b["stall_after"] is not None and i >= b["stall_after"]:
                return
            if b["gap"]:
                await asyncio.sleep(b["gap"])
            last = i == n - 1
            lp = [{100 + i: -0.5, 7: -1.5}] if item.sampling.logprobs is not None else None
            plp, ranks = None, None
            if item.sampling.prompt_logprobs is not None and i == 0:
                # per prompt token from the 2nd: {the token: -k/10, then alternative 7: -0.05}
                ids = item.prompt_token_ids[1:]
                plp = [{t: -(k + 1) / 10, 7: -0.05} for k, t in enumerate(ids)]
                ranks = [2] * len(ids)
            text = f"t{i} " if script is None else script[i]
            ended = "stop" if script is not None and n == len(script) else "length"
            chunk = TokenChunk(
                request_id=item.request_id,
                index=i,
                token_ids=[100 + i],
                text=text,
                logprobs=lp,
                prompt_logprobs=plp,
                prompt_ranks=ranks,
                finish_reason=ended if last else None,
                usage=Usage(
                    prompt_tokens=len(item.prompt_token_ids), completion_tokens=n, cached_tokens=4
                )
                if last
                else None,
                instance_id=inst,
                attempt=item.attempt,
            )
            if b["batched"] and item.gateway_id:
                batch = TokenChunkBatch(chunks=[chunk])
                await bus.publish(self.nc, subjects.gw_out(item.gateway_id), batch)
                self.batches += 1
            else:
                await bus.publish(self.nc, subjects.req_out(item.request_id), chunk)
            await asyncio.sleep(0)
