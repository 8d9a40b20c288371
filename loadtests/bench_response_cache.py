"""Response cache: latency of a hit from each tier against a miss, on a `strata up` cluster.

    .venv/bin/python -m loadtests.bench_response_cache [--prompts 32] [--max-tokens 64]
        [--model DIR]

Starts `Cluster` as ``strata up`` does (the benchmark model unless ``--model``; kvstore and
MinIO on) with ``STRATA_RESPONSE_CACHE=true``, then sends ``--prompts`` distinct greedy chat
requests with ``"cache": true``, one at a time (latency, not throughput), non-streamed, in four
passes over the same prompts:

1. miss: nothing cached yet; the cluster generates and the gateway stores each answer;
2. hot: the gateway's memory;
3. warm: gateway restarted (its memory is empty), the kvstore's DRAM;
4. cold: kvstore and gateway restarted (DRAM empty too), the kvstore reads MinIO.

Every answer's ``X-Strata-Cache`` header must name the pass's tier and its choices must equal
the miss's; the table counts the ones that do not. Prints p50 / p99 / mean per pass and the
load average. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import httpx

PASSES = (("miss", "miss"), ("hot", "hit-hot"), ("warm", "hit-warm"), ("cold", "hit-cold"))


def prompts(n: int) -> list[str]:
    return [f"Request {i}: name three colours and count to {i % 7 + 3}." for i in range(n)]


def one_pass(client: httpx.Client, url: str, model: str, texts: list[str], max_tokens: int):
    """Per prompt: (seconds, X-Strata-Cache header, the choices)."""
    out = []
    for text in texts:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "cache": True,
        }
        t = time.perf_counter()
        r = client.post(url + "/v1/chat/completions", json=body)
        dt = time.perf_counter() - t
        r.raise_for_status()
        out.append((dt, r.headers.get("x-strata-cache", ""), r.json()["choices"]))
    return out


def row(name: str, got: list, want: str, ref: list | None) -> str:
    lat = sorted(dt * 1000 for dt, _, _ in got)
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
    wrong = sum(
        1
        for i, (_, state, choices) in enumerate(got)
        if state != want or (ref is not None and choices != ref[i][2])
    )
    return (
        f"| {name} | {len(got)} | {statistics.median(lat):.1f} | {p99:.1f} | "
        f"{statistics.fmean(lat):.1f} | {wrong} |"
    )


def main() -> None:
    from loadtests.bench_peer import model_for
    from services.launcher import Cluster

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default="", help="checkpoint directory (default: benchmark model)")
    a = ap.parse_args()
    model_dir = os.path.abspath(a.model or model_for("25m"))
    texts = prompts(a.prompts)
    log_path = os.path.join(tempfile.mkdtemp(prefix="bench-rcache-"), "strata.log")
    rows = []
    with open(log_path, "w") as log:
        env = {"STRATA_RESPONSE_CACHE": "true"}
        with Cluster(model_dir, log_stream=log, die_with_parent=True, env=env) as c:
            model = os.path.basename(model_dir)
            gw, kv = c.names("gateway")[0], c.names("kvstore")[0]
            load = os.getloadavg()[0]
            with httpx.Client(timeout=600) as client:
                results = {}
                for name, _ in PASSES:
                    if name == "warm":
                        c.restart(gw)
                    elif name == "cold":
                        c.restart(kv)  # a graceful stop: its MinIO writes are committed
                        c.restart(gw)
                    results[name] = one_pass(client, c.gateway_url, model, texts, a.max_tokens)
            ref = results["miss"]
            for name, want in PASSES:
                rows.append(row(name, results[name], want, None if name == "miss" else ref))
    print(f"### Response cache, {a.prompts} prompts x {a.max_tokens} tokens, greedy, one at a time")
    print(f"(load average {load:.2f} at the start; logs: {log_path})\n")
    print("| pass | requests | p50 ms | p99 ms | mean ms | wrong tier or body |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(rows))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
