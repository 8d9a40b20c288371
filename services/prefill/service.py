"""Prefill instance: run the prompt, emit the first token, hand the KV to a decode instance.

Before computing, the longest reusable prefix is loaded from the KV pool when the measured cost
model says loading beats recomputing. After the first token:
- direct mode pushes the prompt KV to the decode instance over gRPC (layer-range frames, small
  layers merged), then submits the request there;
- pool mode writes the full blocks to the kvstore and the decode instance pulls them.
Full blocks the pool lacks are offered to it in the background either way.
"""

from __future__ import annotations

import asyncio
import logging

from nats.aio.client import Client as NATS

from shared import bus
from shared.engine.port_types import Tenant
from shared.kvtransfer.client import get_client
from shared.protocol import subjects
from shared.protocol.errors import INSTANCE_ERRORS, StrataError
from shared.protocol.stream import TokenChunk, Usage
from shared.protocol.work import DecodeWork, PrefillWork, SubmitAck, WorkItem
from shared.worker import kv_wire
from shared.worker.images import fetch_mm_inputs
from shared.worker.kv_metrics import (
    KV_SENT_BYTES,
    count_fallback,
    counted_frames,
    fallback_reason,
)
from shared.worker.layerwise import LayerTap, merged_frames
from shared.worker.runtime import REQUESTS_FAILED, ModelRuntime, publish_error
from shared.worker.service import RequestTasks

log = logging.getLogger(__name__)


class PrefillService(RequestTasks):
    def __init__(self, rt: ModelRuntime, nc: NATS):
        super().__init__(rt, nc)
        self.background: set[asyncio.Task] = set()
        self.pool = rt.pool_link()
        self.tap: LayerTap | None = None
        if rt.cfg.layerwise_transfer:
            self.tap = LayerTap(asyncio.get_event_loop(), rt.port.kv_spec.num_layers)
            rt.port.set_connector(self.tap)

    async def _run(self, item: PrefillWork) -> None:
        rid, eid = item.request_id, item.engine_id  # bus subjects / engine and KV transfer
        port = self.rt.port
        held = False
        pushing: asyncio.Task | None = None
        try:
            mm = await fetch_mm_inputs(item.images, self.rt.loaded.model.dtype)
            context = list(item.prompt_token_ids) + list(item.output_token_ids)
            hashes, tiers, external = [], [], None
            if self.pool is not None and item.sampling.prompt_logprobs is None:
                # (prompt logprobs need every prompt token computed: nothing to load for them)
                hashes, tiers, _, _, external = await self.pool.load_prefix(
                    context, mm, item.sampling.cache_salt
                )
            params = item.sampling.model_copy(update={"max_tokens": 1, "min_tokens": 0})
            direct = not (item.transfer_mode == "pool" and self.pool is not None)
            if direct and self.tap is not None:
                q = self.tap.open(eid)  # before the engine can see the request
                pushing = asyncio.create_task(
                    self._push_layerwise(eid, q, len(context), item.decode_addr)
                )
            out = None
            async for o in port.generate(
                eid,
                item.prompt_token_ids,
                params,
                priority=item.priority,
                mm_inputs=mm,
                output_token_ids=item.output_token_ids,
                hold_kv=True,
                tenant=Tenant(item.tenant, item.tenant_weight),
                external_kv=external,
            ):
                out = o
            held = True
            if out is None or not out.new_token_ids:
                raise StrataError("internal", f"prefill of {rid} produced no token")
            self.rt.prefilled_tokens += len(context) - out.num_cached_tokens
            done = await self._emit_first(item, out)
            new_blocks = []
            if hashes and (not direct or self.rt.cfg.kv_pool_save == "off"):
                # pool mode: decode pulls them; direct mode only with kv_pool_save off (else
                # the engine's save policy offers the blocks it computed to the pool)
                new_blocks = await self.pool.read_new_blocks(eid, hashes, tiers)
            if done:
                self._store_later(new_blocks)
                if pushing is not None:
                    pushing.cancel()  # the decode instance drops the partial transfer
                return
            work = DecodeWork(
                **{f: getattr(item, f) for f in WorkItem.model_fields},
                first_token_id=out.new_token_ids[0],
                num_cached_tokens=out.num_cached_tokens,
            )
            if not direct:
                # decode pulls them: store first (the blocks the pool holds already stay)
                KV_SENT_BYTES.labels("pool").inc(await self.pool.store_blocks(new_blocks))
                work = work.model_copy(update={"kv_block_hashes": hashes})
            else:
                if await self._pushed(eid, pushing, len(context), item.decode_addr):
                    work = work.model_copy(
                        update={
                            "kv_pushed": True,
                            "kv_num_tokens": len(context),
                            "kv_layerwise": pushing is not None,
                        }
                    )
                self._store_later(new_blocks)
            try:
                await bus.request(
                    self.nc,
                    subjects.decode_submit(item.decode_instance),
                    work,
                    SubmitAck,
                    timeout=10.0,
                )
            except StrataError as exc:
                if exc.code not in INSTANCE_ERRORS:
                    raise
                # the decode instance is gone or not answering: the error names it, so the
                # gateway fails the stream over with that instance excluded (not a 5xx)
                REQUESTS_FAILED.labels("prefill").inc()
                log.warning("hand-off of %s to %s failed: %s", rid, item.decode_instance, exc)
                await publish_error(self.nc, rid, exc, item.decode_instance, item.attempt)
                return
        except asyncio.CancelledError:
            log.info("prefill of %s cancelled", eid)
            port.abort(eid)
            if self.stopping:  # not the client's cancel: the request goes on elsewhere
                await publish_error(
                    self.nc, rid, self.stopped_error(), self.instance_id, item.attempt
                )
                return
            await bus.publish(
                self.nc,
                subjects.req_out(rid),
                TokenChunk(
                    request_id=rid,
                    index=len(item.output_token_ids),
                    finish_reason="abort",
                    instance_id=self.instance_id,
                    attempt=item.attempt,
                ),
            )
        except Exception as exc:  # noqa: BLE001 - the request fails; the service does not
            REQUESTS_FAILED.labels("prefill").inc()
            log.warning("prefill of %s failed: %s", rid, exc)
            await publish_error(self.nc, rid, exc, self.instance_id, item.attempt)
        finally:
            if pushing is not None and not pushing.done():
                pushing.cancel()
            if self.tap is not None:
                self.tap.close(eid)
            if held:
                await port.release(eid)

    async def _emit_first(self, item: PrefillWork, out) -> bool:
        """Publish the first token (this is the TTFT); True if it also ends the request."""
        n_prev = len(item.output_token_ids)
        done = item.sampling.max_tokens - n_prev <= 1 or out.finish_reason == "stop"
        usage = None
        if done:
            usage = Usage(
                prompt_tokens=len(item.prompt_token_ids),
                completion_tokens=n_prev + 1,
                cached_tokens=out.num_cached_tokens,
            )
        # A stream that goes on at decode leaves out the text the engine released only because
        # this stage ended (an incomplete character): decode emits it once it is complete.
        chunk = TokenChunk(
            request_id=item.request_id,
            index=n_prev,
            token_ids=out.new_token_ids[:1],
            text=out.text_delta if done else out.handoff_text,
            logprobs=out.new_logprobs,
            prompt_logprobs=out.prompt_logprobs,
            prompt_ranks=out.prompt_ranks,
            finish_reason=("stop" if out.finish_reason == "stop" else "length") if done else None,
            usage=usage,
            instance_id=self.instance_id,
            attempt=item.attempt,
        )
        await bus.publish(self.nc, subjects.req_out(item.request_id), chunk)
        return done

    async def _pushed(self, rid: str, pushing: asyncio.Task | None, n: int, addr: str) -> bool:
        """Finish the direct transfer; False if it broke (the decode instance then recomputes
        the prompt instead of failing the request, and drops the partial transfer)."""
        try:
            if pushing is not None:
                await asyncio.wait_for(pushing, self.rt.cfg.transfer_timeout)
            else:
                await self._push_kv(rid, n, addr)
            return True
        except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - any broken transfer
            if isinstance(exc, asyncio.CancelledError) and asyncio.current_task().cancelling():
                raise  # this request itself was cancelled, not just its transfer
            reason = fallback_reason(exc)
            count_fallback(reason)
            log.warning(
                "KV push of %s to %s failed (%s: %s); decode will recompute", rid, addr, reason, exc
            )
            return False

    def _store_later(self, blocks) -> None:
        if not blocks:
            return
        t = asyncio.create_task(self.pool.store_blocks(blocks))
        self.background.add(t)
        t.add_done_callback(self.background.discard)

    async def _push_layerwise(self, rid: str, q: asyncio.Queue, num_tokens: int, addr: str) -> None:
        """Open the push stream now; frames flow as the engine finishes each layer."""
        if not addr:
            raise StrataError("bad_request", f"{rid}: no decode address to push KV to")
        frames = merged_frames(
            q,
            request_id=rid,
            fingerprint=self.rt.fingerprint,
            total_tokens=num_tokens,
            merge_bytes=self.rt.cfg.frame_merge_bytes,
            int8=self.rt.cfg.kv_int8,
        )
        # No deadline on the stream itself: it lives as long as the prefill computes. Once the
        # prefill is done, `_pushed` gives the rest `transfer_timeout` to land.
        await get_client(addr).push(counted_frames(frames, "layerwise"), timeout=None)

    async def _push_kv(self, rid: str, num_tokens: int, addr: str) -> None:
        """Read the held prompt KV and stream it to the decode instance, layer group by group."""
        if not addr:
            raise StrataError("bad_request", f"{rid}: no decode address to push KV to")
        port, spec = self.rt.port, self.rt.port.kv_spec
        per_layer = num_tokens * spec.token_bytes(1)
        groups = kv_wire.layer_groups(spec.num_layers, per_layer, self.rt.cfg.frame_merge_bytes)

        async def frames():
            for layers in groups:
                got = await port.read_kv(rid, layers)
                if got.num_tokens < num_tokens:
                    raise StrataError(
                        "internal", f"{rid}: only {got.num_tokens} of {num_tokens} tokens have KV"
                    )
                kv = got.blocks.flatten(2, 3)[:, :, :num_tokens]
                for f in kv_wire.kv_frames(
                    kv,
                    layers,
                    request_id=rid,
                    fingerprint=self.rt.fingerprint,
                    total_layers=spec.num_layers,
                    int8=self.rt.cfg.kv_int8,
                ):
                    yield f

        await get_client(addr).push(
            counted_frames(frames(), "after_prefill"), timeout=self.rt.cfg.transfer_timeout
        )
