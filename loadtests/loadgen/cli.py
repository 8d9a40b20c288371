"""``python -m loadtests.loadgen``: run a workload against a gateway and write a report.

    # against a running gateway, Poisson arrivals at 4 req/s
    python -m loadtests.loadgen --url http://127.0.0.1:8000 --rate 4 --num-requests 64
    # self-hosted cluster on the default model, concurrency sweep
    python -m loadtests.loadgen --start-cluster --concurrency 1,4,16 --num-requests 32
    # shared-prefix tenants, some requests with an image
    python -m loadtests.loadgen --start-cluster --tenants 4 --system-prompt-tokens 128 \
        --image-fraction 0.25 --concurrency 8
    # Mooncake trace, scaled down
    python -m loadtests.loadgen --start-cluster --trace --max-requests 32 --time-scale 0.1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator

from loadtests.loadgen.client import RunConfig, check_loopback, run_jobs, served_model
from loadtests.loadgen.report import write_report
from loadtests.loadgen.stats import RequestResult, Summary, summarize
from loadtests.loadgen.trace import DEFAULT_TRACE, TraceScale, load_trace, trace_jobs
from loadtests.loadgen.workload import Job, SyntheticSpec, poisson_arrivals, synthetic_jobs


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtests.loadgen",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    g = p.add_argument_group("target")
    g.add_argument("--url", default="", help="gateway base URL (loopback only)")
    g.add_argument("--start-cluster", action="store_true", help="start a local Cluster")
    g.add_argument("--model", default="", help="checkpoint for --start-cluster (default model)")
    g.add_argument("--model-name", default="", help="served model name (default: /v1/models)")
    g.add_argument("--prefill", type=int, default=1)
    g.add_argument("--decode", type=int, default=1)
    g.add_argument("--vision", type=int, default=1)
    g.add_argument("--kvstore", type=int, default=1)
    g.add_argument("--torch-threads", type=int, default=1)
    g = p.add_argument_group("workload")
    g.add_argument("--num-requests", type=int, default=32, help="requests (per sweep level)")
    g.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second")
    g.add_argument("--concurrency", default="", help="closed loop: one level or a sweep 1,4,16")
    g.add_argument("--input-min", type=int, default=64, help="user-part words (about tokens)")
    g.add_argument("--input-max", type=int, default=256)
    g.add_argument("--output-tokens", type=int, default=32)
    g.add_argument("--tenants", type=int, default=0, help="tenants sharing a system prompt each")
    g.add_argument("--system-prompt-tokens", type=int, default=0)
    g.add_argument("--image-fraction", type=float, default=0.0)
    g.add_argument("--api", choices=("chat", "completion"), default="chat")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--slo-class", default="", help="X-Strata-Slo-Class header")
    g.add_argument("--ttft-slo-ms", type=float, default=0.0, help="X-Strata-TTFT-SLO-Ms header")
    g = p.add_argument_group("trace replay")
    g.add_argument(
        "--trace",
        nargs="?",
        const=str(DEFAULT_TRACE),
        default="",
        help="replay a Mooncake JSONL trace (default: the shared one)",
    )
    g.add_argument("--max-requests", type=int, default=64, help="trace rows used")
    g.add_argument("--length-scale", type=float, default=1 / 32)
    g.add_argument("--output-scale", type=float, default=1 / 16)
    g.add_argument("--time-scale", type=float, default=1.0)
    g.add_argument("--max-input", type=int, default=512)
    g.add_argument("--max-output", type=int, default=64)
    g = p.add_argument_group("bounds and output")
    g.add_argument("--request-timeout", type=float, default=120.0)
    g.add_argument("--duration", type=float, default=600.0, help="deadline per run/level (s)")
    g.add_argument("--out", default="loadgen-out", help="folder for results.json, report.md")
    g.add_argument("--no-progress", action="store_true")
    return p


def levels(text: str) -> list[int]:
    """``"1,4,16"`` -> [1, 4, 16] (each >= 1)."""
    out = [int(x) for x in text.split(",") if x.strip()]
    if any(c < 1 for c in out):
        raise ValueError(f"--concurrency levels must be >= 1, got {text!r}")
    return out


def build_jobs(a: argparse.Namespace) -> list[Job]:
    if a.trace:
        scale = TraceScale(
            a.length_scale,
            a.output_scale,
            a.time_scale,
            a.max_input,
            a.max_output,
            a.max_requests,
            a.seed,
        )
        jobs = trace_jobs(load_trace(a.trace, a.max_requests), scale)
    else:
        spec = SyntheticSpec(
            a.num_requests,
            a.input_min,
            a.input_max,
            a.output_tokens,
            a.tenants,
            a.system_prompt_tokens,
            a.image_fraction,
            a.api == "chat",
            a.seed,
        )
        arrivals = poisson_arrivals(a.num_requests, a.rate, a.seed) if a.rate else None
        jobs = synthetic_jobs(spec, arrivals)
    if a.concurrency:  # closed loop ignores arrival times
        for j in jobs:
            j.arrival = 0.0
    return jobs


@contextlib.contextmanager
def target(a: argparse.Namespace) -> Iterator[str]:
    """The gateway URL: ``--url``, or a cluster started here and stopped on exit."""
    if not a.start_cluster:
        if not a.url:
            raise SystemExit("give --url or --start-cluster")
        check_loopback(a.url)
        yield a.url.rstrip("/")
        return
    from services.launcher import Cluster

    print("starting cluster ...", file=sys.stderr)
    with (
        open(os.devnull, "w") as sink,
        Cluster(
            a.model,
            prefill=a.prefill,
            decode=a.decode,
            vision=a.vision,
            kvstore=a.kvstore,
            minio=a.kvstore > 0,
            torch_threads=a.torch_threads,
            log_stream=sink,
            die_with_parent=True,
            log_level="WARNING",
        ) as c,
    ):
        yield c.gateway_url


async def run(
    a: argparse.Namespace, url: str
) -> tuple[list[RequestResult], Summary, list[Summary]]:
    headers = {}
    if a.slo_class:
        headers["X-Strata-Slo-Class"] = a.slo_class
    if a.ttft_slo_ms:
        headers["X-Strata-TTFT-SLO-Ms"] = str(a.ttft_slo_ms)
    cfg = RunConfig(
        url,
        a.model_name or await served_model(url),
        a.request_timeout,
        a.duration,
        headers=headers,
        progress=not a.no_progress,
    )
    jobs = build_jobs(a)
    if not a.concurrency:
        results, wall = await run_jobs(jobs, cfg, desc="open loop")
        return results, summarize(results, wall), []
    results, sweep, total = [], [], 0.0
    for c in levels(a.concurrency):
        level_jobs = [Job(**{**j.__dict__, "index": len(results) + j.index}) for j in jobs]
        res, wall = await run_jobs(level_jobs, cfg, concurrency=c, desc=f"concurrency {c}")
        sweep.append(summarize(res, wall, c))
        results += res
        total += wall
    return results, summarize(results, total), sweep


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    t = time.time()
    with target(a) as url:
        results, overall, sweep = asyncio.run(run(a, url))
    config = {k: v for k, v in vars(a).items() if v not in ("", None, False)}
    config["started_at"] = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    path = write_report(a.out, config, overall, results, sweep)
    print(json.dumps(overall.to_dict(), default=str))
    print(f"report: {path}", file=sys.stderr)
    return 0 if overall.ok == overall.requests else 1
