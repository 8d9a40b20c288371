"""Decode instance: continuous batching over requests whose KV was pushed here (or that it
prefills itself), streaming index-numbered token chunks to the gateway.

A transfer that fails, times out or does not check out is recovered by recomputing the prompt
locally: the client never sees the difference, and the partial state is freed.
"""

from __future__ import annotations

import asyncio
import logging

from nats.aio.client import Client as NATS

from shared.engine.port_types import Tenant
from shared.protocol.errors import StrataError
from shared.protocol.stream import TokenChunk, Usage
from shared.protocol.work import DecodeWork
from shared.worker.images import fetch_mm_inputs
from shared.worker.kv_metrics import KV_RECEIVED_BYTES, count_fallback
from shared.worker.kv_wire import KVReceiver, PagedSink, TransferFailed
from shared.worker.outbox import Outbox
from shared.worker.pool_link import count_pool_decision
from shared.worker.runtime import REQUESTS_FAILED, ModelRuntime, error_chunk
from shared.worker.service import RequestTasks

log = logging.getLogger(__name__)


class DecodeService(RequestTasks):
    def __init__(self, rt: ModelRuntime, nc: NATS):
        super().__init__(rt, nc)
        self.outbox = Outbox(nc, "decode")  # one message per gateway per step
        spec = rt.port.kv_spec
        self.receiver = KVReceiver(
            rt.fingerprint,
            PagedSink(rt.port),
            spec.num_layers,
            (spec.kv_heads, spec.head_dim),
            spec.dtype,
        )

    def idle(self) -> bool:
        return not self.tasks and not self.receiver.num_pending

    async def cancel(self, request_id: str, attempt: int | None = None) -> None:
        # KV may be arriving for a route whose decode work is not here yet: drop that too.
        for eid in self.running(request_id, attempt) | self.receiver.pending_of(
            request_id, attempt
        ):
            await self.receiver.drop(eid)
        await super().cancel(request_id, attempt)

    async def _run(self, item: DecodeWork) -> None:
        rid, eid = item.request_id, item.engine_id  # bus subjects / engine and KV transfer
        port = self.rt.port
        emitted = list(item.output_token_ids)
        if item.first_token_id is not None:
            emitted.append(item.first_token_id)
        index = len(emitted)
        try:
            mm = await fetch_mm_inputs(item.images, self.rt.loaded.model.dtype)
            stream, prefilled_elsewhere = await self._start(item, mm, emitted)
            async for out in stream:
                if not out.new_token_ids and not out.finished:
                    continue
                emitted.extend(out.new_token_ids)
                self.rt.decode_rate.add(len(out.new_token_ids))
                usage = None
                if out.finished:
                    # The prompt's cache hit is where it was computed: blocks this instance
                    # already held when pushed/pooled KV arrived are not a prefill saving.
                    cached = (
                        item.num_cached_tokens
                        if prefilled_elsewhere
                        else max(item.num_cached_tokens, out.num_cached_tokens)
                    )
                    usage = Usage(
                        prompt_tokens=len(item.prompt_token_ids),
                        completion_tokens=len(emitted),
                        cached_tokens=cached,
                    )
                chunk = TokenChunk(
                    request_id=rid,
                    index=index,
                    token_ids=out.new_token_ids,
                    text=out.text_delta,
                    logprobs=out.new_logprobs,
                    prompt_logprobs=out.prompt_logprobs,
                    prompt_ranks=out.prompt_ranks,
                    finish_reason=out.finish_reason if out.finished else None,
                    usage=usage,
                    instance_id=self.instance_id,
                    attempt=item.attempt,
                )
                index += len(out.new_token_ids)
                self.outbox.send(chunk, item.gateway_id)
        except asyncio.CancelledError:
            log.info("decode of %s cancelled", eid)
            port.abort(eid)
            if self.stopping:  # not the client's cancel: the stream goes on elsewhere
                err = error_chunk(rid, self.stopped_error(), self.instance_id, item.attempt)
                self.outbox.send(err, item.gateway_id)
                return
            abort = TokenChunk(
                request_id=rid,
                index=index,
                finish_reason="abort",
                instance_id=self.instance_id,
                attempt=item.attempt,
            )
            self.outbox.send(abort, item.gateway_id)
        except Exception as exc:  # noqa: BLE001 - the request fails; the service does not
            REQUESTS_FAILED.labels("decode").inc()
            log.warning("decode of %s failed: %s", eid, exc)
            port.abort(eid)
            self.outbox.send(error_chunk(rid, exc, self.instance_id, item.attempt), item.gateway_id)

    async def _start(self, item: DecodeWork, mm, emitted: list[int]):
        """(engine output stream, whether the prompt was prefilled elsewhere): from pushed KV
        when it checks out, from pool blocks, else by recompute."""
        port = self.rt.port
        rid = item.engine_id  # the engine's and the KV transfer's id of this route's work
        if item.kv_pushed and item.first_token_id is not None:
            try:
                nbytes = await self.receiver.take(
                    rid, item.kv_num_tokens, self.rt.cfg.transfer_timeout
                )
                mode = "layerwise" if item.kv_layerwise else "after_prefill"
                KV_RECEIVED_BYTES.labels(mode).inc(nbytes)
                context = list(item.prompt_token_ids) + list(item.output_token_ids)
                # A resumed stream (failover): the engine takes the tokens already sent as part
                # of the prompt, so only the rest of max_tokens / min_tokens is still due.
                sent = len(item.output_token_ids)
                sampling = item.sampling.resumed(sent)
                return port.generate_prefilled(
                    rid,
                    context,
                    item.first_token_id,
                    sampling,
                    priority=item.priority,
                    mm_inputs=mm,
                ), True
            except StrataError as exc:
                count_fallback(exc.reason if isinstance(exc, TransferFailed) else "broken")
                log.warning("KV transfer for %s failed (%s); recomputing locally", rid, exc)
        await self.receiver.drop(rid)  # whatever part of a transfer arrived is not used
        pool = self.rt.pool_link()
        pooled = False
        external = None  # pool blocks the engine's scheduler takes in at admission
        if item.kv_block_hashes and pool is not None:
            # Pool mode: pull the full blocks prefill stored; the tail (< 1 block) and anything
            # the pool lost are recomputed by the engine's normal prefix-cached prefill.
            external, nbytes = await pool.load_blocks(item.kv_block_hashes)
            KV_RECEIVED_BYTES.labels("pool").inc(nbytes)
            loaded = 0 if external is None else len(external.hashes)
            if loaded < len(item.kv_block_hashes):
                count_fallback("pool_miss")
            else:
                pooled = True
        elif pool is not None and item.pool_blocks == 0 and not emitted:
            # The scheduler's index places none of the prompt's blocks in the pool: no lookup
            # (a round trip to the kvstore per cold prompt, on the way to its first token).
            count_pool_decision("unlisted")
        elif pool is not None and item.sampling.prompt_logprobs is None:
            # This instance computes the context itself (the colocated shape, a failed push, a
            # failover): the prefix the pool holds beyond engine memory is loaded first when
            # the cost model says loading beats recomputing (a restart, an evicted prefix, or
            # a failed-over stream's blocks written through by the instance that died).
            got = await pool.load_prefix(
                list(item.prompt_token_ids) + emitted, mm, item.sampling.cache_salt
            )
            KV_RECEIVED_BYTES.labels("pool").inc(got.nbytes)
            external = got.external
        stream = port.generate(
            rid,
            item.prompt_token_ids,
            item.sampling,
            priority=item.priority,
            mm_inputs=mm,
            output_token_ids=emitted,
            tenant=Tenant(item.tenant, item.tenant_weight),
            external_kv=external,
        )
        return stream, pooled
