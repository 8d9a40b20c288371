"""Memory touched for the first time inside a step: the KV cache's pages faulted in while idle
(`shared.engine.prefault`) and the one-call layer's scratch reused (`cpu_kernels.layer_scratch`),
each against its old behaviour, in one process, alternated, behind docs/benchmarks/engine.md
"Memory first touched inside a step".

    .venv/bin/python -m loadtests.bench_prefault [--rounds 10] [--model-size 25m|250m]

KV: two engines built as the decode worker builds them (auto KV budget, step budget 512 on
CPU), one with ``kv_prefault_bytes`` at its default and one with 0. Each round, each engine
(order flipped every round) first does what `EnginePort` does while no request is unfinished
(`LLMEngine.idle_work` until it has nothing left; timed apart, it is idle time), then serves a
burst of 16 fresh 256-token prompts with 64 output tokens each (every round writes blocks no
earlier round touched, as a cache that is still filling does). Scratch: one engine with the KV
cache already resident, an 8 x 256-token prefill with the scratch reused or allocated fresh per
forward, alternated. Medians, spreads and the load average.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import time

import torch


def main() -> None:
    from loadtests.bench_peer import cpu_name, model_for
    from shared.engine.engine import LLMEngine
    from shared.model import cpu_kernels
    from shared.model.loader import load_model
    from shared.protocol.sampling import SamplingParams
    from shared.worker.config import WorkerConfig
    from shared.worker.kv_budget import kv_budget_for

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model-size", choices=("25m", "250m"), default="25m")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    loaded = load_model(model_for(a.model_size))
    wcfg = WorkerConfig.load([], role="decode")
    base = wcfg.engine_config(kv_budget_for(wcfg, loaded)[0])
    rng = random.Random("prefault")
    vocab = min(loaded.config.vocab_size, 2000)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    burst = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    loads = [os.getloadavg()[0]]
    kv = {"prefault": [], "first touch in the step": []}
    idle = dict.fromkeys(kv, 0.0)
    engines = {
        "prefault": LLMEngine(loaded, base),
        "first touch in the step": LLMEngine(
            loaded, dataclasses.replace(base, kv_prefault_bytes=0)
        ),
    }
    with torch.inference_mode():
        for e in engines.values():
            e.generate([prompt(64)], one)
        for r in range(a.rounds):
            for name in list(engines)[:: 1 if r % 2 else -1]:
                e = engines[name]
                t = time.perf_counter()
                while e.idle_work():
                    pass
                idle[name] += time.perf_counter() - t
                ps = [prompt(256) for _ in range(16)]
                t = time.perf_counter()
                e.generate(ps, burst)
                kv[name].append((time.perf_counter() - t) * 1e3)
            loads.append(os.getloadavg()[0])
        for e in engines.values():
            e.close()
        # the scratch: KV resident (prefault off, written once), fresh or reused per forward
        e = LLMEngine(loaded, dataclasses.replace(base, max_num_batched_tokens=2048))
        e.runner.kv.k.zero_()
        e.runner.kv.v.zero_()
        reuse, fresh = cpu_kernels.layer_scratch, lambda n: torch.empty(n, dtype=torch.float32)
        scratch = {"reused": [], "fresh per forward": []}
        e.generate([prompt(64)], one)
        for r in range(a.rounds):
            for name, fn in list(zip(scratch, (reuse, fresh), strict=True))[:: 1 if r % 2 else -1]:
                cpu_kernels.layer_scratch = fn
                ps = [prompt(256) for _ in range(8)]
                t = time.perf_counter()
                e.generate(ps, one)
                scratch[name].append((time.perf_counter() - t) * 1e3)
        cpu_kernels.layer_scratch = reuse
        e.close()
        loads.append(os.getloadavg()[0])

    def row(label: str, xs: list[float], ref: list[float]) -> str:
        m, r = statistics.median(xs), statistics.median(ref)
        return f"| {label} | {m:.1f} | {min(xs):.1f}-{max(xs):.1f} | {r / m:.2f}x |"

    print(f"{cpu_name()}, {a.threads} threads, model {a.model_size}, {a.rounds} rounds a side")
    print(f"KV budget {base.kv_cache_bytes >> 20} MiB, step budget {base.max_num_batched_tokens}")
    print("\n| burst of 16 x 256 prompts, 64 out | ms (median) | spread | speed-up |")
    print("| --- | ---: | --- | ---: |")
    off = kv["first touch in the step"]
    for name, xs in kv.items():
        print(row(name, xs, off))
    print(f"\nidle work (prefault) over all rounds: {idle['prefault']:.2f} s")
    print("\n| 8 x 256-token prefill | ms (median) | spread | speed-up |")
    print("| --- | ---: | --- | ---: |")
    for name, xs in scratch.items():
        print(row(name, xs, scratch["fresh per forward"]))
    print(f"\nload average {min(loads):.2f}-{max(loads):.2f}")


if __name__ == "__main__":
    main()
