"""Soak: many concurrent streams for minutes against the cluster `strata up` starts, reporting
errors and every process's resident memory at the start, along the way and at the end.

    .venv/bin/python -m loadtests.soak [--concurrency 500] [--minutes 10] [--model DIR]

Closed loop: ``--concurrency`` streamed chat completions in flight at all times (prompts of
16-64 words, 8-32 output tokens, a tenth of them sharing a system prompt so the prefix cache and
the pool see reuse), for ``--minutes``. RSS of each service process, nats-server and MinIO is
sampled every ``--sample-s`` seconds; the report gives errors by kind, completed requests, and per
process the RSS at the first sample after warm-up, at each quarter and at the end, and its peak in
the first and in the second half of the run: growth is the second peak over the first.
Alongside RSS it samples what could be growing inside the two stateful processes: nats-server's
own view of its memory and of each JetStream stream (its HTTP monitoring endpoint,
``--nats-monitor-port``) and the scheduler's prefix index and snapshots (its ``/metrics``).

Before the measured run the soak fills the engines' KV caches (``--warmup-minutes``, 0 = skip):
unique prompts of about a thousand words, one output token each, until every prefill and decode
instance reports as many prefix-cached blocks as it has (``strata:kv_cache_cached_blocks`` =
``strata:kv_cache_total_blocks``, within 2%). From then on every new block evicts one, so the
caches, and the scheduler's index of them, are at their size: what still grows is growth. On
the default shape the cache holds tens of thousands of blocks, more than a 10-minute run of short
prompts writes, so without this step the run measures the caches filling.
Traffic goes to the loopback gateway only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import threading
import time
from collections import Counter

from loadtests.loadgen.client import RunConfig, new_client, send
from loadtests.loadgen.scrape import scrape
from loadtests.loadgen.workload import Job, words


def rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def process_pids(c) -> dict[str, int]:
    pids = {n: p.proc.pid for n, p in c.sup.procs.items() if p.proc is not None}
    for name, server in (("nats-server", c.nats), ("minio", c.minio)):
        if server is not None and server.proc is not None:
            pids[name] = server.proc.pid
    return pids


def nats_state(monitor_url: str) -> dict[str, float]:
    """nats-server's memory (MiB, as it reports it), subscriptions, connections, and each
    JetStream stream's messages and MiB (its monitoring endpoint); empty when unreachable."""
    import httpx

    try:
        varz = httpx.get(f"{monitor_url}/varz", timeout=5).json()
        jsz = httpx.get(f"{monitor_url}/jsz", params={"streams": "true"}, timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return {}
    out = {
        "nats mem MiB": varz.get("mem", 0) / 2**20,
        "nats subscriptions": varz.get("subscriptions", 0),
        "nats connections": varz.get("connections", 0),
        "nats JetStream memory MiB": jsz.get("memory", 0) / 2**20,
    }
    for account in jsz.get("account_details") or []:
        for stream in account.get("stream_detail") or []:
            state = stream.get("state") or {}
            out[f"{stream['name']} messages"] = state.get("messages", 0)
            out[f"{stream['name']} MiB"] = state.get("bytes", 0) / 2**20
    return out


SCHEDULER_SERIES = {
    "strata_scheduler_prefix_index_blocks": "scheduler index blocks",
    "strata_scheduler_snapshot_bytes": "scheduler snapshot bytes",
    "strata_scheduler_kv_events_purges_total": "scheduler event purges",
    "strata_scheduler_kv_events_total": "scheduler KV events applied",
    "python_gc_objects_collected_total": "scheduler gc collected",
}


def scheduler_state(metrics_url: str) -> dict[str, float]:
    """The scheduler's prefix index size, snapshot size, purges and KV events applied."""
    return scrape(metrics_url, SCHEDULER_SERIES)


class Sampler(threading.Thread):
    """RSS of every process, and each ``probes`` reading, every ``every`` seconds until
    stopped."""

    def __init__(self, pids: dict[str, int], every: float, probes=()) -> None:
        super().__init__(daemon=True)
        self.pids, self.every, self.probes = pids, every, list(probes)
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.inside: list[dict[str, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        while not self.stop.is_set():
            self.samples.append(
                (time.monotonic() - t0, {n: rss_mib(p) for n, p in self.pids.items()})
            )
            inside: dict[str, float] = {}
            for probe in self.probes:
                inside.update(probe())
            self.inside.append(inside)
            self.stop.wait(self.every)


def job(rng: random.Random, i: int, system: str) -> Job:
    msgs = [{"role": "user", "content": " ".join(words(rng, rng.randint(16, 64)))}]
    if i % 10 == 0:
        msgs.insert(0, {"role": "system", "content": system})
    return Job(i, rng.randint(8, 32), messages=msgs)


KV_FILL = {"strata:kv_cache_cached_blocks": "cached", "strata:kv_cache_total_blocks": "total"}


def kv_fill(metrics_urls: list[str]) -> tuple[float, float]:
    """Prefix-cached and total engine KV blocks over ``metrics_urls`` (each instance's
    ``/metrics``)."""
    cached = total = 0.0
    for url in metrics_urls:
        got = scrape(url, KV_FILL)
        cached += got.get("cached", 0.0)
        total += got.get("total", 0.0)
    return cached, total


async def warm_up(
    url: str, model: str, metrics_urls: list[str], seconds: float, concurrency: int = 8
) -> tuple[float, float, float]:
    """Unique long prompts (1 output token) until the engines' caches are full (cached blocks
    within 2% of the total) or ``seconds`` pass; returns (seconds taken, cached, total)."""
    cfg = RunConfig(url, model, request_timeout=120, deadline=seconds + 120, progress=False)
    rng = random.Random(2)
    t0 = time.perf_counter()
    end = t0 + seconds
    fill = [0.0, 1.0]
    full = asyncio.Event()

    async def watch() -> None:
        while not full.is_set() and time.perf_counter() < end:
            fill[:] = await asyncio.to_thread(kv_fill, metrics_urls)
            if fill[1] and fill[0] >= 0.98 * fill[1]:
                full.set()
            await asyncio.sleep(1.0)

    async with new_client(concurrency) as client:

        async def worker(w: int) -> None:
            i = w
            while not full.is_set() and time.perf_counter() < end:
                msgs = [{"role": "user", "content": " ".join(words(rng, 1000))}]
                await send(client, Job(i, 1, messages=msgs), cfg, t0)
                i += concurrency

        watcher = asyncio.create_task(watch())
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        full.set()
        await watcher
    return time.perf_counter() - t0, fill[0], fill[1]


async def drive(url: str, model: str, concurrency: int, seconds: float) -> tuple[Counter, int]:
    cfg = RunConfig(url, model, request_timeout=120, deadline=seconds + 180, progress=False)
    rng = random.Random(0)
    system = " ".join(words(random.Random(1), 200))
    errors: Counter = Counter()
    done = 0
    end = time.perf_counter() + seconds
    async with new_client(concurrency) as client:
        t0 = time.perf_counter()

        async def worker(w: int) -> None:
            nonlocal done
            i = w
            while time.perf_counter() < end:
                r = await send(client, job(rng, i, system), cfg, t0)
                i += concurrency
                if r.ok:
                    done += 1
                else:
                    errors[(r.status, (r.error or "")[:80])] += 1

        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return errors, done


def half_peaks(series: list[float]) -> tuple[float, float]:
    """Peak of the first and of the second half of ``series`` (the first sample, taken as the
    run starts, left out). A process whose memory swings with its garbage collector (Go's
    nats-server and MinIO, CPython's arenas) has the same peaks in both halves at steady state;
    one that grows has a higher second peak. "growth" in the report is second / first - 1."""
    body = series[1:] if len(series) > 2 else series
    mid = len(body) // 2
    return max(body[: mid or 1]), max(body[mid:] or body)


def main() -> None:
    from services.cluster_config import ensure_model
    from services.launcher import Cluster

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=500)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument(
        "--warmup-minutes",
        type=float,
        default=5.0,
        help="at most this long filling the engines' KV caches before the run (0 = skip)",
    )
    ap.add_argument("--model", default="", help="checkpoint (default: the built-in model)")
    a = ap.parse_args()
    model_dir = ensure_model(a.model)
    from services.infra.procs import free_port

    monitor = free_port()
    with (
        open(os.devnull, "w") as sink,
        Cluster(
            model_dir,
            log_stream=sink,
            die_with_parent=True,
            log_level="WARNING",
            restart=True,
            nats_monitor_port=monitor,
        ) as c,
    ):
        import httpx

        model = httpx.get(c.gateway_url + "/v1/models").json()["data"][0]["id"]
        engines = [
            f"http://{c.cfg.host}:{c.specs[n].env['STRATA_METRICS_PORT']}/metrics"
            for n in c.names()
            if n.rsplit("-", 1)[0] in ("prefill", "decode")
        ]
        warm_s, cached, total = 0.0, *kv_fill(engines)
        if a.warmup_minutes > 0:
            warm_s, cached, total = asyncio.run(
                warm_up(c.gateway_url, model, engines, a.warmup_minutes * 60)
            )
        pids = process_pids(c)
        scheduler_metrics = c.specs["scheduler-0"].env["STRATA_METRICS_PORT"]
        probes = [
            lambda: nats_state(f"http://{c.cfg.host}:{monitor}"),
            lambda: scheduler_state(f"http://{c.cfg.host}:{scheduler_metrics}/metrics"),
        ]
        sampler = Sampler(pids, a.sample_s, probes)
        sampler.start()
        t = time.perf_counter()
        errors, done = asyncio.run(drive(c.gateway_url, model, a.concurrency, a.minutes * 60))
        wall = time.perf_counter() - t
        sampler.stop.set()
        sampler.join()
        alive = {n: c.alive(n) for n in c.sup.procs}
        restarts = {n: k for n, k in c.watchdog.restarts().items() if k}
    samples = sampler.samples
    warm = samples[min(1, len(samples) - 1)][1]
    last = samples[-1][1]
    print(
        f"Soak: {a.concurrency} concurrent streams for {wall / 60:.1f} min on {model_dir} "
        f"(load average {os.getloadavg()[0]:.2f}): {done} completed, "
        f"{sum(errors.values())} errors, restarts {restarts or 'none'}\n"
    )
    print(
        f"Warm-up: {warm_s:.0f} s; engine KV blocks prefix-cached at its end: {cached:.0f} of "
        f"{total:.0f}{'' if total and cached >= 0.98 * total else ' (not full)'}\n"
    )
    for (status, msg), n in errors.most_common(10):
        print(f"- {n} x status {status}: {msg}")
    quarter = [
        samples[min(len(samples) - 1, round(q * (len(samples) - 1)))] for q in (0.25, 0.5, 0.75)
    ]
    print(
        "\n| process | RSS MiB after warm-up | at 25% / 50% / 75% of the run | end | "
        "peak, first / second half | growth | alive at end |"
    )
    print("| --- | ---: | --- | ---: | --- | ---: | --- |")
    for name in pids:
        first, second = half_peaks([s[1][name] for s in samples])
        mid = " / ".join(f"{q[1][name]:.0f}" for q in quarter)
        print(
            f"| {name} | {warm[name]:.0f} | {mid} | {last[name]:.0f} | {first:.0f} / "
            f"{second:.0f} | {100 * (second / first - 1):+.1f}% | {alive.get(name, True)} |"
        )
    inside = sampler.inside
    at = [min(len(inside) - 1, round(q * (len(inside) - 1))) for q in (0.25, 0.5, 0.75)]
    keys = sorted({k for d in inside for k in d})
    if keys:
        print("\n| inside the process | after warm-up | at 25% / 50% / 75% | end |")
        print("| --- | ---: | --- | ---: |")
        for k in keys:
            row = [d.get(k, float("nan")) for d in inside]
            mid = " / ".join(f"{row[i]:.4g}" for i in at)
            print(f"| {k} | {row[min(1, len(row) - 1)]:.4g} | {mid} | {row[-1]:.4g} |")


if __name__ == "__main__":
    main()
