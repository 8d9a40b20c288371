"""AutoPD on real instances (in-process, real NATS, real engines): a `RoleChange` makes a decode
instance drain (its running stream finishes there, under the old role), then serve prefill under
a new incarnation: registry record, load reports and submit subjects all follow, and decode work
routed to it before the change still lands (the old subject lingers)."""

from __future__ import annotations

import asyncio

import pytest

from shared import bus
from shared.protocol import subjects
from shared.protocol.codec import decode
from shared.protocol.load import LoadReport
from shared.protocol.sampling import SamplingParams
from shared.protocol.sched import RoleChange
from shared.protocol.stream import TokenChunk
from shared.protocol.work import DecodeWork, PrefillWork, SubmitAck
from shared.registry import read_registry
from shared.worker.app import start_worker
from shared.worker.autopd import FLIPS, IGNORED
from shared.worker.config import WorkerConfig

MAX_TOKENS = 24
LONG = 300  # the stream running when the change comes outlasts the drain's settle time


@pytest.fixture(scope="module")
def model_dir():
    from services.cluster_config import ensure_model

    return ensure_model("")


@pytest.fixture(scope="module")
def prompt_ids(model_dir) -> list[int]:
    from shared.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": "Count to ten."}]))


@pytest.fixture(scope="module")
def long_reference(model_dir, prompt_ids) -> list[int]:
    from shared.engine.engine import LLMEngine
    from shared.engine.params import EngineConfig
    from shared.model.loader import load_model

    eng = LLMEngine(load_model(model_dir), EngineConfig(kv_cache_bytes=8 << 20))
    return eng.generate([prompt_ids], sampling(LONG))[0]


@pytest.fixture(scope="module")
def reference(long_reference) -> list[int]:
    return long_reference[:MAX_TOKENS]  # greedy: a prefix of the longer run


class Stream:
    """The chunks of one request; ``role_at_end``: the role of ``watch`` when it finished."""

    def __init__(self, watch=None) -> None:
        self.chunks: list[TokenChunk] = []
        self.done = asyncio.Event()
        self.first = asyncio.Event()
        self.watch = watch
        self.role_at_end = ""

    async def on(self, msg) -> None:
        c = decode(msg.data, TokenChunk)
        self.chunks.append(c)
        self.first.set()
        if c.finish_reason:
            self.role_at_end = self.watch.rt.role if self.watch else ""
            self.done.set()

    def tokens(self) -> list[int]:
        out: list[int] = []
        for c in sorted(self.chunks, key=lambda c: c.index):
            assert c.error is None, c.error
            assert c.index == len(out)
            out += c.token_ids
        return out


async def submit(nc, subject, item, watch=None) -> Stream:
    s = Stream(watch)
    await nc.subscribe(subjects.req_out(item.request_id), cb=s.on)
    await bus.request(nc, subject, item, SubmitAck)
    return s


def sampling(n: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


async def test_decode_instance_drains_then_serves_prefill(
    nats_url, nc, model_dir, prompt_ids, reference, long_reference
):
    common = dict(nats_url=nats_url, model=model_dir, kv_cache_bytes=8 << 20, load_interval=0.05)
    workers = []
    for role, iid in (("prefill", "ap-p0"), ("decode", "ap-d0"), ("decode", "ap-d1")):
        cfg = WorkerConfig.load([], role=role, instance_id=iid, **common)
        workers.append(await start_worker(cfg, role, nc=nc))
    p0, d0, d1 = workers
    reports: list[LoadReport] = []

    async def on_report(m) -> None:
        reports.append(decode(m.data, LoadReport))

    await nc.subscribe("strata.load.*.ap-d1", cb=on_report)
    flips0 = FLIPS.labels("decode", "prefill")._value.get()
    ignored0 = IGNORED._value.get()
    try:
        old_inc = d1.rt.incarnation
        # a stream decoding on d1 when the change comes
        running = await submit(
            nc,
            subjects.decode_submit("ap-d1"),
            DecodeWork(request_id="ap-r1", prompt_token_ids=prompt_ids, sampling=sampling(LONG)),
            watch=d1,
        )
        await asyncio.wait_for(running.first.wait(), 60)
        # a change for another incarnation (a restarted instance) is ignored
        stale = RoleChange(
            instance_id="ap-d1", incarnation="old", from_role="decode", to_role="prefill"
        )
        await bus.publish(nc, subjects.role_change("ap-d1"), stale)
        change = stale.model_copy(update={"incarnation": old_inc})
        await bus.publish(nc, subjects.role_change("ap-d1"), change)
        assert not running.done.is_set()  # the premise: d1 holds a live stream
        await asyncio.wait_for(running.done.wait(), 60)
        # the stream ran to its end on d1 before the flip: drained, not moved
        assert running.tokens() == long_reference
        assert running.role_at_end == "decode"
        assert {c.instance_id for c in running.chunks} == {"ap-d1"}
        for _ in range(600):  # the flip is counted once it re-registered (after the new role)
            if d1.rt.role == "prefill" and FLIPS.labels("decode", "prefill")._value.get() > flips0:
                break
            await asyncio.sleep(0.05)
        assert d1.rt.role == "prefill" and d1.rt.incarnation != old_inc
        assert FLIPS.labels("decode", "prefill")._value.get() == flips0 + 1
        assert IGNORED._value.get() == ignored0 + 1
        assert any(r.draining and r.role == "decode" for r in reports)  # it announced the drain
        rec = (await read_registry(nc.jetstream()))["ap-d1"]
        assert (rec.role, rec.incarnation) == ("prefill", d1.rt.incarnation)
        n = len(reports)
        for _ in range(100):
            if len(reports) > n and reports[-1].role == "prefill":
                break
            await asyncio.sleep(0.05)
        last = reports[-1]
        assert (last.role, last.incarnation, last.draining) == ("prefill", rec.incarnation, False)
        # d1 now prefills: its first token, then d0 decodes the rest
        pre = await submit(
            nc,
            subjects.prefill_submit("ap-d1"),
            PrefillWork(
                request_id="ap-r2",
                prompt_token_ids=prompt_ids,
                sampling=sampling(),
                decode_instance="ap-d0",
                decode_addr=d0.addr,
            ),
        )
        await asyncio.wait_for(pre.done.wait(), 60)
        assert pre.tokens() == reference
        first = min(pre.chunks, key=lambda c: c.index)
        assert first.instance_id == "ap-d1"
        assert max(pre.chunks, key=lambda c: c.index).instance_id == "ap-d0"
        # decode work routed to d1 before the change (its prompt prefilled elsewhere) still lands
        late = await submit(
            nc,
            subjects.decode_submit("ap-d1"),
            DecodeWork(request_id="ap-r3", prompt_token_ids=prompt_ids, sampling=sampling()),
        )
        await asyncio.wait_for(late.done.wait(), 60)
        assert late.tokens() == reference
    finally:
        for w in workers:
            await w.stop()
