"""Gateway benchmarks: P2 (cluster through the gateway vs the in-process engine), the latency
the gateway adds per request, and 500 concurrent streams.

    .venv/bin/python -m loadtests.bench_gateway [--quick] [--only p2,latency,streams,cpu]

P2 runs every side in this one invocation on the standard benchmark model
(``build_benchmark_model``): the same prompts (64 of 64-480 tokens, made of one-token words),
64 output tokens, greedy, ignore_eos, concurrency 16; ``--repeats`` runs per side, alternated.
Sides: the in-process engine (``--threads`` torch threads, the whole 2-core box at 2), the
cluster as `strata up` starts it by default (the shape `services/shape.py` picks for the box:
on 2 cores decode prefills with 2 threads, + kvstore + MinIO), and the flattering decode-only cluster as a second row. Prints a markdown table
with median, best, spread and the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time

import torch

from loadtests.loadgen.client import RunConfig, run_jobs
from loadtests.loadgen.stats import summarize
from loadtests.loadgen.workload import Job, words


def proc_cpu(pids: list[int]) -> float:
    """CPU seconds (user + system, threads included) the processes ``pids`` used so far."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def p2_prompts(n: int, seed: int = 0, lo: int = 64, hi: int = 480) -> list[str]:
    rng = random.Random(f"p2:{seed}")
    return [" ".join(words(rng, rng.randint(lo, hi))) for _ in range(n)]


def engine_side(model_dir: str, prompts: list[str], out_len: int, conc: int, threads: int) -> dict:
    """The in-process engine on the same token ids the tokenizer service produces, all prompts
    offered at once with at most ``conc`` running (the cluster's concurrency)."""
    from shared.engine.engine import LLMEngine
    from shared.model.loader import load_model
    from shared.model.tokenizer import Tokenizer
    from shared.protocol.sampling import SamplingParams
    from shared.worker.config import WorkerConfig
    from shared.worker.kv_budget import kv_budget_for

    torch.set_num_threads(threads)
    tok = Tokenizer.from_dir(model_dir)
    ids = [tok.encode(p) for p in prompts]
    wcfg = WorkerConfig.load([], role="decode", max_num_seqs=conc)
    loaded = load_model(model_dir)
    eng = LLMEngine(loaded, wcfg.engine_config(kv_budget_for(wcfg, loaded)[0]))  # as decode's
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    with torch.inference_mode():
        eng.generate(ids[:2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        t, cpu = time.perf_counter(), time.process_time()
        out = eng.generate(ids, sp)
        wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    eng.close()
    return {
        "wall": wall,
        "cpu": cpu,
        "tokens": sum(map(len, out)),
        "errors": 0,
        "prompt_tokens": sum(map(len, ids)),
        "ttft_p50": float("nan"),
    }


def cluster_side(model_dir: str, prompts: list[str], out_len: int, conc: int, **cluster_kw) -> dict:
    """A fresh `Cluster` (as `strata up` starts it, with ``cluster_kw`` on top), driven through
    the gateway by the load generator; CPU is summed over every service process."""
    from services.launcher import Cluster

    jobs = [Job(i, out_len, prompt=p) for i, p in enumerate(prompts)]
    with (
        open(os.devnull, "w") as sink,
        Cluster(
            model_dir, log_stream=sink, die_with_parent=True, log_level="WARNING", **cluster_kw
        ) as c,
    ):
        cfg = RunConfig(
            c.gateway_url,
            os.path.basename(model_dir),
            request_timeout=600,
            deadline=1800,
            progress=False,
        )
        warm = [Job(1000 + i, 2, prompt=p) for i, p in enumerate(prompts[:2])]
        asyncio.run(run_jobs(warm, cfg, concurrency=2))
        pids = {n: p.proc.pid for n, p in c.sup.procs.items()}
        for name, server in (("nats-server", c.nats), ("minio", c.minio)):
            if server is not None and server.proc is not None:
                pids[name] = server.proc.pid
        before = {n: proc_cpu([pid]) for n, pid in pids.items()}
        res, wall = asyncio.run(run_jobs(jobs, cfg, concurrency=conc))
        per_proc = {n: proc_cpu([pid]) - before[n] for n, pid in pids.items()}
    s = summarize(res, wall, conc)
    return {
        "wall": wall,
        "cpu": sum(per_proc.values()),
        "per_proc": per_proc,
        "tokens": s.completion_tokens,
        "prompt_tokens": s.prompt_tokens,
        "errors": s.requests - s.ok,
        "ttft_p50": s.ttft.p50,
        "tbt_p50": s.tbt.p50,
    }


def cpu_per_token(n: int, out_len: int) -> list[str]:
    """Where the default cluster's CPU goes: CPU ms per output token of every process (model,
    services, nats-server, MinIO) on the standard workload, against the in-process engine's."""
    from shared.model.default_model import build_benchmark_model

    model_dir = str(build_benchmark_model(os.path.join(".cache", "models", "benchmark")))
    prompts = p2_prompts(n)
    eng = engine_side(model_dir, prompts, out_len, 16, 2)
    c = cluster_side(model_dir, prompts, out_len, 16)
    rows = [
        f"CPU per output token, default cluster vs in-process engine ({n} prompts, {out_len} "
        f"out, concurrency 16; load average {os.getloadavg()[0]:.2f}):",
        "",
        "| process | CPU ms per output token | share |",
        "| --- | ---: | ---: |",
    ]
    total = c["cpu"]
    for name, sec in sorted(c["per_proc"].items(), key=lambda kv: -kv[1]):
        rows.append(f"| {name} | {sec / c['tokens'] * 1e3:.2f} | {sec / total:.0%} |")
    rows.append(f"| **cluster total** | **{total / c['tokens'] * 1e3:.2f}** | 100% |")
    rows.append(f"| in-process engine | {eng['cpu'] / eng['tokens'] * 1e3:.2f} | |")
    return rows


P2_SIDES = {
    # What `strata up --model CK` starts: the machine's shape (services/shape.py; on 2 cores
    # decode prefills with 2 torch threads) + kvstore + MinIO.
    "cluster default (strata up)": dict(),
    # Disaggregated by hand on the same 2 cores: prefill 1 + decode 1 (1 thread each), the shape
    # `strata up` picked before the shape rule (what P2 used to quote).
    "cluster --prefill 1 (disaggregated)": dict(prefill=1),
    # The flattering variant: the default shape without kvstore and MinIO.
    "cluster decode-only, no kvstore/MinIO": dict(prefill=0, kvstore=0, minio=False),
}


def p2(n: int, out_len: int, threads: int, repeats: int) -> list[str]:
    """Each side ``repeats`` times, alternated (engine, cluster default, cluster decode-only,
    engine, ...), on the same box: median, best and spread of out tok/s per side, and the ratio
    of the cluster medians to the engine median. The engine gets ``threads`` torch threads (the
    whole box at 2); the clusters get the same box."""
    from shared.model.default_model import build_benchmark_model

    model_dir = str(build_benchmark_model(os.path.join(".cache", "models", "benchmark")))
    prompts = p2_prompts(n)
    conc = 16
    runs: dict[str, list[dict]] = {"in-process engine": [], **{k: [] for k in P2_SIDES}}
    load = [os.getloadavg()[0]]
    for _ in range(repeats):
        runs["in-process engine"].append(engine_side(model_dir, prompts, out_len, conc, threads))
        for name, kw in P2_SIDES.items():
            runs[name].append(cluster_side(model_dir, prompts, out_len, conc, **kw))
        load.append(os.getloadavg()[0])
    rates = {k: [r["tokens"] / r["wall"] for r in v] for k, v in runs.items()}
    base = statistics.median(rates["in-process engine"])
    rows = [
        f"P2: {n} prompts of 64-480 tokens, {out_len} out, greedy, ignore_eos, concurrency "
        f"{conc}, benchmark model; {repeats} runs per side, alternated; engine {threads} torch "
        f"threads; load average (1 min) {min(load):.2f}-{max(load):.2f}",
        "",
        "| side | out tok/s median | best | spread (min-max) | ratio (median / engine median)"
        " | TTFT p50 median | out tok per CPU-s | errors |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for name, rs in runs.items():
        r = rates[name]
        per_cpu = statistics.median(x["tokens"] / x["cpu"] for x in rs)
        ttft = statistics.median(x["ttft_p50"] for x in rs) * 1e3
        rows.append(
            f"| {name} | {statistics.median(r):.1f} | {max(r):.1f} | {min(r):.1f}-"
            f"{max(r):.1f} | {statistics.median(r) / base:.2f} | "
            f"{'-' if ttft != ttft else f'{ttft:.0f} ms'} | {per_cpu:.1f} | "
            f"{sum(x['errors'] for x in rs)} |"
        )
    return rows


_PEERS = """
import asyncio, sys, time
from shared import bus
from shared.protocol import subjects
from shared.protocol.load import LoadReport
from tests.gateway.peers import ROLES, Peers

async def main():
    nc = await bus.connect(sys.argv[1], "bench-peers")
    fakes = ROLES if sys.argv[2] == "all" else ()  # "decode": real tokenizer and scheduler
    peers = await Peers(nc, max_model_len=4096).start(fakes)
    await peers.add_decode("dec-0")
    print("ready", flush=True)
    while True:  # load reports, so that a real scheduler sees the instant decode as live
        await bus.publish(nc, subjects.load_report("decode", "dec-0"), LoadReport(
            instance_id="dec-0", role="decode", incarnation="bench", ts=time.time(),
            kv_blocks_total=4096, kv_blocks_free=4096, max_model_len=4096))
        await asyncio.sleep(0.25)

asyncio.run(main())
"""


# The HTTP floor: a bare ASGI app under the same uvicorn + httptools stack that reads the body
# and streams one OpenAI-shaped chunk and [DONE] at once. Client TTFT against it is what any
# HTTP server costs this client (connection handling, request parse, one SSE write), so
# "gateway-added" = TTFT through the gateway minus this, measured alternately in one run.
_FLOOR = """
import json, sys, uvicorn

CHUNK = json.dumps({"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "tiny",
                    "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]})

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    body = b""
    while True:
        m = await receive()
        body += m.get("body", b"")
        if not m.get("more_body"):
            break
    if scope["path"] == "/health":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
        return
    json.loads(body)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})
    await send({"type": "http.response.body",
                "body": f"data: {CHUNK}\\n\\ndata: [DONE]\\n\\n".encode()})

uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", http="httptools")
"""


def _wait_http(url: str, timeout: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy after {timeout:.0f}s")


def latency(n: int, real: bool) -> list[str]:
    """Client TTFT of a 1-token stream through a real gateway process, minus a bare HTTP
    server's, measured alternately. ``real``: the real tokenizer and scheduler services (default
    model) are in the path and only decode is an instant fake; else every bus peer is an instant
    fake (tests/gateway/peers.py) in another process — the gateway's own cost alone."""
    import subprocess
    import sys

    from services.cluster_config import ensure_model
    from services.infra.nats_server import start_nats
    from services.infra.procs import free_port

    nats = start_nats(data_dir=tempfile.mkdtemp(prefix="bench-nats-"))
    port = free_port()
    env = {
        **os.environ,
        "STRATA_NATS_URL": nats.url,
        "STRATA_PORT": str(port),
        "STRATA_MODEL_NAME": "tiny",
        "STRATA_LOG_LEVEL": "WARNING",
        "STRATA_FIRST_TOKEN_TIMEOUT": "30",
        "PYTHONPATH": os.getcwd(),
    }
    if real:  # text requests only: no vision service in this path
        env.update(STRATA_MODEL=ensure_model(""), STRATA_MAX_IMAGES="0")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _PEERS, nats.url, "decode" if real else "all"],
            env=env,
            stdout=subprocess.PIPE,
        )
    ]
    for role in ("tokenizer", "scheduler") if real else ():
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "services.cli", "serve", role],
                env=env,
                stdout=subprocess.DEVNULL,
            )
        )
    procs.append(
        subprocess.Popen(
            [sys.executable, "-m", "services.cli", "serve", "gateway"],
            env=env,
            stdout=subprocess.DEVNULL,
        )
    )
    floor_port = free_port()
    procs.append(subprocess.Popen([sys.executable, "-c", _FLOOR, str(floor_port)], env=env))
    url = f"http://127.0.0.1:{port}"
    floor_url = f"http://127.0.0.1:{floor_port}"
    peers = "real tokenizer + scheduler, instant fake decode" if real else "instant fake peers"
    rows = [
        f"Gateway-added latency ({peers}, {n} requests per round, 3 rounds alternating with a "
        f"bare HTTP server, ~40-word prompt, 1 output token, client TTFT; load average "
        f"{os.getloadavg()[0]:.2f}):"
    ]
    try:
        procs[0].stdout.readline()
        _wait_http(url)
        _wait_http(floor_url)
        _wait_ready(url)
        text = " ".join(["word"] * 40)
        for conc in (1, 16):
            jobs = [Job(i, 1, messages=[{"role": "user", "content": text}]) for i in range(n)]
            got: dict[str, list[float]] = {url: [], floor_url: []}
            for _ in range(3):
                for u in (url, floor_url):
                    cfg = RunConfig(u, "tiny", request_timeout=30, deadline=300, progress=False)
                    asyncio.run(run_jobs(jobs[:50], cfg, concurrency=conc))  # warm-up
                    res, _ = asyncio.run(run_jobs(jobs, cfg, concurrency=conc))
                    ttft = [r.ttft for r in res if r.ok]
                    assert len(ttft) == n, [r.error for r in res if not r.ok][:3]
                    got[u] += ttft
            gw, fl = got[url], got[floor_url]
            q = statistics.quantiles(gw, n=100)
            med = statistics.median(gw) - statistics.median(fl)
            rows.append(
                f"- concurrency {conc}: through the gateway median "
                f"{statistics.median(gw) * 1e3:.2f} ms, p90 {q[89] * 1e3:.2f} ms, "
                f"p99 {q[98] * 1e3:.2f} ms; bare HTTP server median "
                f"{statistics.median(fl) * 1e3:.2f} ms -> gateway-added median "
                f"{med * 1e3:.2f} ms"
            )
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
        nats.stop()
    return rows


def _wait_ready(url: str, timeout: float = 120.0) -> None:
    """Until the gateway's readiness says every role it needs answers."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} never became ready")


def streams(n: int, out_len: int) -> list[str]:
    from services.cluster_config import ensure_model
    from services.launcher import Cluster

    model_dir = ensure_model("")
    rng = random.Random("streams")
    jobs = [
        Job(i, out_len, messages=[{"role": "user", "content": " ".join(words(rng, 12))}])
        for i in range(n)
    ]
    with (
        open(os.devnull, "w") as sink,
        Cluster(
            model_dir,
            prefill=1,
            decode=1,
            vision=0,
            kvstore=0,
            minio=False,
            log_stream=sink,
            die_with_parent=True,
            log_level="WARNING",
            torch_threads=1,
        ) as c,
    ):
        cfg = RunConfig(c.gateway_url, "default", request_timeout=300, deadline=600, progress=False)
        res, wall = asyncio.run(run_jobs(jobs, cfg, concurrency=n))
    s = summarize(res, wall, n)
    errs = s.errors_by_status or "none"
    return [
        f"{n} concurrent streams (default tiny model, prefill=1 decode=1, {out_len} tokens "
        f"each, all sent at once):",
        f"- ok {s.ok}/{s.requests}, errors {errs}, wall {wall:.1f} s, "
        f"{s.output_tokens_per_s:.0f} out tok/s, TTFT p50 {s.ttft.p50:.2f} s / "
        f"p99 {s.ttft.p99:.2f} s, TBT p50 {s.tbt.p50 * 1e3:.0f} ms",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="16 P2 prompts, 200 latency samples")
    ap.add_argument("--only", default="p2,latency,streams")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the engine (P2)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per side, alternated (P2)")
    a = ap.parse_args()
    only = set(a.only.split(","))
    if "latency" in only:  # the real path first; the gateway-alone figure is the second row
        for real in (True, False):
            print("\n".join(latency(200 if a.quick else 1000, real)) + "\n", flush=True)
    if "streams" in only:
        print("\n".join(streams(500, 8)) + "\n", flush=True)
    if "cpu" in only:
        print("\n".join(cpu_per_token(16 if a.quick else 64, 64)) + "\n", flush=True)
    if "p2" in only:
        print("\n".join(p2(16 if a.quick else 64, 64, a.threads, a.repeats)) + "\n", flush=True)


if __name__ == "__main__":
    main()
