"""Per-tenant fair queuing: tenant B's TTFT when tenant A sends 10x B's request rate.

    .venv/bin/python -m loadtests.bench_fairness [--rate-b 0.5] [--ratio 10] [--duration 30] \\
        [--prompt-words 200] [--max-tokens 16] [--step-tokens 0,256] [--slice-tokens 0,128] \\
        [--no-fifo] [--lead-off] [--model DIR] [--json PATH]
    # a running cluster, with fair queuing as it is set there (one mode):
    .venv/bin/python -m loadtests.bench_fairness --url http://127.0.0.1:8000 \\
        --key-a KEY_A --key-b KEY_B

Without ``--url``, for each mode (fair queuing on, ``STRATA_FAIR_QUEUING=true``, and off,
``false``: first come, first served within a priority class) it starts a cluster as
``strata up --model DIR`` does (the shape this machine gets) with two API keys, tenant A
(``env-0``) and tenant B (``env-1``), weight 1 each, and runs two phases of ``--duration``
seconds: B alone at ``--rate-b`` requests/s (unloaded), then A at ``--ratio`` x that rate beside
B (loaded), each tenant from its own client process. ``--step-tokens`` gives one fair-queuing row
per ``STRATA_FAIR_STEP_TOKENS`` value (0: no step cap), ``--slice-tokens`` one per
``STRATA_FAIR_SLICE_TOKENS`` value (0: prompts and decodes in one step); ``--no-fifo`` skips the
FIFO row. Arrivals are Poisson, prompts unique (no prefix hits), every request streamed and
interactive. Prints one markdown table: B's TTFT p50 / p99 unloaded and loaded per mode, A's
loaded TTFT, requests and errors per tenant, the engines' steps over the loaded phase, the share
of B's requests that waited over 100 ms in an engine's queue (the rest of B's TTFT is its prefill
and the way there and back), and the load average; then a second table: the cores each kind of
process used over the loaded phase (`loadtests.loadgen.cpu`: every service, nats-server, the
benchmark's own clients, and a model process's busiest thread, its engine). ``--json`` writes
the rows.
With fair queuing, B's loaded TTFT should stay near its unloaded one while A's grows; without,
B waits behind A's backlog. docs/benchmarks/fairness.md has the command and the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import random
import time

import httpx

from loadtests.loadgen import cpu
from loadtests.loadgen.scrape import scrape
from loadtests.loadgen.workload import words

KEY_A, KEY_B = "bench-fairness-key-a", "bench-fairness-key-b"


async def send(cl: httpx.AsyncClient, model: str, key: str, prompt: str, max_tokens: int):
    """(HTTP status, TTFT seconds or None) of one streamed completion."""
    t0 = time.perf_counter()
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {key}"}
    try:
        async with cl.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                return r.status_code, None
            ttft = None
            async for line in r.aiter_lines():
                if ttft is None and line.startswith("data: ") and line != "data: [DONE]":
                    ttft = time.perf_counter() - t0
            return 200, ttft
    except httpx.HTTPError:
        return 0, None


async def phase(
    url: str, model: str, rates: dict[str, float], keys: dict[str, str], a: argparse.Namespace
) -> dict[str, list[tuple[int, float | None]]]:
    """Each tenant's Poisson stream at its rate for ``a.duration`` s; results by tenant."""
    rng = random.Random(f"{a.seed}:{sorted(rates.items())}")
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=url, timeout=a.timeout, limits=limits) as cl:
        tasks: dict[str, list[asyncio.Task]] = {t: [] for t in rates}

        async def tenant(name: str, rate: float) -> None:
            t_end = time.perf_counter() + a.duration
            while True:
                await asyncio.sleep(rng.expovariate(rate))
                if time.perf_counter() >= t_end:
                    return
                prompt = f"{name} " + " ".join(words(rng, a.prompt_words))  # unique
                coro = send(cl, model, keys[name], prompt, a.max_tokens)
                tasks[name].append(asyncio.create_task(coro))

        await asyncio.gather(*(tenant(n, r) for n, r in rates.items()))
        return {n: list(await asyncio.gather(*ts)) for n, ts in tasks.items()}


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def summary(res: list[tuple[int, float | None]]) -> dict:
    ttft = [t for s, t in res if s == 200 and t is not None]
    return {
        "requests": len(res),
        "errors": sum(1 for s, _ in res if s != 200),
        "ttft_p50_ms": round(pct(ttft, 0.5) * 1000, 1),
        "ttft_p99_ms": round(pct(ttft, 0.99) * 1000, 1),
    }


ENGINE_SERIES = (
    "strata:engine_step_seconds_bucket",
    "strata:engine_step_seconds_count",
    "strata:engine_step_seconds_sum",
    "strata_fair_split_steps_total",
    "strata_tenant_queue_wait_seconds_bucket",
    "strata_tenant_queue_wait_seconds_count",
)
TENANT_B = "env-1"  # the name `STRATA_API_KEYS` gives the second key


def engine_counts(urls: list[str]) -> dict[str, float]:
    """The engines' step-time histogram and split-step counter, summed over ``urls`` (each
    instance's ``/metrics``): {series or "le=<bound>": value}."""
    out: dict[str, float] = {}
    for url in urls:
        for k, v in scrape(url, {n: n for n in ENGINE_SERIES}, _bucket_key).items():
            out[k] = out.get(k, 0.0) + v
    return out


def _bucket_key(name: str, sample) -> str:
    """Step buckets by their bound; the queue-wait series by tenant (and bound)."""
    if name.startswith("strata_tenant_queue_wait"):
        tail = f"le={sample.labels['le']}" if name.endswith("_bucket") else "count"
        return f"wait:{sample.labels.get('tenant', '')}:{tail}"
    return f"le={sample.labels['le']}" if name.endswith("_bucket") else name


def engine_steps(before: dict[str, float], after: dict[str, float]) -> dict:
    """What the engines' steps were between two `engine_counts`: how many, their mean, the
    share longer than 100 ms (what an arrival may wait out) and how many were split; and the
    share of tenant B's requests that waited in an engine's queue over 100 ms before their
    first admission (the rest of B's TTFT is outside the queue: its prefill, the gateway,
    the tokenizer, NATS)."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    n = d.get("strata:engine_step_seconds_count", 0.0)
    if not n:
        return {}
    out = {
        "steps": int(n),
        "step_mean_ms": round(1000 * d["strata:engine_step_seconds_sum"] / n, 1),
        "steps_over_100ms_pct": round(100 * (1 - d.get("le=0.1", 0.0) / n), 1),
        "split_steps": int(d.get("strata_fair_split_steps_total", 0.0)),
    }
    waits = d.get(f"wait:{TENANT_B}:count", 0.0)
    if waits:
        under = d.get(f"wait:{TENANT_B}:le=0.1", 0.0)
        out["B_waits_over_100ms_pct"] = round(100 * (1 - under / waits), 1)
    return out


def run_phase(url: str, model: str, rates: dict[str, float], keys: dict[str, str], a) -> dict:
    return asyncio.run(phase(url, model, rates, keys, a))


def gateway_ttft(audit_files: list[str], identity: str, since: float, until: float) -> dict:
    """A tenant's TTFT as its gateways saw it (arrival to first token there, the audit log's
    ``ttft_ms``) for its requests that ended between ``since`` and ``until`` (wall clock):
    p50 / p99 in ms. Set beside the client's TTFT it says whether a tail is inside the
    cluster or on the way to and from it."""
    ttfts = []
    for path in audit_files:
        with contextlib.suppress(OSError), open(path) as f:
            for line in f:
                e = json.loads(line)
                if e.get("identity") == identity and since <= e["ts"] <= until:
                    if e.get("ttft_ms") is not None:
                        ttfts.append(e["ttft_ms"] / 1000)
    if not ttfts:
        return {}
    return {
        "requests": len(ttfts),
        "ttft_p50_ms": round(pct(ttfts, 0.5) * 1000, 1),
        "ttft_p99_ms": round(pct(ttfts, 0.99) * 1000, 1),
    }


def measure(
    url: str,
    model: str,
    keys: dict[str, str],
    a: argparse.Namespace,
    engines: list[str] = (),
    audit_files: list[str] = (),
) -> dict:
    """The two phases on one cluster: B alone, then A at ratio x B beside it. Each tenant is
    its own client process, as real tenants are: A's hundreds of open streams in the same
    event loop as B's made B's measured TTFT the client's own lag. ``engines``: the prefill and
    decode instances' ``/metrics``, whose steps during the loaded phase are reported too."""
    alone = run_phase(url, model, {"B": a.rate_b}, keys, a)
    load = os.getloadavg()[0]
    before = engine_counts(list(engines))
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        pool.submit(int).result()  # the worker is up: its start is not in the CPU shares
        cpu0, t0, wall0 = cpu.snapshot(), time.perf_counter(), time.time()
        heavy = pool.submit(run_phase, url, model, {"A": a.rate_b * a.ratio}, keys, a)
        light = run_phase(url, model, {"B": a.rate_b}, keys, a)
        both = {**heavy.result(), **light}
        cpu_loaded = cpu.cores_by_label(cpu0, cpu.snapshot(), time.perf_counter() - t0)
    return {
        "B_unloaded": summary(alone["B"]),
        "B_loaded": summary(both["B"]),
        "A_loaded": summary(both["A"]),
        "engine_loaded": engine_steps(before, engine_counts(list(engines))),
        "cpu_loaded": cpu_loaded,
        "B_loaded_at_gateway": gateway_ttft(list(audit_files), TENANT_B, wall0, time.time()),
        "load": round(max(load, os.getloadavg()[0]), 2),
    }


def with_cluster(
    model_dir: str,
    fair: bool,
    a: argparse.Namespace,
    log,
    step_tokens: int | None = None,
    lead: bool = True,
    slice_tokens: int | None = None,
) -> dict:
    from services.launcher import Cluster

    env = {
        "STRATA_API_KEYS": f"{KEY_A},{KEY_B}",
        "STRATA_FAIR_QUEUING": "true" if fair else "false",
    }
    if step_tokens is not None:
        env["STRATA_FAIR_STEP_TOKENS"] = str(step_tokens)
    if not lead:
        env["STRATA_FAIR_LEAD"] = "false"
    if slice_tokens is not None:
        env["STRATA_FAIR_SLICE_TOKENS"] = str(slice_tokens)
    with Cluster(model_dir, log_stream=log, die_with_parent=True, env=env) as c:
        model = os.path.basename(os.path.normpath(model_dir))
        engines = [
            f"http://127.0.0.1:{spec.env['STRATA_METRICS_PORT']}/metrics"
            for name, spec in c.specs.items()
            if name.startswith(("prefill-", "decode-"))
        ]
        audit = [
            os.path.join(c.log_dir, f"audit-{name}.jsonl")
            for name in c.specs
            if name.startswith("gateway-")
        ]
        return measure(c.gateway_url, model, {"A": KEY_A, "B": KEY_B}, a, engines, audit)


def table(rows: dict[str, dict]) -> str:
    out = [
        "| fair queuing | B TTFT p50 / p99 unloaded (ms) | B TTFT p50 / p99 loaded (ms) "
        "| A TTFT p50 / p99 loaded (ms) | requests A / B (errors) "
        "| engine steps loaded: mean ms, % over 100 ms, split "
        "| B's engine queue waits over 100 ms | B TTFT p50 / p99 loaded at the gateway (ms) "
        "| load |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, r in rows.items():
        bu, bl, al = r["B_unloaded"], r["B_loaded"], r["A_loaded"]
        e = r.get("engine_loaded") or {}
        steps = (
            f"{e['step_mean_ms']}, {e['steps_over_100ms_pct']}%, {e['split_steps']} of {e['steps']}"
            if e
            else "-"
        )
        g = r.get("B_loaded_at_gateway") or {}
        at_gw = f"{g['ttft_p50_ms']} / {g['ttft_p99_ms']}" if g else "-"
        out.append(
            f"| {mode} | {bu['ttft_p50_ms']} / {bu['ttft_p99_ms']} "
            f"| {bl['ttft_p50_ms']} / {bl['ttft_p99_ms']} "
            f"| {al['ttft_p50_ms']} / {al['ttft_p99_ms']} "
            f"| {al['requests']} / {bl['requests']} ({al['errors']} / {bl['errors']}) "
            f"| {steps} | {f'{w}%' if (w := e.get('B_waits_over_100ms_pct')) is not None else '-'} "
            f"| {at_gw} "
            f"| {r['load']} |"
        )
    return "\n".join(out)


def cpu_table(rows: dict[str, dict]) -> str:
    """Cores each kind of process used over the loaded phase, one row per mode."""
    labels: list[str] = []
    for r in rows.values():
        labels += [k for k in r.get("cpu_loaded", {}) if k not in labels]
    if not labels:
        return ""
    out = [
        "| cores used, loaded phase | " + " | ".join(labels) + " |",
        "| --- |" + " --- |" * len(labels),
    ]
    for mode, r in rows.items():
        c = r.get("cpu_loaded", {})
        out.append(f"| {mode} | " + " | ".join(str(c.get(k, "-")) for k in labels) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate-b", type=float, default=0.5, help="tenant B's requests per second")
    ap.add_argument("--ratio", type=float, default=10.0, help="tenant A's rate / B's")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds per phase")
    ap.add_argument("--prompt-words", type=int, default=200, help="about the prompt's tokens")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="", help="checkpoint (default: the benchmark model)")
    ap.add_argument("--url", default="", help="a running cluster's gateway (one mode only)")
    ap.add_argument("--served-model", default="", help="--url: the model name to ask for")
    ap.add_argument("--key-a", default="", help="--url: tenant A's API key")
    ap.add_argument("--key-b", default="", help="--url: tenant B's API key")
    ap.add_argument(
        "--step-tokens",
        default="",
        help="fair queuing on: one row per STRATA_FAIR_STEP_TOKENS value, e.g. 0,128,512 "
        "(0: no step cap; default: the deployment's default only)",
    )
    ap.add_argument(
        "--slice-tokens",
        default="",
        help="fair queuing on: one more row per STRATA_FAIR_SLICE_TOKENS value, e.g. 0,128 "
        "(0: prompt chunks share the decodes' step)",
    )
    ap.add_argument("--no-fifo", action="store_true", help="skip the FIFO row")
    ap.add_argument(
        "--lead-off",
        action="store_true",
        help="add a row with fair queuing on and STRATA_FAIR_LEAD=false (no step of its own "
        "for a light tenant's new request)",
    )
    ap.add_argument("--json", default="", help="also write the rows to this file")
    ap.add_argument("--log", default=os.devnull, help="cluster logs (default: discarded)")
    a = ap.parse_args(argv)
    if a.rate_b <= 0 or a.ratio <= 0 or a.duration <= 0:
        ap.error("--rate-b, --ratio and --duration must be > 0")
    if a.url:
        if not (a.key_a and a.key_b and a.served_model):
            ap.error("--url needs --key-a, --key-b and --served-model")
        keys = {"A": a.key_a, "B": a.key_b}
        rows = {"as set on the cluster": measure(a.url, a.served_model, keys, a)}
    else:
        from loadtests.bench_peer import model_for

        model_dir = os.path.abspath(a.model or model_for("25m"))
        caps = [int(x) for x in a.step_tokens.split(",") if x.strip()] or [None]
        with open(a.log, "a") as log:
            rows = {}
            for cap in caps:
                label = "on" if cap is None else f"on, step cap {cap or 'off'}"
                rows[label] = with_cluster(model_dir, True, a, log, cap)
            for n in (int(x) for x in a.slice_tokens.split(",") if x.strip()):
                rows[f"on, slice {n or 'off'}"] = with_cluster(
                    model_dir, True, a, log, None, slice_tokens=n
                )
            if a.lead_off:
                rows["on, lead off"] = with_cluster(model_dir, True, a, log, None, lead=False)
            if not a.no_fifo:
                rows["off (FIFO)"] = with_cluster(model_dir, False, a, log)
    print(table(rows))
    print()
    print(cpu_table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
