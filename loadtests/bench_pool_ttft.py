"""TTFT of a prompt whose prefix the KV pool holds vs recomputing it, on the shape this box gets.

    .venv/bin/python -m loadtests.bench_pool_ttft [--model-size 25m|250m] [--tokens 2048 ...]
        [--rounds N]

One `strata up`-shaped cluster (the machine's default shape: colocated below 8 cores) with a
kvstore and MinIO. Each round and prompt length, alternating the order of the three cases:
- ``recompute``: a prompt no tier holds (a pool lookup misses, the decode instance computes it);
- ``dram``: a prompt served once, then the decode instance restarted (its graceful stop hands
  the blocks to the kvstore, or they were written through already with
  ``STRATA_KV_POOL_SAVE=all``; engine memory empty, kvstore DRAM intact);
- ``minio``: the same after the kvstore is restarted too (its DRAM empty, MinIO holds the blocks).
Each TTFT is a streamed completion's first token at max_tokens=1, measured at the client, with
the decode instance's pool counters (loads decided, bytes received) beside it. The default
`STRATA_KV_POOL_LOAD=auto` decides: the table says what it chose. Prints a markdown table
(docs/benchmarks/kvpool.md, "TTFT from the pool").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import httpx

from loadtests.loadgen.scrape import metrics_url, sample_total
from loadtests.simulator.realcluster import start_cluster
from services.cluster_config import ensure_model
from shared.model import default_model


def prompt_ids(seed: int, tokens: int) -> list[int]:
    """``tokens`` token ids no other prompt of the run shares (a token-id prompt, as vLLM takes)."""
    return [10 + (seed * 7919 + i * 104729) % 2000 for i in range(tokens)]


def scrape(c, name: str, metric: str) -> float:
    return sample_total(metrics_url(c, name), metric)


def ttft(c, model: str, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the first streamed token, prompt tokens)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, n = None, 0
    with httpx.stream("POST", c.gateway_url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and '"text"' in line:
                first = time.perf_counter() - t0
            if '"prompt_tokens"' in line:
                n = json.loads(line[6:])["usage"]["prompt_tokens"]
    return first or float("nan"), n


def wait_persisted(c, timeout: float = 600) -> None:
    """Until the kvstore has written every block behind to MinIO."""
    deadline = time.monotonic() + timeout
    while scrape(c, "kvstore-0", 'strata_kvstore_blocks{tier="write_behind"}') > 0:
        if time.monotonic() > deadline:
            raise TimeoutError("write-behind to MinIO did not finish")
        time.sleep(0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-size", choices=("25m", "250m"), default="250m")
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    cache = os.path.join(os.getcwd(), ".cache", "models")
    if args.model_size == "250m":
        model_dir = str(default_model.build_benchmark_model_250m(os.path.join(cache, "bench-250m")))
    else:
        model_dir = ensure_model("")
    data = tempfile.mkdtemp(prefix="strata-pool-ttft-")
    c = start_cluster(model_dir, data_dir=data, vision=0, kvstore=1)
    rows: dict[tuple[int, str], list[tuple[float, float, float]]] = {}
    try:
        model = httpx.get(c.gateway_url + "/v1/models").json()["data"][0]["id"]
        dec = "decode-0"
        ttft(c, model, prompt_ids(0, 64))  # first-request overheads
        seed = 1
        for r in range(args.rounds):
            for n in args.tokens:
                cases = ["recompute", "dram", "minio"]
                if r % 2:
                    cases = ["dram", "minio", "recompute"]  # alternate recompute's slot
                warm = prompt_ids(seed, n)
                seed += 1
                ttft(c, model, warm)  # computed once: pooled by the decode restart's stop flush
                time.sleep(1.0)
                wait_persisted(c)
                for case in cases:
                    prompt = warm
                    if case == "recompute":
                        prompt = prompt_ids(seed, n)
                        seed += 1
                    c.restart(dec)
                    if case == "minio":
                        c.restart("kvstore-0")
                    loads0 = scrape(c, dec, 'strata_kv_pool_load_decisions_total{decision="load"}')
                    got0 = scrape(c, dec, 'strata_kv_transfer_received_bytes_total{mode="pool"}')
                    s, tokens = ttft(c, model, prompt)
                    loads = scrape(c, dec, 'strata_kv_pool_load_decisions_total{decision="load"}')
                    got = scrape(c, dec, 'strata_kv_transfer_received_bytes_total{mode="pool"}')
                    rows.setdefault((n, case), []).append((s, loads - loads0, got - got0))
                    print(
                        f"round {r} {n} {case}: {s:.3f}s ({tokens} tokens), loads "
                        f"{loads - loads0:.0f}, pool bytes {got - got0:.0f}",
                        flush=True,
                    )
    finally:
        c.stop()
    print()
    shape = f"{len(c.names('prefill'))} prefill, {len(c.names('decode'))} decode"
    print(
        f"shape: {shape}; model {args.model_size}; {os.cpu_count()} cores; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print("| prompt | case | TTFT median (min-max) | vs recompute | pool loads | MB from pool |")
    print("| ---: | --- | --- | ---: | ---: | ---: |")
    for n in args.tokens:
        base = statistics.median(s for s, _, _ in rows[(n, "recompute")])
        for case in ("recompute", "dram", "minio"):
            xs = rows[(n, case)]
            ts = [s for s, _, _ in xs]
            med = statistics.median(ts)
            print(
                f"| {n} | {case} | {med:.3f} s ({min(ts):.3f}-{max(ts):.3f}) | "
                f"{base / med:.2f}x | {sum(x[1] for x in xs):.0f} | "
                f"{sum(x[2] for x in xs) / len(xs) / 1e6:.1f} |"
            )


if __name__ == "__main__":
    main()
