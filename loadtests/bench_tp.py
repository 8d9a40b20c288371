"""Tensor parallelism on this box: `strata up --tp 1` vs `--tp 2`, and what the all-reduces cost.

    .venv/bin/python -m loadtests.bench_tp [--tp 1 2] [--repeats 2] [--prompts 32]
        [--concurrency 8] [--prompt-words 200] [--max-tokens 64] [--model DIR]

For each repeat, alternating the order of the TP degrees, one `strata up`-shaped cluster (the
machine's default shape, kvstore and MinIO on) serves the same closed-loop workload through the
REST gateway (loadgen's client: streamed completions, greedy, ``ignore_eos``). A row per run:
output tokens/s, TTFT p50 / p99, TPOT p50, and from decode-0's metrics the bytes all-reduced
and engine steps taken. Then two gloo ranks on this machine time an all-reduce of the size one
call of those steps had on average (bytes per step / (2 x layers)) and the row's all-reduce
time per step is that x 2 x layers: what TP's collectives cost per step against the gloo
bandwidth. On a 2-core CPU TP is expected to cost, not gain: both ranks share the same cores
and every layer adds two all-reduces (docs/benchmarks/tp.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loadtests.loadgen.client import RunConfig, run_jobs, served_model
from loadtests.loadgen.scrape import metrics_url, sample_total
from loadtests.loadgen.stats import summarize
from loadtests.loadgen.workload import Job, words
from loadtests.simulator.realcluster import start_cluster
from services.cluster_config import ensure_model
from services.infra.procs import free_port


def scrape(c, name: str, metric: str) -> float:
    return sample_total(metrics_url(c, name), metric)


def jobs(n: int, prompt_words: int, max_tokens: int, seed: int) -> list[Job]:
    rng = random.Random(seed)
    return [
        Job(index=i, max_tokens=max_tokens, prompt=" ".join(words(rng, prompt_words)))
        for i in range(n)
    ]


def run_once(model_dir: str, tp: int, a: argparse.Namespace, seed: int) -> dict:
    c = start_cluster(model_dir, tp=tp, data_dir=tempfile.mkdtemp(prefix=f"bench-tp{tp}-"))
    try:
        cfg = RunConfig(url=c.gateway_url, progress=False)
        cfg.model = asyncio.run(served_model(c.gateway_url))
        warm = jobs(2, a.prompt_words, 8, seed + 1000)
        asyncio.run(run_jobs(warm, cfg, concurrency=2))
        b0 = scrape(c, "decode-0", "strata_tp_allreduce_bytes_total")
        s0 = scrape(c, "decode-0", "strata:engine_steps_total")
        work = jobs(a.prompts, a.prompt_words, a.max_tokens, seed)
        results, wall = asyncio.run(run_jobs(work, cfg, concurrency=a.concurrency))
        steps = scrape(c, "decode-0", "strata:engine_steps_total") - s0
        nbytes = scrape(c, "decode-0", "strata_tp_allreduce_bytes_total") - b0
        s = summarize(results, wall, a.concurrency)
        if s.ok < s.requests:
            print(f"tp {tp}: {s.requests - s.ok} failed: {s.errors_by_status}")
        return {
            "tp": tp,
            "ok": s.ok,
            "requests": s.requests,
            "out_tok_s": s.output_tokens_per_s,
            "ttft_p50_ms": s.ttft.p50 * 1e3,
            "ttft_p99_ms": s.ttft.p99 * 1e3,
            "tpot_p50_ms": s.tbt.p50 * 1e3,
            "steps": steps,
            "allreduce_bytes": nbytes,
            "load": os.getloadavg()[0],
        }
    finally:
        c.stop()


def _allreduce_rank(rank: int, port: int, numel: int, iters: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        x = torch.ones(numel)
        for _ in range(5):
            dist.all_reduce(x)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        dt = (time.perf_counter() - t0) / iters
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"seconds_per_call": dt}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def gloo_allreduce_seconds(nbytes: int, iters: int = 500, trials: int = 3) -> float:
    """Seconds one 2-rank gloo all-reduce of ``nbytes`` (float32) takes on this machine: the
    median of ``trials`` fresh process groups, each timing ``iters`` calls."""
    numel = max(1, nbytes // 4)
    got = []
    for _ in range(trials):
        out = os.path.join(tempfile.mkdtemp(prefix="bench-tp-ar-"), "ar.json")
        mp.spawn(_allreduce_rank, args=(free_port(), numel, iters, out), nprocs=2, join=True)
        with open(out) as f:
            got.append(json.load(f)["seconds_per_call"])
    return statistics.median(got)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prompt-words", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--model", default="", help="checkpoint (default: the benchmark model)")
    a = p.parse_args()
    model_dir = a.model or ensure_model("", benchmark=True)
    with open(os.path.join(model_dir, "config.json")) as f:
        layers = json.load(f)["num_hidden_layers"]
    rows = []
    for r in range(a.repeats):
        order = a.tp if r % 2 == 0 else list(reversed(a.tp))
        for tp in order:
            rows.append(run_once(model_dir, tp, a, seed=r))
    print(f"model {model_dir} ({layers} layers), {a.prompts} prompts of ~{a.prompt_words} words,")
    print(f"{a.max_tokens} out, concurrency {a.concurrency}, {a.repeats} runs per TP degree\n")
    print(
        "| tp | run | ok | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | all-reduced "
        "MB/step | all-reduce ms/step (gloo) | load |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for i, row in enumerate(rows):
        per_step = row["allreduce_bytes"] / row["steps"] if row["steps"] else 0.0
        ms = 0.0
        if per_step:
            ms = gloo_allreduce_seconds(int(per_step / (2 * layers))) * 2 * layers * 1e3
        print(
            f"| {row['tp']} | {i // len(a.tp) + 1} | {row['ok']}/{row['requests']} | "
            f"{row['out_tok_s']:.1f} | {row['ttft_p50_ms']:.0f} | {row['ttft_p99_ms']:.0f} | "
            f"{row['tpot_p50_ms']:.1f} | {per_step / 1e6:.3f} | {ms:.2f} | {row['load']:.2f} |"
        )
    for tp in a.tp:
        got = [r["out_tok_s"] for r in rows if r["tp"] == tp]
        print(
            f"\ntp {tp}: out tok/s median {statistics.median(got):.1f}, spread "
            f"{min(got):.1f}-{max(got):.1f}"
        )


if __name__ == "__main__":
    main()
