"""Overload with SLO classes: batch requests arrive at about 3x what the prefill instance can
sustain; the scheduler's degradation level rises, batch requests get 429 + Retry-After while
interactive requests are never refused, and the level falls back to 0 once the load drops.
Behaviour only: the interactive TTFT under this load is speed, measured by the loadgen benchmark
(`python -m loadtests.loadgen`, docs/LOADTESTS.md), not asserted here."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from loadtests.loadgen.workload import words
from shared.model.tokenizer import Tokenizer
from tests.cluster.conftest import StateWatcher, start_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

BATCH_WORDS = 1200  # about 1200 prompt tokens: the unit of prefill work
PHASE_S = 10.0


async def send(
    cl: httpx.AsyncClient, url: str, model: str, prompt: str, cls: str, prio: int
) -> tuple[int, float, str]:
    """(status, TTFT seconds, Retry-After header) of one streamed completion."""
    t0 = time.perf_counter()
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"X-Strata-Slo-Class": cls, "X-Strata-Priority": str(prio)}
    async with cl.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, 0.0, r.headers.get("retry-after", "")
        ttft = 0.0
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and not ttft:
                ttft = time.perf_counter() - t0
        return 200, ttft, ""


def measured_rate(model_dir: str) -> float:
    """Sustainable batch requests/s of one prefill instance: its prefill time for one prompt."""
    import torch

    from shared.engine.engine import LLMEngine
    from shared.engine.params import EngineConfig
    from shared.model.loader import load_model
    from shared.protocol.sampling import SamplingParams

    torch.set_num_threads(1)
    engine = LLMEngine(load_model(model_dir), EngineConfig(enable_prefix_caching=False))
    ids = Tokenizer.from_dir(model_dir).encode(" ".join(words(random.Random(9), BATCH_WORDS)))
    engine.generate([ids[:64]], SamplingParams(max_tokens=1))  # warm-up
    t0 = time.perf_counter()
    engine.generate([ids], SamplingParams(max_tokens=4, temperature=0.0))
    return 1.0 / (time.perf_counter() - t0)


def test_overload_refuses_batch_keeps_interactive_slo_and_recovers(default_model_dir):
    rate = 3.0 * measured_rate(default_model_dir)
    c = start_cluster(
        default_model_dir,
        prefill=1,
        decode=1,
        kvstore=0,
        vision=0,
        minio=False,
        torch_threads=1,
        role_args={
            "scheduler": [
                "--policy",
                "prefix_aware",
                "--short-prompt-tokens",
                "0",
                "--queue-target-s",
                "1.0",
                "--degrade-dwell-s",
                "1.0",
            ]
        },
    )
    watcher = StateWatcher(c.nats_url, c.nats_credentials("gateway"))
    try:
        url = c.gateway_url
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        rng = random.Random(0)

        async def run() -> tuple[list, list]:
            batch, inter = [], []
            async with httpx.AsyncClient(
                timeout=120.0, limits=httpx.Limits(max_connections=200)
            ) as cl:
                tasks = []
                t_end = time.perf_counter() + PHASE_S
                next_inter = time.perf_counter() + 1.0
                while time.perf_counter() < t_end:
                    prompt = " ".join(words(rng, BATCH_WORDS))  # unique: no prefix hits
                    tasks.append(
                        ("b", asyncio.create_task(send(cl, url, model, prompt, "batch", 1)))
                    )
                    if time.perf_counter() >= next_inter:
                        next_inter += 1.0
                        prompt = " ".join(words(rng, 24))
                        tasks.append(
                            (
                                "i",
                                asyncio.create_task(send(cl, url, model, prompt, "interactive", 0)),
                            )
                        )
                    await asyncio.sleep(rng.expovariate(rate))
                for kind, t in tasks:
                    (batch if kind == "b" else inter).append(await t)
            return batch, inter

        t_start = time.monotonic()
        batch, inter = asyncio.run(run())
        peak = watcher.max_level(since=t_start)
        assert peak >= 2, f"degradation never refused batch (levels {watcher.levels[-20:]})"
        refused = [b for b in batch if b[0] == 429]
        assert refused, f"no batch request got 429 out of {len(batch)}"
        assert all(float(ra) > 0 for _, _, ra in refused)  # Retry-After is set
        assert all(s in (200, 429) for s, _, _ in batch), batch
        assert len(inter) >= 5
        assert all(s == 200 and t > 0 for s, t, _ in inter), inter  # never refused, streamed
        # load dropped (only the admitted backlog drains): the level steps back down to 0
        deadline = time.monotonic() + 60
        while watcher.level > 0:
            assert time.monotonic() < deadline, f"level stuck at {watcher.level}"
            time.sleep(0.2)
        prompt = " ".join(words(rng, BATCH_WORDS))
        status, _, _ = asyncio.run(_one(url, model, prompt))
        assert status == 200  # batch is admitted again
    finally:
        watcher.close()
        c.stop()


async def _one(url: str, model: str, prompt: str):
    async with httpx.AsyncClient(timeout=120.0) as cl:
        return await send(cl, url, model, prompt, "batch", 1)
