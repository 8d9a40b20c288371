"""The Mooncake trace through a real cluster of decode instances, beside the simulator's
prediction for the same requests and the same shape: does the real cluster reach the prefix hit
rate and load spread the simulator says it should?

    .venv/bin/python -m loadtests.simulator.realreplay --requests 1200 --decode 4 \\
        --kv-blocks 1024 --time-scale 0.15 [--out /tmp/realreplay.json]

Both sides replay the first ``--requests`` rows of the vendored trace, scaled as loadgen's
``--trace`` scales them (`loadtests.loadgen.trace`: a 512-token trace block becomes 16 words,
one engine block of 16 tokens, so a trace block and an engine block are the same unit; arrivals
times ``--time-scale``). Real: `strata up`'s colocated shape with ``--decode`` instances of
``--kv-blocks`` blocks each, the scheduler's ``prefix_aware`` policy (what `strata up` routes
data-parallel replicas with), no kvstore (engine-tier hits only), requests open-loop through
the REST gateway. Simulated: `Simulation` with no prefill instance and the same decode count,
engine cache (``--kv-blocks`` 16-token blocks), block size and arrivals, the same policy class.
Reported per side: the local prefix hit rate (prompt tokens found in the serving instance's
engine cache / prompt tokens) and the load spread (max / mean over the instances of the prompt
tokens each computed), and their real / simulated ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import time

from loadtests.loadgen.client import RunConfig, run_jobs, served_model
from loadtests.loadgen.scrape import scrape
from loadtests.loadgen.trace import (
    DEFAULT_TRACE,
    TraceRow,
    TraceScale,
    load_trace,
    row_prompt,
    scaled_lengths,
    trace_jobs,
)
from loadtests.simulator.cluster import SimConfig
from loadtests.simulator.realcluster import start_cluster
from loadtests.simulator.sim import Simulation
from loadtests.simulator.trace import TraceRequest
from services.cluster_config import ensure_model
from services.scheduler.policies import make_policy

QUERIES = "strata:prefix_cache_queries_total"
HITS = "strata:prefix_cache_hits_total"


def sim_trace(rows: list[TraceRow], scale: TraceScale, tok=None) -> list[TraceRequest]:
    """The rows as the simulator takes them, in the real run's units: 16-token blocks (one per
    trace block), the scaled input and output lengths and the scaled arrivals; only the full
    blocks of the scaled prompt carry a hash (an engine caches full blocks only).

    With ``tok`` (the served model's tokenizer) the prompts are the real run's token ids: the
    input length is the prompt's token count and each full block of ``scale.block_words``
    tokens is hashed over the ids up to its end, as an engine's prefix cache keys it. Without
    it a word is taken as one token and a trace block as one block, which undercounts where the
    vocabulary splits words (the built-in model: about 7% more tokens than words, so blocks
    shared in words end earlier in tokens and the caches fill faster than the words say)."""
    t0 = rows[0].timestamp_ms if rows else 0.0
    out = []
    for row in rows[: scale.max_requests]:
        n_in, n_out = scaled_lengths(row, scale)
        arrival = (row.timestamp_ms - t0) / 1000.0 * scale.time_scale
        if tok is None:
            full = min(len(row.hash_ids), n_in // scale.block_words)
            hashes = tuple(f"{h:x}" for h in row.hash_ids[:full])
        else:
            ids = tok.encode(row_prompt(row, scale), True)
            n_in, hashes = len(ids), token_block_hashes(ids, scale.block_words)
        out.append(TraceRequest(arrival, n_in, n_out, hashes))
    return out


def token_block_hashes(ids: list[int], block: int) -> tuple[str, ...]:
    """One chained digest per full ``block`` of ``ids`` (block i's covers ids[: (i+1)*block])."""
    out, h = [], hashlib.blake2b(digest_size=8)
    for i in range(len(ids) // block):
        h.update(b"".join(t.to_bytes(4, "little") for t in ids[i * block : (i + 1) * block]))
        out.append(h.copy().hexdigest())
    return tuple(out)


def simulate(
    trace: list[TraceRequest],
    decode: int,
    blocks: int,
    block: int,
    rate: float,
    load_interval: float = 0.0,
    shared_cache: bool = False,
) -> dict:
    """The simulator's prediction. ``load_interval`` and ``shared_cache`` are the two things a
    real instance does that the ideal simulation does not: report its load every interval (not
    at each decision), and hold its running sequences' blocks in the same cache."""
    cfg = SimConfig(
        num_prefill=0,
        num_decode=decode,
        prefill_tokens_per_s=rate,
        engine_cache_blocks=blocks,
        decode_kv_blocks=blocks,
        decode_max_batch=64,
        decode_step_s=0.015,
        decode_step_per_seq_s=0.0005,
        block_tokens=block,
        pool_enabled=False,
        ttft_slo_s=30.0,
        load_interval_s=load_interval,
        cache_holds_running=shared_cache,
    )
    r = Simulation(cfg, make_policy("prefix_aware")).run(trace)
    return {"hit_rate": r.hit_rate, "load_max_over_mean": r.load_max_over_mean}


def real(model_dir: str, jobs, decode: int, blocks: int, block_bytes: int, log: str) -> dict:
    """Replay ``jobs`` on a fresh colocated cluster; per decode instance the prompt tokens it
    looked up and found in its engine cache during the replay (its metrics, before and after)."""
    stream = open(log or os.devnull, "w")  # noqa: SIM115 - closed below
    c = start_cluster(
        model_dir,
        prefill=0,
        decode=decode,
        kvstore=0,
        vision=0,
        minio=False,
        torch_threads=1,
        log_stream=stream,
        role_args={
            "scheduler": ["--policy", "prefix_aware"],
            "decode": ["--kv-cache-bytes", str(blocks * block_bytes)],
        },
    )
    try:
        names = sorted(n for n in c.specs if n.startswith("decode-"))
        urls = {
            n: f"http://{c.cfg.host}:{c.specs[n].env['STRATA_METRICS_PORT']}/metrics" for n in names
        }
        cfg = RunConfig(url=c.gateway_url, request_timeout=300.0, deadline=900.0, progress=False)
        cfg.model = asyncio.run(served_model(c.gateway_url))
        before = {n: scrape(u, {QUERIES: QUERIES, HITS: HITS}) for n, u in urls.items()}
        t0 = time.perf_counter()
        results, _ = asyncio.run(run_jobs(jobs, cfg))
        wall = time.perf_counter() - t0
        after = {n: scrape(u, {QUERIES: QUERIES, HITS: HITS}) for n, u in urls.items()}
    finally:
        c.stop()
        stream.close()
    per = {}
    for n in names:
        q = after[n].get(QUERIES, 0.0) - before[n].get(QUERIES, 0.0)
        h = after[n].get(HITS, 0.0) - before[n].get(HITS, 0.0)
        per[n] = {"queried": q, "hit": h, "computed": q - h}
    queried = sum(p["queried"] for p in per.values()) or 1.0
    computed = [p["computed"] for p in per.values()]
    mean = sum(computed) / len(computed)
    return {
        "hit_rate": sum(p["hit"] for p in per.values()) / queried,
        "load_max_over_mean": max(computed) / mean if mean else float("nan"),
        "errors": sum(1 for r in results if not r.ok),
        "requests": len(results),
        "wall_s": round(wall, 1),
        "instances": per,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1200, help="trace rows (from its start)")
    p.add_argument("--decode", type=int, default=4)
    p.add_argument("--kv-blocks", type=int, default=1024, help="engine blocks per instance")
    p.add_argument("--time-scale", type=float, default=0.15, help="arrival offsets x this")
    p.add_argument(
        "--sim-prefill-tok-s",
        type=float,
        default=2000.0,
        help="the simulator's prefill rate per instance (the real one on a shared box)",
    )
    p.add_argument(
        "--sim-load-interval",
        type=float,
        default=0.5,
        help="seconds between the simulated instances' load reports (the workers' default)",
    )
    p.add_argument("--model", default="", help="checkpoint (default: the built-in model)")
    p.add_argument("--log", default="", help="the cluster's output goes here")
    p.add_argument("--out", default="", help="write the results as JSON here")
    a = p.parse_args(argv)

    from shared.model.api import KVCache
    from shared.model.loader import load_config

    model_dir = ensure_model(a.model)
    scale = TraceScale(time_scale=a.time_scale, max_requests=a.requests)
    rows = load_trace(DEFAULT_TRACE, a.requests)
    jobs = trace_jobs(rows, scale)
    mc = load_config(model_dir)
    import torch

    block_bytes = KVCache.bytes_per_block(
        mc.num_layers, scale.block_words, mc.num_kv_heads, mc.head_dim, torch.float32
    )
    from shared.model.tokenizer import Tokenizer

    trace = sim_trace(rows, scale, Tokenizer.from_dir(model_dir))
    args = (a.decode, a.kv_blocks, scale.block_words, a.sim_prefill_tok_s)
    ideal = simulate(trace, *args)
    sim = simulate(trace, *args, load_interval=a.sim_load_interval, shared_cache=True)
    got = real(model_dir, jobs, a.decode, a.kv_blocks, block_bytes, a.log)
    res = {
        "requests": a.requests,
        "decode": a.decode,
        "kv_blocks": a.kv_blocks,
        "time_scale": a.time_scale,
        "load_average": os.getloadavg()[0],
        "simulated_ideal": ideal,
        "simulated": sim,
        "real": got,
        "hit_ratio": got["hit_rate"] / sim["hit_rate"] if sim["hit_rate"] else float("nan"),
        "spread_ratio": got["load_max_over_mean"] / sim["load_max_over_mean"],
    }
    print("| side | local prefix hit | load max/mean | errors |")
    print("| --- | ---: | ---: | ---: |")
    print(
        f"| simulated, ideal (fresh load at each decision, a cache of its own) | "
        f"{ideal['hit_rate']:.1%} | {ideal['load_max_over_mean']:.2f} | - |"
    )
    print(
        f"| simulated (load every {a.sim_load_interval:g} s, cache shared with running) | "
        f"{sim['hit_rate']:.1%} | {sim['load_max_over_mean']:.2f} | - |"
    )
    print(
        f"| real | {got['hit_rate']:.1%} | {got['load_max_over_mean']:.2f} | "
        f"{got['errors']} of {got['requests']} |"
    )
    print(f"real / simulated: hit {res['hit_ratio']:.2f}, spread {res['spread_ratio']:.2f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
