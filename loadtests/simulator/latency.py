"""Decision latency of the real `SchedulerCore.route()` at cluster scale (default 1000 instances:
half prefill, half decode; a prefix index of shared prompt prefixes spread over them)."""

from __future__ import annotations

import random
import time

from loadtests.simulator.sim import pct
from services.scheduler.config import SchedulerConfig
from services.scheduler.core import SchedulerCore
from shared.protocol.kv import KVEvent
from shared.protocol.load import LoadReport
from shared.protocol.sched import RouteRequest


def decision_latency(
    num_instances: int = 1000,
    policy: str = "prefix_aware",
    prefixes: int = 2000,
    blocks: int = 64,
    requests: int = 3000,
    seed: int = 0,
) -> dict[str, float]:
    rng = random.Random(seed)
    cfg = SchedulerConfig.load([], role="scheduler", policy=policy, down_after=10**6)
    core = SchedulerCore(cfg)
    half = num_instances // 2
    ids = [f"p{i}" for i in range(half)] + [f"d{i}" for i in range(num_instances - half)]
    for iid in ids:
        role = "prefill" if iid[0] == "p" else "decode"
        core.on_load(
            LoadReport(
                instance_id=iid,
                role=role,
                incarnation="a",
                ts=0.0,
                grpc_addr="h:1",
                num_running=rng.randrange(0, 32),
                waiting_tokens=rng.randrange(0, 20000),
                kv_blocks_total=10000,
                kv_blocks_free=rng.randrange(1000, 10000),
                prefill_tokens_per_s=rng.choice([6000.0, 8000.0, 10000.0]),
            ),
            now=0.0,
        )
    chains = [[f"{k:x}.{j}" for j in range(blocks)] for k in range(prefixes)]
    seq = dict.fromkeys(ids, 0)
    for chain in chains:  # each prefix cached on 3 random instances, a random depth
        for iid in rng.sample(ids, 3):
            seq[iid] += 1
            core.on_kv_event(
                KVEvent(
                    instance_id=iid,
                    incarnation="a",
                    seq=seq[iid],
                    tier="engine",
                    kind="stored",
                    hashes=chain[: rng.randrange(1, blocks + 1)],
                )
            )
    lat: list[float] = []
    cpu: list[float] = []  # thread CPU time: excludes time the OS ran other processes
    for i in range(requests):
        hashes = rng.choice(chains)[: rng.randrange(1, blocks + 1)]
        req = RouteRequest(
            request_id=str(i), num_prompt_tokens=len(hashes) * 16 + 7, block_hashes=hashes
        )
        t0, c0 = time.perf_counter(), time.thread_time()
        core.route(req)
        lat.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        if i % 100 == 99:  # load reports arrive: optimistic pending work is cleared
            for m in core.members.members.values():
                m.view.pending_tokens = m.view.pending_requests = 0
                core.members.touch(m.view)
    return {
        "instances": num_instances,
        "index_blocks": len(core.index),
        "p50_ms": pct(lat, 0.5) * 1e3,
        "p99_ms": pct(lat, 0.99) * 1e3,
        "cpu_p50_ms": pct(cpu, 0.5) * 1e3,
        "cpu_p99_ms": pct(cpu, 0.99) * 1e3,
    }
