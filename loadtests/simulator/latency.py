"""Decision latency of the real `SchedulerCore.route()` at cluster scale (default 1000 instances:
half prefill, half decode; a prefix index of shared prompt prefixes spread over them), and the
memory the prefix index takes per indexed block.

    .venv/bin/python -m loadtests.simulator.latency --instances 10000 --index-blocks 1000000
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import time

from loadtests.simulator.sim import pct
from services.scheduler.config import SchedulerConfig
from services.scheduler.core import SchedulerCore
from shared.protocol.kv import KVEvent
from shared.protocol.load import LoadReport
from shared.protocol.sched import RouteRequest


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _chain(k: int, depth: int) -> list[str]:
    """Block hashes of prefix ``k`` (32 hex digits, like `hashing.to_hex`)."""
    return [f"{k:08x}{j:024x}" for j in range(depth)]


def decision_latency(
    num_instances: int = 1000,
    policy: str = "prefix_aware",
    prefixes: int = 2000,
    blocks: int = 64,
    requests: int = 3000,
    seed: int = 0,
    full_depth: bool = False,
) -> dict[str, float]:
    """Route ``requests`` through a core of ``num_instances`` whose index holds ``prefixes``
    chains of ``blocks`` blocks, each on 3 random instances at a random depth (``full_depth``:
    the first holder holds the whole chain, so the index has exactly prefixes x blocks)."""
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
    seq = dict.fromkeys(ids, 0)
    gc.collect()
    rss0 = _rss_bytes()
    for k in range(prefixes):  # each prefix cached on 3 random instances, a random depth
        for n, iid in enumerate(rng.sample(ids, 3)):
            seq[iid] += 1
            depth = blocks if full_depth and n == 0 else rng.randrange(1, blocks + 1)
            ev = KVEvent.model_construct(
                instance_id=iid,
                incarnation="a",
                seq=seq[iid],
                tier="engine",
                kind="stored",
                hashes=_chain(k, depth),
            )
            core.on_kv_event(ev)
    gc.collect()
    index_bytes = _rss_bytes() - rss0
    lat: list[float] = []
    cpu: list[float] = []  # thread CPU time: excludes time the OS ran other processes
    for i in range(requests):
        hashes = _chain(rng.randrange(prefixes), rng.randrange(1, blocks + 1))
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
    blocks_held = len(core.index)
    return {
        "instances": num_instances,
        "index_blocks": blocks_held,
        "index_mb": index_bytes / 1e6,
        "bytes_per_block": index_bytes / max(1, blocks_held),
        "p50_ms": pct(lat, 0.5) * 1e3,
        "p99_ms": pct(lat, 0.99) * 1e3,
        "cpu_p50_ms": pct(cpu, 0.5) * 1e3,
        "cpu_p99_ms": pct(cpu, 0.99) * 1e3,
    }


HEADER = (
    "| policy | instances | index blocks | index MB (RSS) | bytes/block | p50 ms | p99 ms | "
    "CPU p50 ms | CPU p99 ms |\n|---|---|---|---|---|---|---|---|---|"
)


def row(policy: str, d: dict[str, float]) -> str:
    return (
        f"| {policy} | {d['instances']} | {d['index_blocks']} | {d['index_mb']:.0f} | "
        f"{d['bytes_per_block']:.0f} | {d['p50_ms']:.3f} | {d['p99_ms']:.3f} | "
        f"{d['cpu_p50_ms']:.3f} | {d['cpu_p99_ms']:.3f} |"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=10000)
    ap.add_argument(
        "--index-blocks",
        type=int,
        default=1_000_000,
        help="distinct blocks in the index (chains of --blocks, full depth once)",
    )
    ap.add_argument("--blocks", type=int, default=64, help="blocks per prompt prefix")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--policies", default="round_robin,least_loaded,prefix_aware")
    a = ap.parse_args(argv)
    print(HEADER)
    for p in a.policies.split(","):
        d = decision_latency(
            a.instances,
            p,
            prefixes=a.index_blocks // a.blocks,
            blocks=a.blocks,
            requests=a.requests,
            full_depth=True,
        )
        print(row(p, d), flush=True)


if __name__ == "__main__":
    main()
