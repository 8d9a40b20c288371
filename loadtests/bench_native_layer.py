"""The one-call decoder layer (`shared/model/layer.c`) against the op-at-a-time path, in one
engine, alternated, behind docs/benchmarks/engine.md "One call per decoder layer".

    .venv/bin/python -m loadtests.bench_native_layer [--model-size 25m|250m] [--rounds 6]

One in-process `LLMEngine` as the decode worker builds it, the benchmark model, ``--threads``
torch threads. Decode: ``--batch`` sequences prefilled to ``--ctx`` tokens, then rounds of
``--steps`` timed steps (after 3 untimed ones) with `llama.NATIVE_LAYER` on and off, the order
flipped each round, so both sides see the same VM drift. Prefill: one fresh ``--prompt``-token
prompt per side per round, alternated the same way. Reports the median per round, their
median and spread, and the load average.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-size", choices=("25m", "250m"), default="25m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--prompt", type=int, default=512)
    a = ap.parse_args()

    from loadtests.bench_peer import model_for
    from shared.engine.engine import LLMEngine
    from shared.model import cpu_kernels
    from shared.model.loader import load_model
    from shared.model.models import llama
    from shared.protocol.sampling import SamplingParams
    from shared.worker.config import WorkerConfig
    from shared.worker.kv_budget import kv_budget_for

    torch.set_num_threads(a.threads)
    loaded = load_model(model_for(a.model_size))
    wcfg = WorkerConfig.load([], role="decode", max_num_seqs=a.batch)
    eng = LLMEngine(loaded, wcfg.engine_config(kv_budget_for(wcfg, loaded)[0]))
    rng = random.Random("bench_native_layer")
    vocab = min(loaded.config.vocab_size, 4096)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    sides = {True: "one call per layer", False: "op at a time"}
    decode: dict[bool, list[float]] = {True: [], False: []}
    prefill: dict[bool, list[float]] = {True: [], False: []}
    loads = []
    calls = cpu_kernels.layer_calls
    with torch.inference_mode():
        eng.generate([prompt(32)], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        sp = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)
        for i in range(a.batch):
            eng.add_request(f"d{i}", prompt(a.ctx), sp)
        while any(s.num_computed_tokens < a.ctx for s in eng.seqs.values()):
            eng.step()
        for r in range(a.rounds):
            for native in (True, False) if r % 2 == 0 else (False, True):
                llama.NATIVE_LAYER = native
                for _ in range(3):
                    eng.step()
                ts = []
                for _ in range(a.steps):
                    t = time.perf_counter()
                    eng.step()
                    ts.append(time.perf_counter() - t)
                decode[native].append(statistics.median(ts))
            loads.append(os.getloadavg()[0])
        for i in range(a.batch):
            eng.abort_request(f"d{i}")
        while eng.has_unfinished_requests():
            eng.step()
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        for r in range(a.rounds):
            for native in (True, False) if r % 2 == 0 else (False, True):
                llama.NATIVE_LAYER = native
                p = prompt(a.prompt)  # fresh tokens: no prefix-cache hit
                t = time.perf_counter()
                eng.generate([p], one)
                prefill[native].append(time.perf_counter() - t)
    eng.close()
    if cpu_kernels.layer_calls == calls:
        raise SystemExit("the one-call layer never ran (no C compiler, or not CPU float32?)")

    cfg = loaded.config
    print(
        f"### bench_native_layer: {a.model_size} model (hidden {cfg.hidden_size}, "
        f"{cfg.num_layers} layers), {a.threads} threads, {a.rounds} rounds per side, alternated\n"
    )
    print("| side | decode step, ms (median of rounds) | spread | prefill, ms | spread |")
    print("| --- | ---: | --- | ---: | --- |")
    for native in (True, False):
        d, p = [x * 1e3 for x in decode[native]], [x * 1e3 for x in prefill[native]]
        print(
            f"| {sides[native]} | {statistics.median(d):.2f} | {min(d):.2f}-{max(d):.2f} "
            f"| {statistics.median(p):.1f} | {min(p):.1f}-{max(p):.1f} |"
        )
    ratio_d = statistics.median(decode[False]) / statistics.median(decode[True])
    ratio_p = statistics.median(prefill[False]) / statistics.median(prefill[True])
    print(
        f"\ndecode {a.batch} seqs x {a.ctx} ctx: one call per layer {ratio_d:.2f}x; "
        f"prefill of {a.prompt} tokens: {ratio_p:.2f}x; load average "
        f"{min(loads):.2f}-{max(loads):.2f}"
    )


if __name__ == "__main__":
    main()
