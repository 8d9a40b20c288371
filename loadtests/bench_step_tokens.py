"""The engine's step token budget (``max_num_batched_tokens``) against TTFT and throughput.

    .venv/bin/python -m loadtests.bench_step_tokens [--budgets 2048,1024,512] [--repeats 2]
        [--model-size 25m|250m] [--streams 16] [--requests 128] [--prompt 256] [--out 64]

The decode instance's engine as `strata up` configures it (`WorkerConfig.engine_config`, this
box's device and threads) behind an `EnginePort` (its own thread, requests from asyncio), one
budget at a time, the budgets' order alternated per repeat. Per run: ``--streams`` closed-loop
clients send ``--requests`` prompts of ``--prompt`` random tokens for ``--out`` tokens each
(greedy, EOS ignored); the client-side time to the first output is the TTFT. Then one lone
prompt of 2048 and one of 3800 tokens (``max_tokens=1``), alone in the engine: what a smaller
chunk costs a long prompt. Prints one markdown table (docs/benchmarks/engine.md).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import random
import statistics
import time

from loadtests.bench_peer import cpu_name, model_for
from loadtests.loadgen.stats import percentile


def run(port, rng, a) -> dict:
    from shared.protocol.sampling import SamplingParams

    sp = SamplingParams(max_tokens=a.out, temperature=0.0, ignore_eos=True)
    ttft: list[float] = []
    todo = list(range(a.requests))

    async def client() -> None:
        while todo:
            i = todo.pop()
            prompt = [rng.randrange(10, 2000) for _ in range(a.prompt)]
            t0, first = time.perf_counter(), None
            async for o in port.generate(f"r{i}-{time.monotonic_ns()}", prompt, sp):
                if first is None and o.new_token_ids:
                    first = time.perf_counter() - t0
            ttft.append(first or 0.0)

    async def lone(n: int) -> float:
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        prompt = [rng.randrange(10, 2000) for _ in range(n)]
        t0 = time.perf_counter()
        async for _ in port.generate(f"lone{n}-{time.monotonic_ns()}", prompt, one):
            pass
        return time.perf_counter() - t0

    async def main() -> dict:
        t0, s0 = time.perf_counter(), port.stats().steps
        await asyncio.gather(*(client() for _ in range(a.streams)))
        wall = time.perf_counter() - t0
        steps = port.stats().steps - s0
        return {
            "tok_s": a.requests * a.out / wall,
            "steps": steps,
            "ttft_mean": statistics.mean(ttft),
            "ttft_p50": percentile(ttft, 50),
            "ttft_p99": percentile(ttft, 99),
            "lone_2048": await lone(2048),
            "lone_3800": await lone(3800),
            "load": os.getloadavg()[0],
        }

    return asyncio.run(main())


def main() -> None:
    from shared.engine.port import EnginePort
    from shared.model.loader import load_model
    from shared.worker.config import WorkerConfig
    from shared.worker.kv_budget import kv_budget_for

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="2048,1024,512", help="max_num_batched_tokens values")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--model-size", choices=["25m", "250m"], default="25m")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--out", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (strata up's on 2 cores)")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    budgets = [int(b) for b in a.budgets.split(",") if b.strip()]
    model_dir = os.path.abspath(model_for(a.model_size))
    wcfg = WorkerConfig.load([], role="decode", instance_id="bench", model=model_dir)
    loaded = load_model(model_dir)
    base = wcfg.engine_config(kv_budget_for(wcfg, loaded)[0])
    rows: dict[int, list[dict]] = {b: [] for b in budgets}
    rng = random.Random(0)
    for rep in range(a.repeats):
        for b in budgets if rep % 2 == 0 else budgets[::-1]:
            cfg = dataclasses.replace(base, max_num_batched_tokens=b)
            port = EnginePort.open(loaded, cfg, warm_up_tokens=64)
            try:
                rows[b].append(run(port, rng, a))
            finally:
                port.shutdown()
    print(
        f"{cpu_name()}, {os.cpu_count()} cores, {a.threads} torch threads; model "
        f"{os.path.basename(model_dir)}; {a.streams} streams x {a.requests} requests of "
        f"{a.prompt} tokens, {a.out} out; default budget here {base.max_num_batched_tokens}\n"
    )
    print(
        "| max_num_batched_tokens | runs | out tok/s (median, spread) | steps | TTFT mean / p50 / "
        "p99 (ms) | lone 2048 / 3800-token prompt TTFT (ms) | load avg |"
    )
    print("| ---: | ---: | --- | ---: | --- | --- | --- |")
    for b, rs in rows.items():

        def med(k: str, rs=rs) -> float:
            return statistics.median(r[k] for r in rs)

        tok = [r["tok_s"] for r in rs]
        print(
            f"| {b} | {len(rs)} | {med('tok_s'):.0f} ({min(tok):.0f}-{max(tok):.0f}) | "
            f"{med('steps'):.0f} | {1000 * med('ttft_mean'):.0f} / {1000 * med('ttft_p50'):.0f} "
            f"/ {1000 * med('ttft_p99'):.0f} | {1000 * med('lone_2048'):.0f} / "
            f"{1000 * med('lone_3800'):.0f} | {max(r['load'] for r in rs):.2f} |"
        )


if __name__ == "__main__":
    main()
