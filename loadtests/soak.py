"""Soak: many concurrent streams for minutes against the cluster `strata up` starts, reporting
errors and every process's resident memory at the start, along the way and at the end.

    .venv/bin/python -m loadtests.soak [--concurrency 500] [--minutes 10] [--model DIR]

Closed loop: ``--concurrency`` streamed chat completions in flight at all times (prompts of
16-64 words, 8-32 output tokens, a tenth of them sharing a system prompt so the prefix cache and
the pool see reuse), for ``--minutes``. RSS of each service process, nats-server and MinIO is
sampled every ``--sample-s`` seconds; the report gives errors by kind, completed requests, and per
process the RSS at the first sample after warm-up, the peak and the last, so growth is visible.
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


class Sampler(threading.Thread):
    """RSS of every process every ``every`` seconds until stopped."""

    def __init__(self, pids: dict[str, int], every: float) -> None:
        super().__init__(daemon=True)
        self.pids, self.every = pids, every
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        while not self.stop.is_set():
            self.samples.append(
                (time.monotonic() - t0, {n: rss_mib(p) for n, p in self.pids.items()})
            )
            self.stop.wait(self.every)


def job(rng: random.Random, i: int, system: str) -> Job:
    msgs = [{"role": "user", "content": " ".join(words(rng, rng.randint(16, 64)))}]
    if i % 10 == 0:
        msgs.insert(0, {"role": "system", "content": system})
    return Job(i, rng.randint(8, 32), messages=msgs)


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


def main() -> None:
    from services.cluster_config import ensure_model
    from services.launcher import Cluster

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=500)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--model", default="", help="checkpoint (default: the built-in model)")
    a = ap.parse_args()
    model_dir = ensure_model(a.model)
    with (
        open(os.devnull, "w") as sink,
        Cluster(
            model_dir, log_stream=sink, die_with_parent=True, log_level="WARNING", restart=True
        ) as c,
    ):
        pids = process_pids(c)
        sampler = Sampler(pids, a.sample_s)
        sampler.start()
        t = time.perf_counter()
        import httpx

        model = httpx.get(c.gateway_url + "/v1/models").json()["data"][0]["id"]
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
    for (status, msg), n in errors.most_common(10):
        print(f"- {n} x status {status}: {msg}")
    quarter = [
        samples[min(len(samples) - 1, round(q * (len(samples) - 1)))] for q in (0.25, 0.5, 0.75)
    ]
    print(
        "\n| process | RSS MiB after warm-up | at 25% / 50% / 75% of the run | peak | end |"
        " growth | alive at end |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | --- |")
    for name in pids:
        peak = max(s[1][name] for s in samples)
        mid = " / ".join(f"{q[1][name]:.0f}" for q in quarter)
        print(
            f"| {name} | {warm[name]:.0f} | {mid} | {peak:.0f} | {last[name]:.0f} | "
            f"{last[name] - warm[name]:+.0f} | {alive.get(name, True)} |"
        )


if __name__ == "__main__":
    main()
