"""The same prompts twice on one default cluster: is the second pass, whose prompts are all
prefix-cached somewhere, faster than the first?

    .venv/bin/python -m loadtests.bench_repeat [--repeats 1] [--kv-cache-bytes N]

Each repeat starts `Cluster` as ``strata up --model CK`` does (the benchmark model, the shape
this machine gets; ``--kv-cache-bytes`` sets ``STRATA_KV_CACHE_BYTES`` for every engine instead
of the memory-sized default), drives bench_peer's standard workload (64 prompts of 64-480
tokens, 64 out, concurrency 16; `drive` warms up on other prompts first), then the same 64
prompts again. Prints one markdown table: out tok/s, TTFT p50 / p99 and TBT medians of each
pass, and the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile

from loadtests.bench_cpu_knobs import runs_table
from loadtests.bench_peer import WORKLOADS, drive, model_for, run_stats
from loadtests.loadgen.client import RunConfig, run_jobs
from loadtests.loadgen.workload import Job


def one(model_dir: str, kv_bytes: int, log) -> tuple[dict, dict]:
    from services.launcher import Cluster

    wl = WORKLOADS["standard"]
    prompts = wl.prompts("standard")
    env = {"STRATA_KV_CACHE_BYTES": str(kv_bytes)} if kv_bytes else {}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with Cluster(model_dir, log_stream=log, die_with_parent=True, log_level="WARNING") as c:
            model = os.path.basename(model_dir)
            first = drive(c.gateway_url, model, prompts, wl)
            cfg = RunConfig(
                c.gateway_url, model, request_timeout=900, deadline=3600, progress=False
            )
            load = os.getloadavg()[0]
            jobs = [Job(i, wl.out, prompt=p) for i, p in enumerate(prompts)]
            res, wall = asyncio.run(run_jobs(jobs, cfg, concurrency=wl.conc))
            return first, {**run_stats(res, wall), "load": load}
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--kv-cache-bytes", type=int, default=0, help="0: the memory-sized default")
    a = ap.parse_args()
    model_dir = os.path.abspath(model_for("25m"))
    passes: dict[str, list[dict]] = {"first pass": [], "second pass (same prompts)": []}
    with open(os.path.join(tempfile.mkdtemp(prefix="bench-repeat-"), "strata.log"), "w") as log:
        for _ in range(a.repeats):
            for name, r in zip(passes, one(model_dir, a.kv_cache_bytes, log), strict=True):
                passes[name].append(r)
    kv = f"{a.kv_cache_bytes} B" if a.kv_cache_bytes else "memory-sized default"
    print(f"### Same prompts twice, KV budget {kv}, {a.repeats} cluster(s)\n")
    print("\n".join(runs_table("pass", passes)))


if __name__ == "__main__":
    main()
