"""AutoPD on a real cluster (`strata up`-shaped: prefill=1, decode=2, real NATS, the tiny
default model): greedy streams run on both decode instances, then a burst of long prompts piles
up on the one prefill instance; the scheduler's planner flips a decode instance to prefill. That
instance drains (its streams finish there: no failover), serves prefill under its new role (its
prefill-submit handler counts requests), and every stream and burst request returns the tokens
of an in-process greedy reference with no flip."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import torch

from tests.cluster.conftest import API_KEY, AUTH, scrape, start_cluster
from tests.cluster.test_decode_failover import prompts, sse_chunks

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

STREAMS = 6
BURST = 10
WAVE = 4
LONG_TOKENS = 5000  # about, per burst prompt: ~0.7 s of prefill each on one thread
SHORT_MAX = 4
CHECKED_BURST = 2  # burst answers compared with the reference (all are checked for length)
STREAM_TOKENS = 1200  # outlast the order: at it, a stream had 200-230 of them (5x over)
PREFILL_SUBMITS = '{status="ok",subject="strata.prefill.*.submit"}'


def long_prompts(tok, n: int, offset: int) -> list[list[dict]]:
    out = []
    for i in range(offset, offset + n):
        words, text = [], ""
        k = 0
        while True:
            words.append(f"w{(i * 31 + k * 7) % 997}")
            k += 1
            if k % 200 == 0:
                text = f"Document {i}: " + " ".join(words)
                if len(tok.encode(text)) >= LONG_TOKENS:
                    break
        out.append([{"role": "user", "content": text}])
    return out


def reference(model_dir: str, msgs: list[list[dict]], max_tokens: int) -> list[list[str]]:
    """Greedy token texts per request from the same engine code in-process (no services)."""
    from shared.engine.engine import LLMEngine
    from shared.engine.params import EngineConfig
    from shared.model.loader import load_model
    from shared.model.tokenizer import Tokenizer
    from shared.protocol.sampling import SamplingParams

    tok = Tokenizer.from_dir(model_dir)
    engine = LLMEngine(load_model(model_dir), EngineConfig(kv_cache_bytes=256 << 20))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out: dict[str, list[str]] = {f"ref-{i}": [] for i in range(len(msgs))}
    with torch.inference_mode():
        for i, m in enumerate(msgs):
            ids = tok.encode(tok.apply_chat_template(m, add_generation_prompt=True))
            engine.add_request(f"ref-{i}", ids, params)
        while engine.has_unfinished_requests():
            for o in engine.step():
                out[o.request_id] += [
                    tok.decode([t], skip_special_tokens=False) for t in o.new_token_ids
                ]
    return [out[f"ref-{i}"] for i in range(len(msgs))]


async def stream(
    cl: httpx.AsyncClient, url: str, model: str, msgs: list[dict], progress: list[int], i: int
) -> list[str]:
    """The token texts of one greedy streamed chat completion."""
    body = {
        "model": model,
        "messages": msgs,
        "max_tokens": STREAM_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "logprobs": True,
        "top_logprobs": 0,
    }
    out: list[str] = []
    async for obj in sse_chunks(cl, url, body):
        for ch in obj["choices"]:
            for t in (ch.get("logprobs") or {}).get("content") or ():
                out.append(t["token"])
                progress[i] += 1
    return out


async def chat(cl: httpx.AsyncClient, url: str, model: str, msgs: list[dict]) -> list[str]:
    body = {
        "model": model,
        "messages": msgs,
        "max_tokens": SHORT_MAX,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 0,
    }
    r = await cl.post(url + "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return [t["token"] for t in r.json()["choices"][0]["logprobs"]["content"]]


def flips(c, name: str) -> float:
    return scrape(c, name, "strata_autopd_flips_total").get(
        '{from_role="decode",to_role="prefill"}', 0.0
    )


def running(c, name: str) -> float:
    return sum(scrape(c, name, "strata:engine_num_requests_running").values())


def ordered(c) -> float:
    return sum(scrape(c, "scheduler-0", "strata_scheduler_autopd_decisions_total").values())


def prefill_live(c) -> float:
    return scrape(c, "scheduler-0", "strata_scheduler_live_instances").get('{role="prefill"}', 0)


def test_burst_flips_a_decode_instance_to_prefill_without_losing_a_stream(default_model_dir):
    from shared.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_model_dir)
    streams = prompts()[:STREAMS]
    burst = long_prompts(tok, BURST, 0)
    wave = long_prompts(tok, WAVE, BURST)
    exp_streams = reference(default_model_dir, streams, STREAM_TOKENS)
    # the burst's first two (prefilled before the flip) and the wave (after it, some on the
    # flipped instance): a reference prefill costs ~1.8 s a prompt here, the rest only load
    checked = burst[:CHECKED_BURST] + wave
    exp_short = reference(default_model_dir, checked, SHORT_MAX)
    c = start_cluster(
        default_model_dir,
        prefill=1,
        decode=2,
        kvstore=0,
        vision=0,
        minio=False,
        torch_threads=1,
        env={
            "STRATA_API_KEYS": API_KEY,
            "STRATA_AUTOPD": "true",
            "STRATA_AUTOPD_HOLD_TICKS": "2",
            "STRATA_AUTOPD_COOLDOWN_TICKS": "100000",  # one flip in this test
        },
    )
    try:
        for _ in range(300):
            live = scrape(c, "scheduler-0", "strata_scheduler_live_instances")
            if live.get('{role="decode"}', 0) >= 2 and live.get('{role="prefill"}', 0) >= 1:
                break
            time.sleep(0.1)
        model = httpx.get(c.gateway_url + "/v1/models", headers=AUTH).json()["data"][0]["id"]
        url = c.gateway_url
        progress = [0] * STREAMS

        async def drive():
            limits = httpx.Limits(max_connections=STREAMS + BURST + WAVE)
            async with httpx.AsyncClient(timeout=300.0, headers=AUTH, limits=limits) as cl:
                ts = [
                    asyncio.create_task(stream(cl, url, model, streams[i], progress, i))
                    for i in range(STREAMS)
                ]
                while min(progress) < 2:  # every stream is decoding
                    await asyncio.sleep(0.05)
                held = [0.0]
                for _ in range(100):  # engine gauges follow every load interval
                    held = await asyncio.to_thread(
                        lambda: [running(c, n) for n in ("decode-0", "decode-1")]
                    )
                    if min(held) >= 1:
                        break
                    await asyncio.sleep(0.1)
                assert min(held) >= 1, held  # both decode instances hold streams
                bs = [asyncio.create_task(chat(cl, url, model, m)) for m in burst]
                for _ in range(2400):  # the scheduler orders the change
                    if await asyncio.to_thread(ordered, c):
                        break
                    await asyncio.sleep(0.05)
                # the premise: the streams were still live when the change was ordered
                assert not any(t.done() for t in ts), progress
                flipped = ""
                for _ in range(2400):
                    got = await asyncio.to_thread(
                        lambda: {n: flips(c, n) for n in ("decode-0", "decode-1")}
                    )
                    flipped = next((n for n, v in got.items() if v >= 1), "")
                    if flipped:
                        break
                    await asyncio.sleep(0.1)
                assert flipped, "no decode instance was flipped to prefill"
                for _ in range(300):  # the scheduler's view: the new role, routable
                    live = await asyncio.to_thread(prefill_live, c)
                    if live >= 2:
                        break
                    await asyncio.sleep(0.1)
                assert live == 2, live
                ws = [asyncio.create_task(chat(cl, url, model, m)) for m in wave]
                return flipped, await asyncio.gather(*ts), await asyncio.gather(*bs, *ws)

        flipped, got_streams, got_short = asyncio.run(drive())
        for i in range(STREAMS):  # every stream finished, token for token
            assert got_streams[i] == exp_streams[i], f"stream {i}"
        assert len(got_short) == BURST + WAVE and all(len(t) == SHORT_MAX for t in got_short)
        assert got_short[:CHECKED_BURST] + got_short[BURST:] == exp_short
        # drained, not failed over: no stream moved
        assert sum(scrape(c, "gateway-0", "strata:stream_failovers_total").values()) == 0
        other = "decode-1" if flipped == "decode-0" else "decode-0"
        assert flips(c, flipped) == 1 and flips(c, other) == 0
        assert scrape(c, flipped, "strata_autopd_role") == {
            '{role="decode"}': 0.0,
            '{role="prefill"}': 1.0,
        }
        # it switched once its streams had ended (it held some: decode submits before the flip)
        assert scrape(c, flipped, "strata_autopd_open_at_switch") == {"": 0.0}
        decode_submits = '{status="ok",subject="strata.decode.*.submit"}'
        assert scrape(c, flipped, "strata_handler_requests_total")[decode_submits] >= 1
        # it took prefill work under its new role
        handled = scrape(c, flipped, "strata_handler_requests_total").get(PREFILL_SUBMITS, 0)
        assert handled >= 1, scrape(c, flipped, "strata_handler_requests_total")
        live = scrape(c, "scheduler-0", "strata_scheduler_live_instances")
        assert (live['{role="prefill"}'], live['{role="decode"}']) == (2.0, 1.0)
        decisions = scrape(c, "scheduler-0", "strata_scheduler_autopd_decisions_total")
        assert decisions == {'{from_role="decode",to_role="prefill"}': 1.0}
    finally:
        c.stop()
