"""The KV pool in the colocated shape: decode instances that compute their prompts themselves
(no prefill instance), over real NATS, real gRPC, a real kvstore and MinIO.

With ``kv_pool_save=all`` every full block a decode instance computes is written through to the
pool; with ``reused`` (a CPU box's default) only blocks that recur are, and the rest at a graceful
stop. Another instance (or the same one after a restart, or after the prefix left its engine
memory) loads that prefix from the pool instead of recomputing it. Recompute gives the same
tokens, so each test asserts on the counters that say which path ran: pool bytes received, the
connector's load decisions, the blocks the save policy recorded and those the pool accepted.
"""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

from shared.protocol import subjects
from shared.protocol.sampling import SamplingParams
from shared.protocol.work import DecodeWork
from tests.worker.conftest import kv_workers
from tests.worker.kv_counters import Transfers, kv_bytes
from tests.worker.test_pd import _run, _tokens


def tokens(seed: int, n: int) -> list[int]:
    """A prompt no other test uses: the kvstore's MinIO bucket lives for the whole session."""
    return [(i * 37 + seed * 1009 + 11) % 2000 + 10 for i in range(n)]


PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _count(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def decisions() -> dict[str, float]:
    from shared.worker.pool_link import DECISIONS

    return {d: _count("strata_kv_pool_load_decisions_total", decision=d) for d in DECISIONS}


def stored(source: str) -> float:
    return _count("strata_prefix_pool_stored_blocks_total", source=source)


def recorded(iid: str, reason: str) -> float:
    return _count(
        "strata_kv_pool_recorded_blocks_total", role="decode", instance=iid, reason=reason
    )


def work(rid: str, prompt: list[int], **kw) -> DecodeWork:
    return DecodeWork(request_id=rid, prompt_token_ids=prompt, sampling=PARAMS, **kw)


async def wait_in_pool(
    w, prompt: list[int], blocks: int, timeout: float = 10.0, salt: str = ""
) -> None:
    link = w.rt.pool_link()
    hashes = (await w.rt.port.match_prefix(prompt, (), salt)).hashes[:blocks]
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if all(t is not None for t in await link.pool.lookup(hashes, link.fingerprint)):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the pool never got the {blocks} blocks {w.rt.cfg.instance_id} computed")


@pytest.fixture
async def two_decodes(nats_url, nc, model_dir, kvstore):
    """Two decode instances with the pool, no prefill instance (the colocated shape), every
    computed block written through (``all``); loading forced on (``always``), so the tests do
    not depend on this machine's measured costs."""
    _, addr = kvstore
    specs = [("decode", "ca", {}), ("decode", "cb", {})]
    async with kv_workers(
        nc, nats_url, model_dir, addr, specs, kv_pool_load="always", kv_pool_save="all"
    ) as ws:
        yield ws


@pytest.fixture
async def two_cpu_decodes(nats_url, nc, model_dir, kvstore):
    """`two_decodes` with the save policy a CPU box gets by default (``reused``)."""
    _, addr = kvstore
    specs = [("decode", "ra", {}), ("decode", "rb", {})]
    async with kv_workers(nc, nats_url, model_dir, addr, specs, kv_pool_load="always") as ws:
        assert ws[0].rt.cfg.kv_pool_save == "reused"
        yield ws


async def in_pool(w, prompt: list[int], blocks: int) -> list[bool]:
    link = w.rt.pool_link()
    hashes = (await w.rt.port.match_prefix(prompt)).hashes[:blocks]
    return [t is not None for t in await link.pool.lookup(hashes, link.fingerprint)]


async def test_default_cpu_policy_pools_a_recurring_prefix_not_a_one_off_prompt(
    two_cpu_decodes, nc
):
    """``reused``: a prompt served once stays in engine memory only (no copy, no kvstore
    work); a second request that shares its prefix gets the prefix's blocks recorded (reason
    ``reused``) and pooled, and another instance loads them from there."""
    ra, rb = two_cpu_decodes
    prefix = tokens(91, 160)  # 10 full blocks
    await _run(nc, subjects.decode_submit("ra"), work("r-1", prefix + [5, 6, 7]))
    await asyncio.sleep(1.0)  # five housekeeping ticks: nothing offered
    assert await in_pool(ra, prefix, 10) == [False] * 10
    assert recorded("ra", "reused") == 0
    await _run(nc, subjects.decode_submit("ra"), work("r-2", prefix + [8, 9]))
    await wait_in_pool(ra, prefix, 10)
    assert recorded("ra", "reused") == 10
    t, d = Transfers(), decisions()
    got = await _run(nc, subjects.decode_submit("rb"), work("r-3", prefix + [1, 2, 3, 4]))
    assert t.moved().get("received:pool") == kv_bytes(rb.rt, 160)
    assert decisions()["load"] - d["load"] == 1
    assert max(got, key=lambda c: c.index).usage.cached_tokens == 160


async def test_graceful_stop_hands_the_pool_what_engine_memory_holds(
    nats_url, nc, model_dir, kvstore, monkeypatch
):
    """``reused`` holds a one-off prompt's blocks back while serving; stopping the instance
    gracefully offers them (source ``shutdown``), a few blocks per copy out of the engine, so a
    restart finds them. With the flush off (``kv_pool_flush_s=0``) they are lost with the
    process."""
    from shared.engine.port import EnginePort
    from shared.worker import pool_link

    monkeypatch.setattr(pool_link, "FLUSH_BATCH", 4)
    copied: list[int] = []
    drain = EnginePort.drain_computed

    async def counted(self, limit: int = 0):
        got = await drain(self, limit)
        copied.append(len(got)) if got else None
        return got

    monkeypatch.setattr(EnginePort, "drain_computed", counted)
    _, addr = kvstore
    for flush, seed in ((5.0, 93), (0.0, 94)):
        prompt = tokens(seed, 96)  # 6 full blocks
        before = stored("shutdown")
        specs = [("decode", f"stop-{seed}", {"kv_pool_flush_s": flush})]
        async with kv_workers(nc, nats_url, model_dir, addr, specs) as (w,):
            await _run(nc, subjects.decode_submit(f"stop-{seed}"), work(f"s-{seed}", prompt))
            await asyncio.sleep(0.6)
            assert await in_pool(w, prompt, 6) == [False] * 6
            link, hashes = w.rt.pool_link(), (await w.rt.port.match_prefix(prompt)).hashes[:6]
        got = [t is not None for t in await link.pool.lookup(hashes, link.fingerprint)]
        assert got == [flush > 0] * 6, flush
        assert stored("shutdown") - before == (6 if flush else 0)
        if flush:
            assert sum(copied) == 6 and max(copied) == 4, copied  # in batches, all of them


async def test_prefix_written_through_by_a_is_loaded_by_b(two_decodes, nc):
    ca, cb = two_decodes
    prefix = tokens(71, 160)  # 10 full blocks
    p1, p2 = prefix + [5, 6, 7], prefix + [21, 22, 23, 24]
    before = stored("computed")
    ref = await _run(nc, subjects.decode_submit("ca"), work("w-a", p1))
    # write-through: the 10 prompt blocks reach the pool with no eviction and no prefill
    await wait_in_pool(ca, p1, 10)
    assert stored("computed") - before >= 10

    t, d = Transfers(), decisions()
    used = cb.rt.port.stats().external_blocks.get("used", 0)
    got = await _run(nc, subjects.decode_submit("cb"), work("w-b", p2))
    moved = t.moved()
    assert moved.get("received:pool") == kv_bytes(cb.rt, 160)
    # b's scheduler took the 10 blocks in at the request's admission, like a prefix hit
    assert cb.rt.port.stats().external_blocks["used"] - used == 10
    assert moved.get("kvstore_hits:dram") == 10
    assert decisions()["load"] - d["load"] == 1
    last = max(got, key=lambda c: c.index)
    assert last.usage.cached_tokens == 160  # b computed only the 4 new tokens

    # the same tokens as a's, which computed p2's new tail over its own cached prefix
    assert _tokens(got) == _tokens(await _run(nc, subjects.decode_submit("ca"), work("w-a2", p2)))
    assert len(_tokens(ref)) == PARAMS.max_tokens


async def test_cache_salt_isolates_engine_memory_and_the_pool(two_decodes, nc):
    """vLLM's ``cache_salt``: a salted prompt shares no cached block with the same prompt
    unsalted (engine memory or pool) nor with another salt, only with the same salt, on any
    instance: its blocks are written through under the salted hashes and loaded from there."""
    ca, cb = two_decodes
    prefix = tokens(83, 160)  # 10 full blocks
    p1, p2 = prefix + [5, 6, 7], prefix + [21, 22, 23, 24]

    def salted(rid: str, prompt: list[int], salt: str) -> DecodeWork:
        params = PARAMS.model_copy(update={"cache_salt": salt})
        return DecodeWork(request_id=rid, prompt_token_ids=prompt, sampling=params)

    def cached(chunks) -> int:
        return max(chunks, key=lambda c: c.index).usage.cached_tokens

    ref = await _run(nc, subjects.decode_submit("ca"), work("s-plain", p1))
    await wait_in_pool(ca, p1, 10)  # the unsalted blocks: in ca's memory and in the pool
    d = decisions()
    got = await _run(nc, subjects.decode_submit("ca"), salted("s-1", p1, "tenant-1"))
    assert cached(got) == 0  # neither ca's prefix cache nor the pool served it
    assert decisions()["miss"] - d["miss"] == 1
    assert _tokens(got) == _tokens(ref)  # the salt changes what is shared, never the output

    await wait_in_pool(ca, p1, 10, salt="tenant-1")  # written through under the salted hashes
    t, d = Transfers(), decisions()
    got = await _run(nc, subjects.decode_submit("cb"), salted("s-2", p2, "tenant-1"))
    assert cached(got) == 160 and decisions()["load"] - d["load"] == 1
    assert t.moved().get("received:pool") == kv_bytes(cb.rt, 160)
    d = decisions()
    got = await _run(nc, subjects.decode_submit("cb"), salted("s-3", p1, "tenant-2"))
    assert cached(got) == 0 and decisions()["miss"] - d["miss"] == 1


async def test_a_route_that_lists_no_pool_block_skips_the_lookup(two_decodes, nc):
    """``pool_blocks`` 0 on the work (the scheduler's index places none of the prompt's blocks
    in the pool): decode computes without asking the kvstore, even where the pool does hold
    the prefix (a stale index costs a recompute, never a wrong token); a positive count (or -1,
    not known) looks it up and loads as before."""
    ca, cb = two_decodes
    unlisted, listed = tokens(75, 160), tokens(76, 160)
    for i, prefix in enumerate((unlisted, listed)):
        await _run(nc, subjects.decode_submit("ca"), work(f"u-a{i}", prefix + [5]))
        await wait_in_pool(ca, prefix, 10)
    t, d = Transfers(), decisions()
    cold = await _run(nc, subjects.decode_submit("cb"), work("u-b0", unlisted + [6], pool_blocks=0))
    after = decisions()
    assert after["unlisted"] - d["unlisted"] == 1
    assert all(after[k] == d[k] for k in ("miss", "load", "recompute"))  # no lookup ran
    assert "received:pool" not in t.moved()
    assert max(cold, key=lambda c: c.index).usage.cached_tokens == 0  # computed in full
    t, d = Transfers(), decisions()
    got = await _run(nc, subjects.decode_submit("cb"), work("u-b1", listed + [7], pool_blocks=10))
    assert decisions()["load"] - d["load"] == 1 and decisions()["unlisted"] == d["unlisted"]
    assert t.moved().get("received:pool") == kv_bytes(cb.rt, 160)
    assert max(got, key=lambda c: c.index).usage.cached_tokens == 160


async def test_prefix_evicted_from_engine_memory_is_reloaded(nats_url, nc, model_dir, kvstore):
    """A small engine cache and the CPU default policy: a prefix two requests shared is pooled,
    other prompts evict it, and a later request loads it back from the pool rather than
    recomputing it."""
    _, addr = kvstore
    specs = [("decode", "small", {"kv_cache_bytes": 2 << 20})]  # ~32 blocks
    prefix = tokens(73, 160)
    async with kv_workers(nc, nats_url, model_dir, addr, specs, kv_pool_load="always") as (w,):
        total = w.rt.port.stats().kv_blocks_total
        await _run(nc, subjects.decode_submit("small"), work("e-0", prefix + [1, 2]))
        await _run(nc, subjects.decode_submit("small"), work("e-00", prefix + [1]))
        await wait_in_pool(w, prefix, 10)
        # fill the engine with other prompts until the prefix is gone from its memory
        i = 0
        while (await w.rt.port.match_prefix(prefix)).cached_tokens > 0:
            filler = tokens(80 + i, 16 * (total // 3))
            await _run(nc, subjects.decode_submit("small"), work(f"e-fill-{i}", filler))
            i += 1
            assert i < 10, "the prefix never left engine memory"
        t, d = Transfers(), decisions()
        got = await _run(nc, subjects.decode_submit("small"), work("e-1", prefix + [3, 4]))
        assert t.moved().get("received:pool") == kv_bytes(w.rt, 160)
        assert decisions()["load"] - d["load"] == 1
        assert max(got, key=lambda c: c.index).usage.cached_tokens == 160


async def test_cost_model_decides_load_or_recompute(two_decodes, nc):
    """``auto`` loads only what the measured costs say is cheaper than recomputing: with
    recompute made expensive the prefix is loaded, with it made cheap it is recomputed (the
    decision is counted either way)."""
    ca, cb = two_decodes
    prefix = tokens(74, 160)
    await _run(nc, subjects.decode_submit("ca"), work("c-a", prefix + [9]))
    await wait_in_pool(ca, prefix, 10)
    link = cb.rt.pool_link()
    link.load_mode = "auto"
    link.cost.prefill_s_per_token = 1e-9  # recompute far cheaper than any pool read
    t, d = Transfers(), decisions()
    await _run(nc, subjects.decode_submit("cb"), work("c-b1", prefix + [8]))
    assert "received:pool" not in t.moved()
    assert decisions()["recompute"] - d["recompute"] == 1

    # a prefix b does not hold yet, and recompute made expensive
    other = tokens(72, 96)
    await _run(nc, subjects.decode_submit("ca"), work("c-a2", other + [7]))
    await wait_in_pool(ca, other, 6)
    link.cost.prefill_s_per_token = 1.0
    t, d = Transfers(), decisions()
    await _run(nc, subjects.decode_submit("cb"), work("c-b2", other + [6]))
    assert t.moved().get("received:pool") == kv_bytes(cb.rt, 96)
    assert decisions()["load"] - d["load"] == 1


@pytest.mark.parametrize("damage", ["truncated", "other_shape"])
async def test_bad_pool_block_is_counted_and_recomputed(two_decodes, nc, kvstore, damage):
    """A pool object that is not this engine's block (bytes cut short, or another model's
    shape under the same hash): the prompt is computed from that block on, the block is counted,
    the stream is served with the same tokens and no error."""
    import torch

    from shared.kvtransfer.client import get_client
    from shared.kvtransfer.frames import tensor_to_frames

    ca, _ = two_decodes
    _, addr = kvstore
    link = ca.rt.pool_link()
    prompt = tokens(75 + (damage == "other_shape"), 48)  # 3 full blocks
    hashes = (await ca.rt.port.match_prefix(prompt)).hashes
    L, two, bs, kvh, hd = link.block_shape
    shape = (L, two, bs, kvh, hd) if damage == "truncated" else (L, two, bs, kvh + 1, hd)
    frames = list(tensor_to_frames(torch.ones(shape), key=hashes[0], fingerprint=link.fingerprint))
    if damage == "truncated":
        frames[0].data = frames[0].data[:-64]
    await get_client(addr).push(iter(frames), timeout=10)
    assert (await link.pool.lookup(hashes[:1], link.fingerprint))[0] is not None

    bad = _count("strata_kv_pool_bad_blocks_total")
    t = Transfers()
    got = await _run(nc, subjects.decode_submit("ca"), work(f"bad-{damage}", prompt + [3]))
    assert _count("strata_kv_pool_bad_blocks_total") - bad == 1
    assert "received:pool" not in t.moved()
    ref = await _run(nc, subjects.decode_submit("ca"), work(f"bad-{damage}-ref", prompt + [3]))
    assert _tokens(got) == _tokens(ref) and len(_tokens(ref)) == PARAMS.max_tokens


async def test_failed_over_stream_continues_from_blocks_written_through(two_decodes, nc):
    """A stream resumed on another instance (as the gateway fails one over: the prompt plus the
    tokens already sent) loads the blocks the first instance wrote through, generated tokens'
    blocks included, instead of recomputing its context; the rest of the stream is identical."""
    from tests.worker.test_pd import _tokens_from

    ca, cb = two_decodes
    prompt = tokens(77, 40)  # 2 full blocks + 8 tokens
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    full = _tokens(
        await _run(
            nc,
            subjects.decode_submit("ca"),
            DecodeWork(request_id="fo-a", prompt_token_ids=prompt, sampling=params),
        )
    )
    await wait_in_pool(ca, prompt + full, 4)  # 79 tokens computed: 4 full blocks, 2 of output
    sent = 30  # the dead instance had streamed this many tokens
    t = Transfers()
    resumed = DecodeWork(
        request_id="fo-b", prompt_token_ids=prompt, sampling=params, output_token_ids=full[:sent]
    )
    chunks = await _run(nc, subjects.decode_submit("cb"), resumed)
    assert t.moved().get("received:pool") == kv_bytes(cb.rt, 64)  # 40 + 30 tokens: 4 blocks
    assert _tokens_from(chunks, sent) == full[sent:]
