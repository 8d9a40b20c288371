"""Prefill instance: run the prompt, emit the first token, hand the KV to a decode instance.

Direct mode pushes the prompt KV to the decode instance over gRPC (layer-range frames, small
layers merged), then submits the request there. The first token goes straight to the gateway.
"""

from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.client import Client as NATS

from services.worker import kv_wire
from services.worker.images import fetch_mm_inputs
from services.worker.runtime import REQUESTS_FAILED, ModelRuntime, publish_error
from shared import bus
from shared.kvtransfer.client import get_client
from shared.protocol import subjects
from shared.protocol.errors import StrataError
from shared.protocol.stream import TokenChunk, Usage
from shared.protocol.work import SubmitAck, WorkItem

log = logging.getLogger(__name__)


class PrefillService:
    def __init__(self, rt: ModelRuntime, nc: NATS):
        self.rt = rt
        self.nc = nc
        self.tasks: dict[str, asyncio.Task] = {}
        self.prefill_tokens = 0
        self.prefill_seconds = 0.0

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
        rid = item.request_id
        ae = self.rt.async_engine
        held = False
        try:
            mm = await fetch_mm_inputs(item.images, self.rt.loaded.model.dtype)
            user_max = item.sampling.max_tokens
            params = item.sampling.model_copy(update={"max_tokens": 1, "min_tokens": 0})
            t0 = time.perf_counter()
            out = None
            async for o in ae.generate(rid, item.prompt_token_ids, params, priority=item.priority,
                                       mm_inputs=mm, output_token_ids=item.output_token_ids,
                                       hold_kv=True):
                out = o
            held = True
            self.prefill_seconds += time.perf_counter() - t0
            self.prefill_tokens += len(item.prompt_token_ids)
            if out is None or not out.new_token_ids:
                raise StrataError("internal", f"prefill of {rid} produced no token")
            first = out.new_token_ids[0]
            done = user_max - len(item.output_token_ids) <= 1 or out.finish_reason == "stop"
            reason = ("stop" if out.finish_reason == "stop" else "length") if done else None
            chunk = TokenChunk(
                request_id=rid, index=len(item.output_token_ids), token_ids=[first],
                text=out.text_delta, logprobs=out.new_logprobs, finish_reason=reason,
                instance_id=self.instance_id,
                usage=Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=1,
                            cached_tokens=out.num_cached_tokens) if done else None,
            )
            await bus.publish(self.nc, subjects.req_out(rid), chunk)
            if done:
                return
            context = list(item.prompt_token_ids) + list(item.output_token_ids)
            await self._push_kv(rid, len(context), item.decode_addr)
            work = item.model_copy(update={
                "first_token_id": first, "kv_pushed": True, "kv_num_tokens": len(context),
                "first_logprobs": out.new_logprobs[0] if out.new_logprobs else None,
                "num_cached_tokens": out.num_cached_tokens,
            })
            await bus.request(self.nc, subjects.decode_submit(item.decode_instance), work,
                              SubmitAck, timeout=10.0)
        except asyncio.CancelledError:
            log.info("prefill of %s cancelled", rid)
            self.rt.async_engine.abort(rid)
        except Exception as exc:  # noqa: BLE001 - the request fails; the service does not
            REQUESTS_FAILED.labels("prefill").inc()
            log.warning("prefill of %s failed: %s", rid, exc)
            await publish_error(self.nc, rid, exc, self.instance_id)
        finally:
            if held:
                await self.rt.async_engine.call(lambda e: e.release(rid))

    async def _push_kv(self, rid: str, num_tokens: int, addr: str) -> None:
        """Read the held prompt KV and stream it to the decode instance, layer group by group."""
        eng = self.rt.engine
        model = self.rt.loaded.model
        blocks, n = await self.rt.async_engine.call(lambda e: e.request_blocks(rid))
        if n < num_tokens:
            raise StrataError("internal", f"{rid}: only {n} of {num_tokens} tokens have KV")
        elem = eng.runner.kv.k.element_size()
        per_layer = 2 * num_tokens * model.num_kv_heads * model.head_dim * elem
        groups = kv_wire.layer_groups(model.num_layers, per_layer, self.rt.cfg.frame_merge_bytes)

        async def frames():
            for layers in groups:
                kv = await self.rt.async_engine.call(lambda e, ls=layers: e.read_kv(blocks, ls))
                kv = kv.flatten(2, 3)[:, :, :num_tokens]
                for f in kv_wire.kv_frames(kv, layers, request_id=rid,
                                           fingerprint=self.rt.fingerprint,
                                           total_layers=model.num_layers):
                    yield f

        if not addr:
            raise StrataError("bad_request", f"{rid}: no decode address to push KV to")
        await get_client(addr).push(frames(), timeout=self.rt.cfg.transfer_timeout)
