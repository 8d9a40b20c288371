"""A decode process of the default colocated shape, with 2 torch threads, keeps one OpenMP
team: its threads do not sleep and wake per parallel region (shared/omp.py). And every service
process of that cluster froze its start-up heap out of the garbage collector's view
(shared/heap.py), so no full collection walks the model, the schemas or the modules.

A second team anywhere in the process (the thread that loaded the model and ran the warm-up
forward, the event loop copying a KV block) makes libgomp stop spinning, and every parallel
region of a step then puts the engine's team to sleep and wakes it: tens of voluntary context
switches per step instead of a few. The test counts the decode process's voluntary context
switches (/proc) per engine step (the step counter) over a decode-heavy run. With the model
loaded on a thread that stays (``asyncio.to_thread``, as before) it fails. That the loop thread
leads no team is `tests/shared/test_omp.py`'s."""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.cluster_kv.conftest import SHARED_PREFIX, metric, start_cluster, wait_until

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]

MAX_SWITCHES_PER_STEP = 15  # one team: ~3 (measured); a second team: 40 and more


def voluntary_switches(pid: int) -> int:
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches:"):
                        total += int(line.split()[1])
        except FileNotFoundError:
            continue  # a thread that ended meanwhile
    return total


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    c = start_cluster(
        model_dir,
        data_dir=str(tmp_path_factory.mktemp("omp") / "c"),
        prefill=0,
        torch_threads=2,
        env={},
    )
    yield c
    c.stop()


def test_decode_process_keeps_one_openmp_team(cluster):
    c = cluster
    client = openai.OpenAI(base_url=c.gateway_url + "/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id

    def complete(prompt: str, n: int) -> int:
        r = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=n,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        return r.usage.completion_tokens

    complete(SHARED_PREFIX + "Which tier is fastest?", 4)
    pid = c.sup.procs["decode-0"].proc.pid
    steps0 = metric(c, "decode-0", "strata:engine_steps_total")
    v0 = voluntary_switches(pid)
    with ThreadPoolExecutor(4) as pool:
        prompts = [f"Request {i} asks for a long answer about tiers." for i in range(4)]
        tokens = sum(pool.map(lambda p: complete(p, 96), prompts))
    v1 = voluntary_switches(pid)
    assert tokens == 4 * 96
    wait_until(
        lambda: metric(c, "decode-0", "strata:engine_steps_total") - steps0 >= 96,
        30,
        "the engine's step counter",
    )
    steps = metric(c, "decode-0", "strata:engine_steps_total") - steps0
    per_step = (v1 - v0) / steps
    assert per_step < MAX_SWITCHES_PER_STEP, (v1 - v0, steps)


def test_every_service_froze_its_startup_heap(cluster):
    services = [n for n, spec in cluster.specs.items() if spec.env.get("STRATA_METRICS_PORT")]
    assert {"gateway-0", "tokenizer-0", "scheduler-0", "decode-0", "kvstore-0"} <= set(services)
    for name in services:
        # tens of thousands in the lightest service (measured: scheduler 47k, decode 394k)
        assert metric(cluster, name, "strata_gc_frozen_objects") > 20_000, name
