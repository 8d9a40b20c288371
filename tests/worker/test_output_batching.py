"""A decode instance sends one message per gateway per engine step, not one per request: N
concurrent streams of one gateway arrive as `TokenChunkBatch`es on ``strata.gw.<id>.out``, each
stream complete and in index order, in far fewer messages than chunks (real nats-server, the
real decode service and engine in-process). A request whose `WorkItem` names no gateway still
gets its chunks one by one on ``strata.req.<id>.out``."""

from __future__ import annotations

import asyncio

from services.decode.service import DecodeService
from shared import bus
from shared.protocol import subjects
from shared.protocol.codec import decode
from shared.protocol.sampling import SamplingParams
from shared.protocol.stream import TokenChunk, TokenChunkBatch
from shared.protocol.work import DecodeWork, SubmitAck
from shared.worker.app import start_worker
from shared.worker.config import WorkerConfig
from shared.worker.outbox import OUTPUT_CHUNKS, OUTPUT_MESSAGES

N = 4  # concurrent streams of one gateway
MAX_TOKENS = 12


def _count(counter, *labels) -> float:
    return counter.labels(*labels)._value.get()


async def test_one_message_per_gateway_per_step(nats_url, nc, model_dir):
    cfg = WorkerConfig.load(
        [],
        role="decode",
        instance_id="d-batch",
        nats_url=nats_url,
        model=model_dir,
        kv_cache_bytes=8 << 20,
        load_interval=0.2,
    )
    worker = await start_worker(cfg, "decode", DecodeService, nc)
    try:
        got: dict[str, list[TokenChunk]] = {}
        batches: list[TokenChunkBatch] = []
        done = asyncio.Event()
        finished: set[str] = set()

        def take(chunk: TokenChunk) -> None:
            got.setdefault(chunk.request_id, []).append(chunk)
            if chunk.finish_reason is not None:
                finished.add(chunk.request_id)
                if len(finished) == N + 1:
                    done.set()

        async def on_batch(msg):
            batch = decode(msg.data, TokenChunkBatch)
            batches.append(batch)
            for c in batch.chunks:
                take(c)

        async def on_single(msg):
            take(decode(msg.data, TokenChunk))

        subs = [
            await nc.subscribe(subjects.gw_out("gw-a"), cb=on_batch),
            await nc.subscribe(subjects.req_out("old-0"), cb=on_single),
        ]
        before = (
            _count(OUTPUT_MESSAGES, "decode", "gateway"),
            _count(OUTPUT_MESSAGES, "decode", "request"),
            _count(OUTPUT_CHUNKS, "decode"),
        )
        sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        items = [
            DecodeWork(
                request_id=f"r{i}",
                prompt_token_ids=[5 + i, 6, 7],
                sampling=sampling,
                gateway_id="gw-a",
            )
            for i in range(N)
        ]
        items.append(
            DecodeWork(request_id="old-0", prompt_token_ids=[9, 9, 9], sampling=sampling)
        )  # an older gateway: no gateway id
        acks = await asyncio.gather(
            *(bus.request(nc, subjects.decode_submit("d-batch"), it, SubmitAck) for it in items)
        )
        assert all(a.accepted for a in acks)
        await asyncio.wait_for(done.wait(), 120)
        for sub in subs:
            await sub.unsubscribe()
    finally:
        await worker.stop()

    for rid, chunks in got.items():
        indices = [c.index for c in chunks]
        assert indices == sorted(indices) and indices[0] == 0, rid
        assert sum(len(c.token_ids) for c in chunks) == MAX_TOKENS, rid
    assert set(got) == {f"r{i}" for i in range(N)} | {"old-0"}
    batched_chunks = sum(len(b.chunks) for b in batches)
    assert batched_chunks == sum(len(got[f"r{i}"]) for i in range(N))
    assert all(c.request_id != "old-0" for b in batches for c in b.chunks)
    gw_msgs = _count(OUTPUT_MESSAGES, "decode", "gateway") - before[0]
    single = _count(OUTPUT_MESSAGES, "decode", "request") - before[1]
    chunks = _count(OUTPUT_CHUNKS, "decode") - before[2]
    assert gw_msgs == len(batches) and single == len(got["old-0"])
    assert chunks == batched_chunks + single
    # N streams stepping together: about one message per step, not one per stream per step
    assert len(batches) < batched_chunks / 2, (len(batches), batched_chunks)
    assert max(len({c.request_id for c in b.chunks}) for b in batches) == N  # one batch, N streams
