"""Prefill -> decode over real NATS and real gRPC (services in-process, engines real).

Greedy output through the disaggregated path equals a single in-process engine; a decode
instance that prefills itself gives the same; a transfer that never arrives is recovered by
recompute with the same output and no leaked blocks. Since recompute gives the same tokens, every
test also asserts on the KV transfer counters which path moved how many bytes (`kv_counters`).
"""

from __future__ import annotations

import asyncio

import pytest

from services.decode.service import DecodeService
from services.prefill.service import PrefillService
from shared import bus
from shared.protocol import subjects
from shared.protocol.codec import decode
from shared.protocol.sampling import SamplingParams
from shared.protocol.stream import Cancel, TokenChunk
from shared.protocol.work import (
    DecodeWork,
    HeldQuery,
    HeldReply,
    PrefillWork,
    SubmitAck,
    WorkItem,
)
from shared.worker.app import start_worker
from shared.worker.config import WorkerConfig
from tests.worker.kv_counters import Transfers, assert_moved, kv_bytes

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def model_dir():
    from services.cluster_config import ensure_model

    return ensure_model("")


@pytest.fixture(scope="module")
def prompt_ids(model_dir) -> list[int]:
    from shared.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "Name three colours, please."}])
    return tok.encode(text)


@pytest.fixture(scope="module")
def reference(model_dir, prompt_ids) -> list[int]:
    from shared.engine.engine import LLMEngine
    from shared.engine.params import EngineConfig
    from shared.model.loader import load_model

    eng = LLMEngine(load_model(model_dir), EngineConfig(kv_cache_bytes=8 << 20))
    return eng.generate(
        [prompt_ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    )[0]


@pytest.fixture(params=[True, False], ids=["layerwise", "after-prefill"])
async def pd(request, nats_url, nc, model_dir):
    common = dict(
        nats_url=nats_url,
        model=model_dir,
        kv_cache_bytes=8 << 20,
        load_interval=0.2,
        transfer_timeout=2.0,
        layerwise_transfer=request.param,
        frame_merge_bytes=0 if request.param else 256 << 10,
    )
    pcfg = WorkerConfig.load([], role="prefill", instance_id="p-test", **common)
    dcfg = WorkerConfig.load([], role="decode", instance_id="d-test", **common)
    p = await start_worker(pcfg, "prefill", PrefillService, nc)
    d = await start_worker(dcfg, "decode", DecodeService, nc)
    yield p, d
    await p.stop()
    await d.stop()


async def _run(nc, subject: str, item: WorkItem) -> list[TokenChunk]:
    chunks: list[TokenChunk] = []
    done = asyncio.Event()

    async def on(msg):
        c = decode(msg.data, TokenChunk)
        chunks.append(c)
        if c.finish_reason:
            done.set()

    sub = await nc.subscribe(subjects.req_out(item.request_id), cb=on)
    await bus.request(nc, subject, item, SubmitAck)
    await asyncio.wait_for(done.wait(), 60)
    await sub.unsubscribe()
    return chunks


def _tokens(chunks: list[TokenChunk]) -> list[int]:
    out: list[int] = []
    for c in sorted(chunks, key=lambda c: c.index):
        assert c.index == len(out), "chunks must be contiguous and index-numbered"
        assert c.error is None, c.error
        out += c.token_ids
    return out


def _item(rid, prompt_ids, **kw) -> WorkItem:
    """A prefill submit when ``kw`` names a decode instance, else a decode submit."""
    cls = PrefillWork if "decode_instance" in kw else DecodeWork
    return cls(
        request_id=rid,
        prompt_token_ids=prompt_ids,
        sampling=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
        **kw,
    )


def _mode(prefill) -> str:
    return "layerwise" if prefill.rt.cfg.layerwise_transfer else "after_prefill"


async def test_prefill_then_decode_equals_single_engine(pd, nc, prompt_ids, reference):
    p, d = pd
    item = _item("r-pd", prompt_ids, decode_instance="d-test", decode_addr=d.addr)
    t = Transfers()
    chunks = await _run(nc, subjects.prefill_submit("p-test"), item)
    # the whole prompt's KV (partial last block included) went by this path, nothing fell back
    assert_moved(t.moved(), _mode(p), kv_bytes(d.rt, len(prompt_ids)))
    assert chunks[0].instance_id == "p-test" and chunks[0].index == 0  # TTFT comes from prefill
    assert _tokens(chunks) == reference
    last = max(chunks, key=lambda c: c.index)
    assert last.finish_reason == "length"
    assert last.usage.completion_tokens == MAX_TOKENS
    assert last.usage.prompt_tokens == len(prompt_ids)
    await asyncio.sleep(0.2)
    for w in (p, d):  # no blocks held once the request is done (cached blocks stay reusable)
        s = w.rt.port.stats()
        assert (s.running, s.kv_blocks_free) == (0, s.kv_blocks_total)
    assert d.svc.receiver.num_pending == 0


async def test_decode_prefills_itself(pd, nc, prompt_ids, reference):
    _, d = pd
    t = Transfers()
    chunks = await _run(nc, subjects.decode_submit("d-test"), _item("r-self", prompt_ids))
    assert _tokens(chunks) == reference
    assert t.moved() == {}  # no transfer was due, so none moved and none fell back


async def test_missing_transfer_is_recomputed(pd, nc, prompt_ids, reference):
    """Decode is told KV was pushed, but none arrives: it recomputes, the client sees no error."""
    _, d = pd
    first = reference[0]
    item = _item(
        "r-lost", prompt_ids, first_token_id=first, kv_pushed=True, kv_num_tokens=len(prompt_ids)
    )
    t = Transfers()
    chunks = await _run(nc, subjects.decode_submit("d-test"), item)
    assert t.moved() == {"fallback:no_kv": 1}
    assert chunks[0].index == 1  # the first token was already emitted by "prefill"
    assert [first] + _tokens_from(chunks, 1) == reference
    assert d.svc.receiver.num_pending == 0
    s = d.rt.port.stats()
    assert (s.running, s.kv_blocks_free) == (0, s.kv_blocks_total)


def _tokens_from(chunks: list[TokenChunk], start: int) -> list[int]:
    out: list[int] = []
    for c in sorted(chunks, key=lambda c: c.index):
        assert c.index == start + len(out)
        out += c.token_ids
    return out


async def test_cancel_frees_kv_everywhere(pd, nc, prompt_ids):
    """A cancel mid-stream ends the stream with "abort" and both engines return to baseline."""
    from shared.protocol.stream import Cancel

    p, d = pd
    rid = "r-cancel"
    item = PrefillWork(
        request_id=rid,
        prompt_token_ids=prompt_ids,
        sampling=SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True),
        decode_instance="d-test",
        decode_addr=d.addr,
    )
    chunks: list[TokenChunk] = []
    got_some, ended = asyncio.Event(), asyncio.Event()

    async def on(msg):
        c = decode(msg.data, TokenChunk)
        chunks.append(c)
        if c.index >= 3:
            got_some.set()
        if c.finish_reason:
            ended.set()

    sub = await nc.subscribe(subjects.req_out(rid), cb=on)
    await bus.request(nc, subjects.prefill_submit("p-test"), item, SubmitAck)
    await asyncio.wait_for(got_some.wait(), 60)
    await bus.publish(nc, subjects.req_cancel(rid), Cancel(request_id=rid))
    await asyncio.wait_for(ended.wait(), 30)
    await sub.unsubscribe()
    assert chunks[-1].finish_reason == "abort"
    assert sum(len(c.token_ids) for c in chunks) < 400
    await asyncio.sleep(0.2)
    for w in (p, d):
        s = w.rt.port.stats()
        assert (s.running, s.waiting, s.kv_blocks_free) == (0, 0, s.kv_blocks_total)


class _CuttingClient:
    """Sends the first frame of a push, then breaks the stream (a transfer cut mid-way)."""

    def __init__(self, real):
        self.real = real

    async def push(self, frames, timeout=None):
        async def cut():
            async for f in _aiter(frames):
                yield f
                raise ConnectionResetError("transfer cut by the test")

        return await self.real.push(cut(), timeout=timeout)


async def _aiter(frames):
    if hasattr(frames, "__aiter__"):
        async for f in frames:
            yield f
    else:
        for f in frames:
            yield f


async def test_transfer_cut_mid_stream_is_recomputed(pd, nc, prompt_ids, reference, monkeypatch):
    """No client error, same tokens, and no partial state left on either side."""
    import services.prefill.service as prefill_mod

    p, d = pd
    real_get = prefill_mod.get_client
    monkeypatch.setattr(prefill_mod, "get_client", lambda addr: _CuttingClient(real_get(addr)))
    t = Transfers()
    item = _item("r-cut", prompt_ids, decode_instance="d-test", decode_addr=d.addr)
    chunks = await _run(nc, subjects.prefill_submit("p-test"), item)
    assert _tokens(chunks) == reference
    moved = t.moved()
    assert moved.pop(f"sent:{_mode(p)}") > 0  # the first frame left before the cut
    assert moved == {"fallback:broken": 1}  # and decode wrote nothing it used
    await asyncio.sleep(0.2)
    assert d.svc.receiver.num_pending == 0
    for w in (p, d):
        s = w.rt.port.stats()
        assert (s.running, s.kv_blocks_free) == (0, s.kv_blocks_total)


async def test_repeated_prompt_hits_the_prefill_prefix_cache(pd, nc, prompt_ids, reference):
    """The second run of a prompt reuses the prefill instance's cached full blocks, reports them
    as cached tokens, and still gives the same tokens."""
    from shared.worker.metrics import PREFIX_HITS

    p, d = pd
    hits = PREFIX_HITS.labels("prefill", "p-test")
    before = hits._value.get()
    t = Transfers()
    usages = []
    for rid in ("r-rep-1", "r-rep-2"):
        item = _item(rid, prompt_ids, decode_instance="d-test", decode_addr=d.addr)
        chunks = await _run(nc, subjects.prefill_submit("p-test"), item)
        assert _tokens(chunks) == reference
        usages.append(max(chunks, key=lambda c: c.index).usage)
    full = len(prompt_ids) // 16 * 16
    assert usages[1].cached_tokens >= full > 0
    # the cached prefix is pushed too (layer-wise: all its layers at once), so both runs moved
    # the whole prompt's KV
    assert_moved(t.moved(), _mode(p), 2 * kv_bytes(d.rt, len(prompt_ids)))
    await asyncio.sleep(0.5)  # the next load report carries the engine counters to /metrics
    assert hits._value.get() - before >= full


class _ForgingClient:
    """Pushes every frame with another model's fingerprint (KV the receiver must refuse)."""

    def __init__(self, real):
        self.real = real

    async def push(self, frames, timeout=None):
        async def forged():
            async for f in _aiter(frames):
                f.fingerprint = "0" * 64
                yield f

        return await self.real.push(forged(), timeout=timeout)


async def test_broken_transfer_is_caught_by_the_byte_counters(
    pd, nc, prompt_ids, reference, monkeypatch
):
    """The counters' assertions catch a broken transfer that the tokens hide: decode refuses the
    forged frames and recomputes (tokens still right), no byte reaches its engine, so the
    byte assertion the other tests make fails here, and the fallback counter moved."""
    import services.prefill.service as prefill_mod

    p, d = pd
    real_get = prefill_mod.get_client
    monkeypatch.setattr(prefill_mod, "get_client", lambda addr: _ForgingClient(real_get(addr)))
    t = Transfers()
    item = _item("r-forged", prompt_ids, decode_instance="d-test", decode_addr=d.addr)
    chunks = await _run(nc, subjects.prefill_submit("p-test"), item)
    assert _tokens(chunks) == reference  # recompute: tokens alone cannot tell
    moved = t.moved()
    with pytest.raises(AssertionError, match="KV transfer counters moved"):
        assert_moved(moved, _mode(p), kv_bytes(d.rt, len(prompt_ids)))
    assert moved["fallback:bad_frame"] == 1
    assert not any(k.startswith("received:") for k in moved)
    await asyncio.sleep(0.2)
    assert d.svc.receiver.num_pending == 0


async def test_a_failover_route_on_the_same_decode_instance_survives_the_first_ones_cancel(
    pd, nc, prompt_ids, reference
):
    """A failover can route a request to the decode instance its first route used (the only
    one, when the prefill instance died). Both routes' work then runs there side by side under
    distinct engine ids; the failover's cancel (``attempt=0``) stops only the first, whose abort
    is tagged attempt 0, and the second completes with the reference tokens."""
    _, d = pd
    rid = "r-again"
    by_attempt: dict[int, list[TokenChunk]] = {0: [], 1: []}
    finished = {0: asyncio.Event(), 1: asyncio.Event()}

    async def on(msg):
        c = decode(msg.data, TokenChunk)
        by_attempt[c.attempt].append(c)
        if c.finish_reason:
            finished[c.attempt].set()

    sub = await nc.subscribe(subjects.req_out(rid), cb=on)
    first = _item(rid, prompt_ids).model_copy(
        update={"sampling": SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)}
    )
    await bus.request(nc, subjects.decode_submit("d-test"), first, SubmitAck)
    while not by_attempt[0]:  # the first route is decoding
        await asyncio.sleep(0.01)
    # the second route outlives the probes below (a 10-token route ended before its probe in a
    # full-suite run); greedy, so its first MAX_TOKENS tokens are the reference
    long = SamplingParams(max_tokens=30 * MAX_TOKENS, temperature=0.0, ignore_eos=True)
    again = _item(rid, prompt_ids).model_copy(update={"attempt": 1, "sampling": long})
    await bus.request(nc, subjects.decode_submit("d-test"), again, SubmitAck)
    assert sorted(d.svc.tasks) == [rid, f"{rid}#1"]
    # the gateway's probe of a silent stream sees both routes held, an unknown one not
    for attempt, held in ((0, True), (1, True), (5, False)):
        q = HeldQuery(request_id=rid, attempt=attempt)
        rep = await bus.request(nc, subjects.work_probe("d-test"), q, HeldReply)
        assert rep.held == held and rep.engine_steps > 0, (attempt, rep)
    cancel = Cancel(request_id=rid, reason="failover from p-dead: down", attempt=0)
    await bus.publish(nc, subjects.req_cancel(rid), cancel)
    await asyncio.wait_for(finished[0].wait(), 60)
    await asyncio.wait_for(finished[1].wait(), 60)
    await sub.unsubscribe()
    assert max(by_attempt[0], key=lambda c: c.index).finish_reason == "abort"
    second = _tokens(by_attempt[1])
    assert second[:MAX_TOKENS] == reference and len(second) == 30 * MAX_TOKENS
    assert max(by_attempt[1], key=lambda c: c.index).finish_reason == "length"
    await asyncio.sleep(0.2)
    assert d.svc.tasks == {} and d.rt.port.stats().running == 0
